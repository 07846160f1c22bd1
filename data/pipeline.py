"""From a data config to training and validation rows: rows of any format -> conversations -> the target's own
answers, turn by turn (cached) -> token ids and assistant-token loss masks -> a data report."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Callable

from draftheads.data.batching import DataReport, rows_from_chats
from draftheads.data.conversations import load_chats
from draftheads.data.generation import Engine
from draftheads.data.regenerate import (
    OpenAIBackend,
    TransformersBackend,
    VLLMBackend,
    cache_key,
    regenerate,
    resolve_reasoning,
    settings_key,
)
from draftheads.data import follow_ups
from draftheads.data.self_made import NearDuplicates, Sampler, cache_file, distinct_bigrams, self_made_prompts
from draftheads.data.sources import row_location
from draftheads.data.templates import (
    TemplateRejected,
    apply_system_policy,
    check_template,
    check_thinking_switch,
    render,
    stop_token_ids,
)
from draftheads.models.target import context_window


def read_chats(data_cfg, tokenizer, report: DataReport, part: str, limit: int, src=None) -> list:
    """Up to ``limit`` rows of ``src`` (default: ``data_cfg``'s own source) as conversations ready for the chat
    template: read leniently (or strictly, ``data.strict``), system prompts handled by ``data.system``, and
    checked against the template as they will be rendered; rejected rows are counted in ``report``."""
    check_template(tokenizer)
    chats = load_chats(src or data_cfg, part, limit, data_cfg.format, data_cfg.strict, report)
    return _fit_template(chats, tokenizer, data_cfg, report)


def _shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders), summing to ``total``."""
    exact = [total * w / sum(weights) for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])[:total - sum(shares)]:
        shares[i] += 1
    return shares


def split_chats(data_cfg, tokenizer, report: DataReport) -> tuple[list, list]:
    """Training and validation conversations of the source, or of every ``data.mixture`` component in
    proportion to its weight: chitchat's train and val splits (disjoint by conversation), or the last rows of
    any other source for validation."""
    sources = data_cfg.mixture or [data_cfg]
    weights = [getattr(s, "weight", 1.0) for s in sources]
    if any(w <= 0 for w in weights):
        raise ValueError(f"data.mixture weights must be > 0, got {weights}")
    train, val = [], []
    for src, n_train, n_val in zip(sources, _shares(data_cfg.num_train_prompts, weights),
                                   _shares(data_cfg.num_val_prompts, weights)):
        if src.source == "chitchat":
            train += read_chats(data_cfg, tokenizer, report, "train", n_train, src)
            val += read_chats(data_cfg, tokenizer, report, "val", n_val, src)
            continue
        both = read_chats(data_cfg, tokenizer, report, "train", n_train + n_val, src)
        if n_val and len(both) <= n_val:
            raise ValueError(f"data: {len(both)} usable rows in {src.path}, not more than its {n_val} validation "
                             f"rows: nothing left to train on ({report.describe()}; first errors: {report.examples})")
        train, val = train + both[:len(both) - n_val], val + both[len(both) - n_val:]
    return train, val


def _fit_template(chats: list, tokenizer, data_cfg, report: DataReport) -> list:
    out = []
    for c in chats:
        if c.tokens is not None:
            out.append(c)
            continue
        messages = apply_system_policy(tokenizer, list(c.messages), data_cfg.system)
        if not data_cfg.regenerate and not any(m["role"] == "assistant" for m in messages):
            report.skip("no_assistant_turn", f"{c.where}: no assistant turn to train on (data.regenerate=false)")
            continue
        try:  # what will be rendered: the conversation, or its user turns each followed by an answer
            render(tokenizer, messages if not data_cfg.regenerate else
                   [t for m in messages if m["role"] != "assistant"
                    for t in ([m] if m["role"] == "system" else [m, {"role": "assistant", "content": "..."}])])
        except TemplateRejected as e:
            if data_cfg.strict:
                raise ValueError(f"{c.where}: {e}") from None
            report.skip("template_rejected", f"{c.where}: {e}")
            continue
        dropped = len(c.messages) - len(messages)  # a system turn folded or dropped moves every answer up
        out.append(replace(c, messages=tuple(messages), unfinished=tuple(i - dropped for i in c.unfinished)))
    return out


