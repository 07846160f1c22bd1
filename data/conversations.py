"""Rows of any common chat format -> normalised conversations, with bad input counted or refused.

Formats (``data.format``, ``auto`` tells them apart by their fields):
- ``messages``: OpenAI ``[{"role": ..., "content": ...}]``; a file written by ``train/regenerate.py`` is one too, and
  what it adds is kept: each answer's ``token_ids`` (trained as generated, not re-encoded) and ``unfinished``
  (answers cut by the token budget train without an end-of-turn token, which the target never produced); a row's
  ``answered`` (int) marks its first answers as the target's own, kept by regeneration;
- ``sharegpt``: ``conversations: [{"from": "human"|"gpt"|"system", "value": ...}]``;
- ``prompt``: a single prompt (``prompt``, ``question``, ``instruction`` (+ ``input``), or MT-Bench ``turns``);
- ``tokenized``: ``input_ids`` + ``loss_mask`` lists, used as they are (no template, no regeneration).

Normalisation: roles become system/user/assistant (human/gpt/model/bot... mapped), empty turns are dropped,
consecutive turns of one role are merged (joined by a blank line), a system prompt may only come first.
Every rejected row raises :class:`BadRow` naming where it is (its 0-based row in the file or dataset, and a file's
1-based line), the field and a short ``reason`` the data report counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from draftheads.data.batching import DataReport
from draftheads.data.sources import (SOURCES, Prompt, PromptSource, builtin_prompts, chitchat_messages, hub_rows,
                                     row_location)

ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "model": "assistant", "bot": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "bing": "assistant", "tool": None}
"""Role names of the common formats -> normalised role (None: a role draftheads cannot train on)."""

FORMATS = ("auto", "messages", "sharegpt", "prompt", "tokenized")


class BadRow(ValueError):
    """A row that cannot become a training conversation. ``reason`` is the data report's key."""

    def __init__(self, where: str, field_name: str, reason: str, detail: str):
        super().__init__(f"{where}: field {field_name!r}: {detail}")
        self.where, self.field, self.reason = where, field_name, reason


@dataclass(frozen=True)
class Chat:
    """One normalised conversation: ``messages`` as ``{"role", "content"}`` dicts (roles system?, then user
    and assistant; an answer may keep the ``token_ids`` the target generated), or ``tokens`` ``(input_ids,
    loss_mask)`` for pre-tokenised rows; provenance ``source`` (file or dataset) and 0-based ``row``."""
    source: str
    row: int
    messages: tuple[dict, ...] = ()
    tokens: tuple[tuple[int, ...], tuple[bool, ...]] | None = None
    unfinished: tuple[int, ...] = ()
    """Indices (into ``messages``) of answers the target left unfinished at its token budget."""
    thinking: bool | None = None
    """The thinking mode it is rendered and answered in (True, False; None: the template's default), chosen per
    row by ``data.thinking_fraction`` (:func:`~draftheads.data.pipeline.with_thinking`)."""
    answered: int = 0
    """How many leading assistant turns the target already wrote with the job's generation settings: regeneration
    keeps them and answers the user turns after them (a self-made follow-up's first answer)."""

    @property
    def kept(self) -> int:
        """The number of leading ``messages`` regeneration keeps: up to the ``answered``-th assistant turn, else
        the system prompt if any."""
        return kept_prefix(self.messages, self.answered)

    @property
    def where(self) -> str:
        return row_location(self.source, self.row)



def kept_prefix(messages, answered: int) -> int:
    """The number of leading ``messages`` (dicts with ``role``) up to and with the ``answered``-th assistant turn
    (for 0: the system prompt if one leads, else none)."""
    if answered == 0:
        return int(bool(messages) and messages[0]["role"] == "system")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return answers[answered - 1] + 1


