"""Files shipped inside installed Python packages: the offline corpora every layer may read (the tiny target
trains its tokenizer on chitchat text; the data layer reads chitchat and HumanEval prompts)."""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Conversation:
    """A chitchat-dataset conversation: its id and its messages (alternating speakers)."""
    id: str
    messages: tuple[str, ...]


def package_file(package: str, *parts: str) -> Path:
    """A file inside an installed package, located without importing it. Raises ``FileNotFoundError`` naming
    the package and its pip name when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {package!r} package is not installed (pip install {package.replace('_', '-')})")
    return Path(spec.origin).parent.joinpath(*parts)


@functools.lru_cache(maxsize=1)
def chitchat_conversations() -> tuple[Conversation, ...]:
    """The 7,168 conversations of ``chitchat-dataset``, sorted by id; a message joins its utterances."""
    path = package_file("chitchat_dataset", "dataset.json")
    raw = json.loads(path.read_text())
    return tuple(Conversation(cid, tuple(" ".join(u["text"] for u in m) for m in raw[cid]["messages"]))
                 for cid in sorted(raw))