def with_thinking(chats: list, fraction: float | None, seed: int, tokenizer=None) -> list:
    """``chats`` each with its thinking mode (``Chat.thinking``) for ``data.thinking_fraction``: of the n
    conversations (pre-tokenised rows aside: used as given, they keep None), exactly ``round(fraction * n)``
    thinking (True) and the others not (False); the thinking ones are those whose sha256 of ``(seed, source,
    row)`` ranks lowest, so the split depends on the seed and the rows' provenance only, not on their order (the
    same on every rank and every run). ``fraction`` None leaves every mode as it is (None: the template's
    default rendering).

    Raises ``ValueError`` for a fraction outside [0, 1], or, given ``tokenizer``, for a chat template with no
    thinking switch (:func:`~draftheads.data.templates.check_thinking_switch`)."""
    if fraction is None:
        return chats
    if not 0 <= fraction <= 1:
        raise ValueError(f"data.thinking_fraction={fraction} must be in [0, 1] (or null: the template's default)")
    if tokenizer is not None:
        check_thinking_switch(tokenizer, "data.thinking_fraction")
    rendered = [i for i, c in enumerate(chats) if c.tokens is None]
    rank = sorted(rendered, key=lambda i: hashlib.sha256(f"{seed}|{chats[i].source}|{chats[i].row}".encode()).digest())
    thinking = set(rank[:round(fraction * len(rendered))])
    return [replace(c, thinking=i in thinking) if c.tokens is None else c for i, c in enumerate(chats)]


def make_backend(data_cfg, target, tokenizer, vllm: Callable[[], tuple[Path, str, dict]] | None = None):
    """The regeneration backend: ``data.server`` when its url is set, else the target in process through
    transformers, or through vLLM's offline engine with ``data.generation.engine=vllm`` (``vllm()`` gives its
    environment's python, the folder vLLM loads the target from and the engine's parallel arguments; a tool that
    makes no vLLM environment passes none, and is refused)."""
    server = data_cfg.server
    if server.base_url:
        return OpenAIBackend(server.base_url, server.model, data_cfg.generation, server.api_key,
                             server.concurrency, server.max_retries, server.timeout_s,
                             resolve_reasoning(data_cfg.reasoning, tokenizer.chat_template))
    if data_cfg.generation.engine == Engine.vllm:
        if vllm is None:
            raise ValueError("data.generation.engine=vllm: this tool runs no vLLM environment; use a training job or "
                             "train/regenerate.py")
        python, path, parallel = vllm()
        engine = {"dtype": str(target.dtype).removeprefix("torch."), "enforce_eager": True,
                  "generation_config": "vllm", "max_model_len": context_window(target) or 4096, **parallel}
        return VLLMBackend(python, path, tokenizer, data_cfg.generation,
                           stop_token_ids(tokenizer, target.generation_config), engine)
    return TransformersBackend(target, tokenizer, data_cfg.generation)


def check_failed(answered: list, ceiling: float) -> None:
    """``RuntimeError`` when more than ``ceiling`` (``data.max_failed_fraction``) of the conversations the
    regeneration answered failed: naming the share, the first failed rows with their errors, and what to do. Below
    it the failed rows are left out and counted (``failed`` in the data report; a rerun retries them)."""
    failed = [r for r in answered if r.error is not None]
    if answered and len(failed) > ceiling * len(answered):
        shown = "; ".join(f"{row_location(r.source, r.row)}: {r.error}" for r in failed[:5])
        raise RuntimeError(f"regeneration failed on {len(failed)} of {len(answered)} conversations "
                           f"({len(failed) / len(answered):.1%} > data.max_failed_fraction={ceiling:g}): {shown}"
                           f"{' ...' if len(failed) > 5 else ''}. The answered ones are cached: fix the cause (the "
                           f"server, its limits, data.generation) and rerun, which retries only the failed; or "
                           f"raise data.max_failed_fraction to train without them")


def near_eval(chats: list, held_out: list[str], threshold: float = 0.7, shown: int = 5) -> dict:
    """The training conversations whose user turns near-duplicate an eval prompt (MinHash LSH over word 3-grams at
    Jaccard ``threshold``, :class:`~draftheads.data.self_made.NearDuplicates`): ``count`` and the first ``shown``
    ``examples`` (where, and the start of its text). Published benchmarks' prompts must never be trained on."""
    index = NearDuplicates(threshold)
    for text in held_out:
        index.add(text)
    found = [(c, m["content"]) for c in chats if c.tokens is None
             for m in [next((m for m in c.messages if m["role"] == "user" and index.seen(m["content"])), None)] if m]
    return {"count": len(found), "examples": [f"{c.where}: {text[:80]!r}" for c, text in found[:shown]]}


