"""From a data config to training and validation rows: rows of any format -> conversations -> the target's own
answers, turn by turn (cached) -> token ids and assistant-token loss masks -> a data report."""

from __future__ import annotations

from pathlib import Path

from draftheads.data.batching import DataReport, rows_from_chats
from draftheads.data.conversations import load_chats
from draftheads.data.regenerate import OpenAIBackend, TransformersBackend, cache_key, regenerate, resolve_reasoning
from draftheads.data.templates import TemplateRejected, apply_system_policy, check_template, render


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
        out.append(type(c)(c.source, c.row, tuple(messages), unfinished=tuple(i - dropped for i in c.unfinished)))
    return out


def make_backend(data_cfg, target, tokenizer):
    """The regeneration backend: the target through transformers, or ``data.server`` when its url is set."""
    server = data_cfg.server
    if server.base_url:
        return OpenAIBackend(server.base_url, server.model, data_cfg.generation, server.api_key,
                             server.concurrency, server.max_retries, server.timeout_s,
                             resolve_reasoning(data_cfg.reasoning, tokenizer.chat_template))
    return TransformersBackend(target, tokenizer, data_cfg.generation)


def self_distilled_rows(data_cfg, target, tokenizer, model_id: dict, cache_dir: str | Path,
                        show_progress: bool = True, rank: int = 0, world_size: int = 1,
                        barrier=lambda: None) -> tuple[list[dict], list[dict], DataReport]:
    """Training rows and held-out validation rows, answered by the target itself (``data.regenerate``) or
    as the dataset has them, and the data report.

    Called on every rank (``barrier`` a collective wait), the ranks share the regeneration. Regenerated
    conversations are cached under ``<cache_dir>/regenerated/<key>.jsonl``, ``key`` hashing the
    target identity, its chat template, the conversations, the generation settings and the backend; a second run
    reads them back.
    Raises ``ValueError`` for no chat template, ``data.num_val_prompts`` < 1, or no trainable token left.
    """
    if data_cfg.num_val_prompts < 1:
        raise ValueError("data.num_val_prompts must be >= 1: the drafter is validated on held-out rows")
    report = DataReport()
    train, val = split_chats(data_cfg, tokenizer, report)
    chats = train + val
    if data_cfg.regenerate:
        messages = [c for c in chats if c.tokens is None]
        backend = make_backend(data_cfg, target, tokenizer)
        key = cache_key(model_id, messages, data_cfg.generation, backend.name, tokenizer.chat_template)
        answered = regenerate(backend, messages, data_cfg.generation.batch_size,
                              Path(cache_dir).expanduser() / "regenerated" / f"{key}.jsonl", show_progress,
                              rank, world_size, barrier)
        report.failed = sum(r.error is not None for r in answered)
        by_key = {(r.source, r.row): r for r in answered if r.error is None}
        chats = [c if c.tokens is not None else by_key.get((c.source, c.row)) for c in chats]
        chats = [c for c in chats if c is not None]
    rows = rows_from_chats(tokenizer, chats, data_cfg.max_length, report, data_cfg.train_on, data_cfg.overlong)
    held_out = {(c.source, c.row) for c in val}
    return ([r for r in rows if (r["source"], r["row"]) not in held_out],
            [r for r in rows if (r["source"], r["row"]) in held_out], report)