def read_jsonl(path: str | Path) -> Iterator[tuple[str, int, object]]:
    """``(where, row, parsed value or BadRow)`` per non-blank line of a JSONL file; ``row`` is 0-based as every
    source's rows are, ``where`` names it and the 1-based line an editor shows (``f.jsonl row 4 (line 5)``).
    Invalid UTF-8 and invalid JSON come back as BadRow, so one bad line loses nothing else."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = row_location(str(path), line_no - 1)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield where, line_no - 1, BadRow(where, "<line>", "invalid_utf8", f"invalid UTF-8 ({e.reason} at "
                                                                                 f"byte {e.start})")
                continue
            if not text.strip():
                continue
            try:
                yield where, line_no - 1, json.loads(text)
            except json.JSONDecodeError as e:
                yield where, line_no - 1, BadRow(where, "<line>", "invalid_json", f"invalid JSON ({e})")


def detect_format(row: dict) -> str:
    """The format of one row, from its fields (see the module docstring)."""
    if "input_ids" in row:
        return "tokenized"
    if "messages" in row:
        return "messages"
    if "conversations" in row:
        return "sharegpt"
    return "prompt"


def to_chat(row: object, where: str, source: str, index: int, fmt: str = "auto", field: str | None = None) -> Chat:
    """Normalise one raw row; ``field`` names the column holding the prompt or the turns (default: by format).
    A row-level system prompt (:data:`SYSTEM_FIELDS`) leads the turns of any format. Raises :class:`BadRow`
    (reasons: not_an_object, missing_field, missing_role, unknown_role, non_string_content, empty_conversation,
    system_not_first, system_twice, no_user_turn, bad_tokens, bad_unfinished, bad_answered, failed_regeneration).
    A ``messages`` row's ``answered`` (an int, default 0) says how many of its leading assistant turns the target
    already wrote (:attr:`Chat.answered`)."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(where, "<row>", "not_an_object", f"expected a JSON object, got {type(row).__name__}")
    if isinstance(row.get("error"), str):  # a regeneration file's failed row holds the input, not answers
        raise BadRow(where, "error", "failed_regeneration", f"the target failed on this row: {row['error']}")
    if field is not None:
        turns = _field_turns(row, where, field)
    else:
        fmt = detect_format(row) if fmt == "auto" else fmt
        if fmt not in FORMATS:
            raise ValueError(f"data.format={fmt!r} is not one of {FORMATS}")
        if fmt == "tokenized":
            return Chat(source, index, tokens=_tokens(row, where))
        if fmt == "prompt":
            turns = [{"role": "user", "content": _prompt_text(row, where)}]
        else:
            key, role_key, content_key = ("messages", "role", "content") if fmt == "messages" else \
                ("conversations", "from", "value")
            turns = _turns(row, where, key, role_key, content_key)
    turns = _with_system_field(row, turns, where)
    messages = normalise(_mark_unfinished(row, turns, where), where)
    unfinished = tuple(i for i, m in enumerate(messages) if m.pop("unfinished", False))
    thinking = row.get("thinking") if isinstance(row.get("thinking"), bool) else None  # a regeneration file's mode
    answered = row.get("answered", 0)
    answers = sum(m["role"] == "assistant" for m in messages)
    if isinstance(answered, bool) or not isinstance(answered, int) or not 0 <= answered <= answers:
        raise BadRow(where, "answered", "bad_answered", f"must be an int in 0..{answers} (the leading assistant turns "
                                                        f"the target wrote), got {answered!r}")
    return Chat(source, index, messages=tuple(messages), unfinished=unfinished, thinking=thinking, answered=answered)


SYSTEM_FIELDS = ("system", "system_prompt")
"""Row-level fields that hold a conversation's system prompt beside its turns or prompt (LLaMA-Factory's ShareGPT
and Alpaca rows, OpenOrca's ``system_prompt``)."""


def _with_system_field(row: dict, turns: list[dict], where: str) -> list[dict]:
    """``turns`` led by the row's system prompt when a :data:`SYSTEM_FIELDS` field holds a non-empty string and
    the turns have no system turn of their own (one in both is a :class:`BadRow`, ``system_twice``: which one
    the row means is not said)."""
    name = next((f for f in SYSTEM_FIELDS if isinstance(row.get(f), str) and row[f].strip()), None)
    if name is None:
        return turns
    if turns and turns[0]["role"] == "system":
        raise BadRow(where, name, "system_twice", "a system prompt both in this field and as the first turn")
    return [{"role": "system", "content": _utf8(row[name], where, name)}, *turns]


def _mark_unfinished(row: dict, turns: list[dict], where: str) -> list[dict]:
    """``turns`` with the answers the row's ``unfinished`` indices name (a regeneration file's: indices into its
    turns) flagged ``unfinished``, a flag :func:`normalise` carries to the turn's normalised place."""
    if row.get("unfinished") is None:
        return turns
    marked = row["unfinished"]
    if not isinstance(marked, list) or not all(isinstance(i, int) and 0 <= i < len(turns)
                                               and turns[i]["role"] == "assistant" for i in marked):
        raise BadRow(where, "unfinished", "bad_unfinished", f"must list indices of assistant turns (0..{len(turns) - 1}"
                                                            f"), got {marked!r}")
    return [dict(t, unfinished=True) if i in marked else t for i, t in enumerate(turns)]


def _tokens(row: dict, where: str) -> tuple[tuple[int, ...], tuple[bool, ...]]:
    ids, mask = row.get("input_ids"), row.get("loss_mask")
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids) or not ids:
        raise BadRow(where, "input_ids", "bad_tokens", "must be a non-empty list of token ids")
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1, True, False) for m in mask):
        raise BadRow(where, "loss_mask", "bad_tokens", f"must be a list of 0/1 as long as input_ids ({len(ids)})")
    return tuple(ids), tuple(bool(m) for m in mask)


