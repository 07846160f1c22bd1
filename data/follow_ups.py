"""Self-made conversations that go on (``self_made.follow_ups``): the target answers some of its own prompts, then
writes the user's next turn after its answer, steered by :data:`FOLLOW_UP` (Magpie's multi-turn extension, Xu et
al. 2024, arXiv 2406.08464, section 2.1, applied to the target being drafted for). Regeneration keeps the first
answer (``answered``: 1) and answers the follow-up, so the drafter also trains on second turns, whose context holds
a whole exchange (MT-Bench's second turns, a chat's later ones).

- **Which prompts go on**: prompt ``i`` when a hash of the seed and ``i`` falls below the share, so a larger request
  keeps a smaller one's choice (and its answers and follow-ups, from the caches).
- **First answers** come from the job's regeneration (its backend, settings and cache). One cut by the token
  budget is kept as cut (``unfinished`` in the row, so it trains without an end-of-turn token, as any cut answer
  does) and counted (``answer_unfinished``): at the default budgets most answers of a small target are. An empty
  one gets no follow-up (``answer_empty``); one the target failed on (a server's error) stops the job, and a rerun
  retries it.
- **Follow-ups** are sampled with the prompts' settings (temperature, top-p, token budget) in batches of
  ``batch_size`` chosen prompts, batch ``b`` from its own seed, cached per batch in
  ``<prompts' cache>.follow_ups-<key>.jsonl`` (the key hashes the share, the engine and how the answers were made)
  under what each follow-up was written after (its row and a hash of the conversation so far): a batch is reused
  only for the same prompts and first answers, so a larger request keeps a smaller one's whole batches and samples
  its own last one, and answers made again differently get new follow-ups. Then they are filtered and
  deduplicated among themselves as the prompts are (:data:`~draftheads.data.self_made.REASONS`); a prompt whose
  follow-up is dropped stays a one-turn row.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Callable

from draftheads.data.conversations import Chat
from draftheads.data.templates import apply_system_policy
from draftheads.data.self_made import Keeper, Sampler, SelfMade, pre_query, sample_user_turns, template_tokens

FOLLOW_UP = ("You are a helpful assistant. After your answer the user writes again: a follow-up question about it, "
             "a request to change, shorten or extend it, or a related new request.")
"""The steering system prompt the follow-ups are written after (it is not part of the rows)."""


def _system(row: dict) -> list[dict]:
    return [{"role": "system", "content": row["system"]}] if "system" in row else []


def _after(row: dict, answered) -> str:
    """What a follow-up is written after, as a key: the row and a hash of its conversation so far."""
    turns = [{"role": m["role"], "content": m["content"]} for m in answered.messages]
    return f'{row["row"]}:{hashlib.sha256(json.dumps(turns).encode()).hexdigest()[:16]}'


def _read(path: Path) -> tuple[list[list[dict]], int]:
    """The cached batches up to any line cut by a kill, and the number of lines."""
    lines, batches = path.read_text().splitlines() if path.exists() else [], []
    for line in lines:
        try:
            batches.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return batches, len(lines)


def goes_on(settings: SelfMade, row: int) -> bool:
    """Whether prompt ``row`` of ``settings``' prompts gets a follow-up: a 32-bit hash of the seed and the row
    below ``follow_ups`` x 2^32 (the same choice for any count of prompts)."""
    h = int(hashlib.sha256(f"{settings.seed}|follow_up|{row}".encode()).hexdigest()[:8], 16)
    return h < settings.follow_ups * 2 ** 32


def follow_up_seed(settings: SelfMade, index: int) -> int:
    """The seed of follow-up batch ``index`` (32 bits; other than any prompt batch's)."""
    return int(hashlib.sha256(f"{settings.seed}|follow_up_batch|{index}".encode()).hexdigest()[:8], 16)


def cache_path(prompts_cache: Path, settings: SelfMade, answers_key: str, engine: str | None) -> Path:
    """Where the follow-ups to the prompts cached in ``prompts_cache`` live: keyed by the share, how the first
    answers were made (``answers_key``: :func:`~draftheads.data.regenerate.settings_key`) and the sampling
    engine's name (None: the target in process)."""
    key = hashlib.sha256(json.dumps([settings.follow_ups, answers_key, engine]).encode()).hexdigest()[:16]
    return prompts_cache.with_name(f"{prompts_cache.stem}.follow_ups-{key}.jsonl")


def with_follow_ups(rows: list[dict], source: str, settings: SelfMade, answer: Callable[[list[Chat]], list],
                    model, tokenizer, prompts_cache: Path, counts: Counter, show_progress: bool = True,
                    engine: Sampler | None = None) -> list[dict]:
    """``rows`` (:func:`~draftheads.data.self_made.self_made_prompts`' ``{"prompt", "topic", "row"}``, in order)
    with the chosen ones (:func:`goes_on`) made two-turn where the target wrote a follow-up that passed the
    filters: ``{"messages": [user, the target's answer with its token_ids, the follow-up], "answered": 1, "topic",
    "row"}`` (and ``"unfinished"`` holding the answer's index where it was cut by the token budget).

    ``answer(chats)`` answers one-turn conversations ``Chat(source, row, ...)`` as the job's regeneration does
    (cached, resumable), returning results with ``messages``, ``unfinished`` and ``error``; its ``key`` says how
    (:func:`~draftheads.data.regenerate.settings_key`) and keys the follow-ups' cache; its ``system`` policy
    (``data.system``) places a kept steering prompt (``keep_system``) as the job's rows have it. ``counts`` gets
    ``asked`` (prompts chosen), ``answer_unfinished`` (kept as cut), ``answer_empty`` (no follow-up), ``made``
    (follow-ups sampled), ``kept`` (two-turn rows) and the follow-ups dropped by filter. Raises ``RuntimeError``
    where a first answer failed (the cached answers kept)."""
    chosen = [r for r in rows if goes_on(settings, r["row"])]
    counts["asked"] += len(chosen)
    if not chosen:
        return rows
    answered = answer([Chat(source, r["row"], tuple(apply_system_policy(
        tokenizer, _system(r) + [{"role": "user", "content": r["prompt"]}], answer.system))) for r in chosen])
    failed = [(r, a.error) for r, a in zip(chosen, answered) if a.error is not None]
    if failed:  # every rank then reads the same finished cache, and the rows are the same on every run
        raise RuntimeError(f"self-made follow-ups: the target failed to answer {len(failed)} of the {len(chosen)} "
                           f"prompts that go on (first: prompt {failed[0][0]['row']}: {failed[0][1]}); the answered "
                           "ones are cached: rerun to retry the failed ones")
    ready = []
    for r, a in zip(chosen, answered):
        counts["answer_unfinished"] += bool(a.unfinished)
        if a.messages[-1]["content"].strip():
            ready.append((r, a))
        else:
            counts["answer_empty"] += 1
    path = cache_path(prompts_cache, settings, answer.key, engine and engine.name)
    size = settings.batch_size
    wanted = [[_after(r, a) for r, a in ready[i:i + size]] for i in range(0, len(ready), size)]
    cached, lines = _read(path)
    if lines > len(cached):  # a line cut by a kill: the next batch appends after the whole ones
        path.write_text("".join(json.dumps(b) + "\n" for b in cached))
    by_after = {tuple(c["after"] for c in b): b for b in cached}
    batches = []
    for index, after in enumerate(wanted):
        batch = by_after.get(tuple(after))
        if batch is None:  # not made before for these prompts and first answers
            part = ready[index * size:(index + 1) * size]
            prefixes = [pre_query(tokenizer, FOLLOW_UP, [m for m in a.messages if m["role"] != "system"])
                        for _, a in part]
            made = sample_user_turns(model, tokenizer, settings, prefixes, follow_up_seed(settings, index), engine)
            batch = [{**m, "row": r["row"], "after": key} for (r, _), m, key in zip(part, made, after)]
            with open(path, "a") as f:  # a whole batch per line: a killed run resumes after its last one
                f.write(json.dumps(batch) + "\n")
            if show_progress:
                print(f"self-made follow-ups: batch {index + 1} of {len(wanted)} made", flush=True)
        batches.append(batch)
    keeper = Keeper(settings, template_tokens(tokenizer))
    for c in (c for b in batches for c in b):
        keeper.offer(c)
    counts["made"] += sum(map(len, batches))
    counts["kept"] += len(keeper.kept)
    counts.update(keeper.drops)
    follow = {c["row"]: c["text"] for c in keeper.kept}
    first = {r["row"]: a for r, a in ready}
    return [{"messages": [*first[r["row"]].messages, {"role": "user", "content": follow[r["row"]]}], "answered": 1,
             **({"unfinished": first[r["row"]].unfinished} if first[r["row"]].unfinished else {}),
             "topic": r["topic"], "row": r["row"]} if r["row"] in follow else r for r in rows]