class Answers:
    """The job's regeneration (:func:`~draftheads.data.regenerate.regenerate` with its backend, generation settings
    and cache) as a callable on conversations: the training rows', and the self-made follow-ups' first answers.
    ``key`` is its settings key (:func:`~draftheads.data.regenerate.settings_key`): caches with it lend answers;
    ``system`` its system-prompt policy (``data.system``), which conversations it did not read are given first."""

    def __init__(self, backend, data_cfg, model_id: dict, tokenizer, cache_dir: str | Path, show_progress: bool):
        self.backend, self.generation, self.model_id, self.tokenizer = backend, data_cfg.generation, model_id, tokenizer
        self.system = data_cfg.system
        self.cache_dir, self.show_progress = Path(cache_dir).expanduser(), show_progress
        self.key = settings_key(model_id, self.generation, backend.name, tokenizer.chat_template)

    def __call__(self, chats: list, rank: int = 0, world_size: int = 1, barrier=lambda: None) -> list:
        """The answered ``chats`` (a ``Regenerated`` each, in order), cached under a key of these chats."""
        key = cache_key(self.model_id, chats, self.generation, self.backend.name, self.tokenizer.chat_template)
        return regenerate(self.backend, chats, self.generation.batch_size,
                          self.cache_dir / "regenerated" / f"{key}.jsonl", self.show_progress, rank, world_size,
                          barrier, self.key)


def made_source(src, count: int, target, tokenizer, model_id: dict, cache_dir: str | Path,
                report: DataReport | None = None, show_progress: bool = True, engine: Sampler | None = None,
                answers: Answers | None = None):
    """``src`` itself, or for a ``self_made`` source a JSONL source over the first ``count`` prompts the target
    wrote (:func:`~draftheads.data.self_made.self_made_prompts`, cached; sampled by ``engine`` where one is given),
    some of them made two-turn by the target's follow-ups with ``self_made.follow_ups`` (:mod:`~draftheads.data.
    follow_ups`, first answers by ``answers``), written to ``<cache>/self_made/<key>-<count>.jsonl`` (with
    follow-ups ``<key>-<count>.follow_ups-<their key>.jsonl``): every reader
    downstream (rows, eval prompts, row numbering) reads it as any file. What the filters dropped and the
    prompts' diversity go into ``report.self_made``. Raises ``ValueError`` for follow-ups without ``answers`` (an
    eval set, or a job that does not regenerate)."""
    if src.source != "self_made":
        return src
    settings = src.self_made
    if settings.follow_ups and answers is None:
        raise ValueError(f"self_made.follow_ups={settings.follow_ups}: follow-ups are written after the target's "
                         "answers, so they are for training data that is regenerated (data.regenerate=true), not "
                         "for eval sets")
    counts = Counter()
    rows = self_made_prompts(settings, count, target, tokenizer, model_id, cache_dir, counts, show_progress, engine)
    prompts_cache = cache_file(settings, model_id, tokenizer.chat_template, cache_dir, engine and engine.name)
    path = prompts_cache.with_name(f"{prompts_cache.stem}-{count}.jsonl")
    follow = Counter()
    if settings.follow_ups:
        followed = follow_ups.cache_path(prompts_cache, settings, answers.key, engine and engine.name)
        path = path.with_name(f"{path.stem}.{followed.stem.split('.')[-1]}.jsonl")
        rows = follow_ups.with_follow_ups(rows, str(path), settings, answers, target, tokenizer, prompts_cache,
                                          follow, show_progress, engine)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if not path.exists() or path.read_text() != text:  # the filters are no part of the name: another's file
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    if len(rows) < count:
        print(f"WARNING: self-made prompts: {len(rows)} of the {count} asked survived the filters in "
              f"{counts['made']} sampled ({dict(counts)}): raise self_made.max_batches, or loosen the filters",
              file=sys.stderr, flush=True)
    if report is not None:
        made, kept = counts.pop("made", 0), counts.pop("kept", 0)
        report.self_made[str(path)] = {
            "made": made, "kept": kept, "used": len(rows), "dropped": dict(counts),
            "distinct_bigrams": distinct_bigrams([r["prompt"] if "prompt" in r else r["messages"][-3]["content"]
                                                  for r in rows]),
            **({"follow_ups": {**follow, "distinct_bigrams": distinct_bigrams(
                [r["messages"][-1]["content"] for r in rows if "messages" in r])}} if settings.follow_ups else {})}
    return replace(src, source="jsonl", path=str(path))


def made_sources(data_cfg, target, tokenizer, model_id: dict, cache_dir: str | Path, report: DataReport,
                 show_progress: bool = True, engine: Sampler | None = None, answers: Answers | None = None):
    """``data_cfg`` with each ``self_made`` source (itself, or a ``data.mixture`` component) made into a file
    (:func:`made_source`, ``engine`` sampling where given, ``answers`` answering the follow-ups' first turns),
    asked for the rows its share of training and validation reads."""
    if data_cfg.mixture:
        weights = [m.weight for m in data_cfg.mixture]
        counts = [a + b for a, b in zip(_shares(data_cfg.num_train_prompts, weights),
                                        _shares(data_cfg.num_val_prompts, weights))]
        return replace(data_cfg, mixture=[made_source(m, n, target, tokenizer, model_id, cache_dir, report,
                                                      show_progress, engine, answers)
                                          for m, n in zip(data_cfg.mixture, counts)])
    return made_source(data_cfg, data_cfg.num_train_prompts + data_cfg.num_val_prompts, target, tokenizer, model_id,
                       cache_dir, report, show_progress, engine, answers)