def _prompt_text(row: dict, where: str) -> str:
    for name in ("prompt", "question", "instruction", "turns"):
        if name in row:
            value = _prompt_value(row[name], name, where)
            if name == "instruction" and isinstance(row.get("input"), str) and row["input"].strip():
                value = f"{value}\n\n{row['input']}"  # Alpaca: instruction + optional input
            return value
    raise BadRow(where, "prompt|question|instruction|turns|messages|conversations", "missing_field",
                 f"no conversation or prompt field (fields: {sorted(row)})")


def _prompt_value(value: object, name: str, where: str) -> str:
    """A prompt column's text: a string, or the first of a list of strings (MT-Bench turns)."""
    if isinstance(value, list):
        name, value = f"{name}[0]", value[0] if value else None
    if not isinstance(value, str):
        raise BadRow(where, name, "non_string_content", f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise BadRow(where, name, "empty_conversation", "must be a non-empty string")
    return _utf8(value, where, name)


def _field_turns(row: dict, where: str, name: str) -> list[dict]:
    """The turns held by column ``name``: a chat (OpenAI role/content or ShareGPT from/value) or a prompt."""
    if name not in row:
        raise BadRow(where, name, "missing_field", f"no such field (fields: {sorted(row)})")
    value = row[name]
    if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
        return _turns(row, where, name, *(("role", "content") if "role" in value[0] else ("from", "value")))
    return [{"role": "user", "content": _prompt_value(value, name, where)}]


def _turns(row: dict, where: str, key: str, role_key: str, content_key: str) -> list[dict]:
    turns = row[key]
    if not isinstance(turns, list):
        raise BadRow(where, key, "not_an_object", f"must be a list of turns, got {type(turns).__name__}")
    out = []
    for i, turn in enumerate(turns):
        name = f"{key}[{i}]"
        if not isinstance(turn, dict) or role_key not in turn:
            raise BadRow(where, f"{name}.{role_key}", "missing_role", "missing role")
        role = ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise BadRow(where, f"{name}.{role_key}", "unknown_role",
                         f"unknown role {turn[role_key]!r} (known: {', '.join(k for k, v in ROLES.items() if v)})")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise BadRow(where, f"{name}.{content_key}", "non_string_content",
                         f"must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": _utf8(content, where, f"{name}.{content_key}")})
        if role == "assistant" and turn.get("token_ids") is not None:  # as the target generated them
            ids = turn["token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise BadRow(where, f"{name}.token_ids", "bad_tokens", "must be a list of token ids")
            out[-1]["token_ids"] = ids
    return out


def _utf8(text: str, where: str, name: str) -> str:
    """``text`` when it is valid Unicode; :class:`BadRow` (``invalid_utf8``) for a lone surrogate (half an emoji,
    ``"\\ud83d"`` in JSON), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(where, name, "invalid_utf8", f"character {e.start} is a lone surrogate "
                                                  f"({text[e.start]!r}): not valid Unicode text") from None
    return text


def normalise(turns: list[dict], where: str) -> list[dict]:
    """Drop empty turns, merge consecutive turns of one role, check the order. A merged turn keeps the later
    turn's ``unfinished`` flag and no ``token_ids`` (they spelled its parts). Raises :class:`BadRow` for an empty
    conversation, a system turn after the first, no user turn, or an assistant turn before any user turn."""
    merged: list[dict] = []
    for t in turns:
        if not t["content"].strip():
            continue
        if merged and merged[-1]["role"] == t["role"]:
            merged[-1] = {"role": t["role"], "content": merged[-1]["content"] + "\n\n" + t["content"],
                          **({"unfinished": True} if t.get("unfinished") else {})}
        else:
            merged.append(dict(t))
    if not merged:
        raise BadRow(where, "messages", "empty_conversation", "no non-empty turn")
    if any(t["role"] == "system" for t in merged[1:]):
        raise BadRow(where, "messages", "system_not_first", "a system turn may only come first")
    if not any(t["role"] == "user" for t in merged):
        raise BadRow(where, "messages", "no_user_turn", "no user turn")
    first = merged[1] if merged[0]["role"] == "system" else merged[0]
    if first["role"] == "assistant":
        raise BadRow(where, "messages", "assistant_first", "the first turn (after any system prompt) is the "
                                                          "assistant's: it answers no user turn")
    return merged


def raw_rows(src: PromptSource, part: str, limit: int) -> Iterator[tuple[str, str, int, object]]:
    """``(where, source name, row, raw value or BadRow)`` of a source, at most ``limit`` rows (bad ones count):
    chitchat and HumanEval prompts (``part``: their train, val or eval split) as single prompts, JSONL line by
    line, a hub dataset through datasets. Raises ``ValueError`` for an unknown source or one without a path."""
    if src.source in ("chitchat", "humaneval"):
        for p in builtin_prompts(src.source, part, limit):
            yield f"{p.source} row {p.row}", p.source, p.row, {"prompt": p.text}
        return
    if src.source not in SOURCES:
        raise ValueError(f"unknown prompt source {src.source!r}; valid: {', '.join(SOURCES)}")
    if src.source == "self_made":
        raise ValueError("source self_made: the target writes these prompts, so a job that holds it makes them into a "
                         "file first (draftheads.data.pipeline.made_source); this reader has no target")
    if not src.path:
        raise ValueError(f"source {src.source!r} needs a path")
    if src.source == "jsonl":
        if not Path(src.path).is_file():
            raise FileNotFoundError(f"data.path={src.path}: no such file")
        rows = ((where, str(src.path), row, value) for where, row, value in read_jsonl(src.path))
    else:
        name, ds = hub_rows(src.path, src.subset, src.split, src.data_files)
        rows = ((f"{name} row {i}", name, i, row) for i, row in enumerate(ds))
    for n, item in enumerate(rows):
        if n == limit:
            return
        yield item


def load_chats(src: PromptSource, part: str, limit: int, fmt: str = "auto", strict: bool = False,
               report: DataReport | None = None) -> list[Chat]:
    """Up to ``limit`` rows of ``src`` as normalised conversations.

    Every row read is counted in ``report.rows_in``. Lenient (default): a bad row is skipped and counted in
    ``report`` by reason. ``strict``: the first bad row
    raises its :class:`BadRow` (file or dataset, row, field).
    """
    report = report if report is not None else DataReport()
    chats = []
    for where, source, row, raw in raw_rows(src, part, limit):
        report.rows_in += 1
        try:
            chats.append(to_chat(raw, where, source, row, fmt, src.field))
        except BadRow as e:
            if strict:
                raise
            report.skip(e.reason, str(e))
    return chats


def first_user_prompts(src: PromptSource, part: str, limit: int) -> list[Prompt]:
    """Up to ``limit`` prompts of ``src`` (an eval set): each conversation up to its first answer, i.e. its system
    turn if any and its first user turn, read strictly (the first bad row raises its :class:`BadRow`)."""
    return [_first_prompt(c) for c in load_chats(src, part, limit, strict=True)]


def _first_prompt(chat: Chat) -> Prompt:
    return Prompt(chat.source, chat.row, next(m["content"] for m in chat.messages if m["role"] == "user"),
                  chat.messages[0]["content"] if chat.messages[0]["role"] == "system" else None)


def prompt_pieces(src: PromptSource, part: str) -> Iterator[Prompt]:
    """Every prompt of ``src`` in order, read lazily and strictly, as the pieces :func:`long_prompts` joins:
    every message of chitchat's conversations (:func:`~data.sources.chitchat_messages`: a conversation's messages
    stay together, in order), any other source's prompts as :func:`first_user_prompts` reads them."""
    if src.source == "chitchat":
        yield from chitchat_messages(part)
        return
    for where, source, row, raw in raw_rows(src, part, None):
        yield _first_prompt(to_chat(raw, where, source, row, "auto", src.field))