def self_distilled_rows(data_cfg, target, tokenizer, model_id: dict, cache_dir: str | Path,
                        show_progress: bool = True, rank: int = 0, world_size: int = 1,
                        barrier=lambda: None, held_out: list[str] = (),
                        vllm: Callable | None = None) -> tuple[list[dict], list[dict], DataReport]:
    """Training rows and held-out validation rows, answered by the target itself (``data.regenerate``) or
    as the dataset has them, and the data report.

    Called on every rank (``barrier`` a collective wait), the ranks share the regeneration. Regenerated
    conversations are cached under ``<cache_dir>/regenerated/<key>.jsonl``, ``key`` hashing the
    target identity, its chat template, the conversations (with their thinking modes), the generation settings
    and the backend; a second run reads them back, and a run over other conversations with the same target and
    settings takes the answers earlier caches hold (``settings_key``: a larger data set answers only its new
    rows). With ``data.thinking_fraction`` the training and the validation conversations each get that share in
    thinking mode (:func:`with_thinking`, seeded by ``data.generation.seed``), rendered, answered and trained in
    it; the rows carry ``thinking`` and the report counts them. ``held_out``: the eval prompts' texts, which the
    training prompts are checked against (:func:`near_eval`, in the report's ``near_eval``); ``vllm``: what
    :func:`make_backend` needs for ``data.generation.engine=vllm``, whose engine then samples the training's
    self-made prompts too (the eval sets' are always the target's in process: every job measures the same ones).
    Raises ``ValueError`` for no chat template, ``data.num_val_prompts`` < 1, a thinking fraction outside [0, 1]
    or one for a template with no thinking switch, or no trainable token left; ``RuntimeError`` for more failed
    answers than ``data.max_failed_fraction`` allows (:func:`check_failed`).
    """
    if data_cfg.num_val_prompts < 1:
        raise ValueError("data.num_val_prompts must be >= 1: the drafter is validated on held-out rows")
    followed = [s for s in (data_cfg.mixture or [data_cfg]) if s.source == "self_made" and s.self_made.follow_ups]
    if followed and (not data_cfg.regenerate or data_cfg.thinking_fraction is not None):
        raise ValueError(f"self_made.follow_ups={followed[0].self_made.follow_ups} is written after the target's own "
                         f"answers in the template's default mode: it needs data.regenerate=true (is "
                         f"{data_cfg.regenerate}) and no data.thinking_fraction (is {data_cfg.thinking_fraction})")
    if data_cfg.thinking_fraction is not None:  # before any row is read
        check_thinking_switch(tokenizer, "data.thinking_fraction")
    report = DataReport()
    backend = make_backend(data_cfg, target, tokenizer, vllm) if data_cfg.regenerate else None  # started on use
    engine = backend if isinstance(backend, VLLMBackend) else None  # vLLM's samples the self-made prompts too
    answers = Answers(backend, data_cfg, model_id, tokenizer, cache_dir, show_progress) if backend else None
    if rank == 0:  # the target writes self-made prompts once; the other ranks read them from the cache
        data_cfg = made_sources(data_cfg, target, tokenizer, model_id, cache_dir, report, show_progress, engine,
                                answers)
    barrier()
    if rank != 0:
        data_cfg = made_sources(data_cfg, target, tokenizer, model_id, cache_dir, DataReport(), False, engine,
                                answers)
    train, val = split_chats(data_cfg, tokenizer, report)
    if held_out:
        report.near_eval = near_eval(train, held_out)
    seed = data_cfg.generation.seed
    train, val = (with_thinking(train, data_cfg.thinking_fraction, seed),
                  with_thinking(val, data_cfg.thinking_fraction, seed))
    chats = train + val
    if data_cfg.regenerate:
        answered = answers([c for c in chats if c.tokens is None], rank, world_size, barrier)
        report.failed = sum(r.error is not None for r in answered)
        check_failed(answered, data_cfg.max_failed_fraction)
        by_key = {(r.source, r.row): r for r in answered if r.error is None}
        chats = [c if c.tokens is not None else by_key.get((c.source, c.row)) for c in chats]
        chats = [c for c in chats if c is not None]
    rows = rows_from_chats(tokenizer, chats, data_cfg.max_length, report, data_cfg.train_on, data_cfg.overlong)
    held_out = {(c.source, c.row) for c in val}
    return ([r for r in rows if (r["source"], r["row"]) not in held_out],
            [r for r in rows if (r["source"], r["row"]) in held_out], report)