def long_prompts(pieces: Iterable[Prompt], limit: int, min_tokens: int, count: Callable[[Prompt], int]) -> list[Prompt]:
    """Up to ``limit`` prompts of at least ``min_tokens`` tokens (``count``: the tokens of the prompt the target
    reads, chat template included), each joining consecutive ``pieces`` by a blank line (the first one's system
    turn and provenance kept); what is left when the pieces run out, shorter, is dropped.

    Each piece is counted once alone and the joined prompt only when those counts (less the template around
    each, plus the blank line's tokens) say it is long enough, so a source of short prompts costs linear, not
    quadratic, tokenization."""
    pieces = iter(pieces)
    piece, out = next(pieces, None), []
    if piece is not None:
        alone = lambda text: count(Prompt(piece.source, piece.row, text))  # noqa: E731
        overhead = alone("")  # the template around a user turn's text
        seam = alone("a\n\na") - 2 * alone("a") + overhead  # the blank line's tokens (1 or 2, by tokenizer)
    while piece is not None and len(out) < limit:
        joined = piece
        known = estimate = count(joined)
        piece = next(pieces, None)
        while known < min_tokens and piece is not None:
            joined = Prompt(joined.source, joined.row, f"{joined.text}\n\n{piece.text}", joined.system)
            estimate += count(Prompt(piece.source, piece.row, piece.text)) - overhead + seam
            piece = next(pieces, None)
            if estimate >= min_tokens or piece is None:
                known = estimate = count(joined)  # the joined prompt decides: pieces may merge at the seams
        if known >= min_tokens:
            out.append(joined)
    return out
