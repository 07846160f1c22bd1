"""From a data config to training and validation rows: prompts -> target's own answers (cached) -> rows."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from data.batching import DataReport, rows_from_responses
from data.regenerate import cache_key, regenerate
from data.sources import load_prompts


def self_distilled_rows(data_cfg, target, tokenizer, model_id: dict, cache_dir: str | Path,
                        show_progress: bool = True) -> tuple[list[dict], list[dict], DataReport]:
    """Training rows and held-out validation rows answered by the target itself.

    The regenerated responses are cached under ``<cache_dir>/regenerated/<key>.jsonl``, ``key`` hashing the
    target identity, the prompts and the generation settings; a second run reads them back.
    Raises ``ValueError`` when a split ends up with no trainable token.
    """
    if data_cfg.num_val_prompts < 1:
        raise ValueError("data.num_val_prompts must be >= 1: held-out rows measure head accuracy and target drift")
    n_train, n_val = data_cfg.num_train_prompts, data_cfg.num_val_prompts
    if data_cfg.source == "chitchat":  # held out by conversation
        train_prompts = load_prompts(data_cfg, "train", n_train)
        val_prompts = load_prompts(data_cfg, "val", n_val)
    else:  # one list: the validation prompts come off its end
        prompts = load_prompts(data_cfg, "train", n_train + n_val)
        train_prompts, val_prompts = prompts[:-n_val], prompts[-n_val:]
    settings = data_cfg.generation
    prompts = train_prompts + val_prompts
    cache_file = Path(cache_dir).expanduser() / "regenerated" / f"{cache_key(model_id, prompts, settings)}.jsonl"
    responses = regenerate(target, tokenizer, prompts, settings, cache_file, show_progress)
    train_rows, report = rows_from_responses(responses[:len(train_prompts)], data_cfg.max_length)
    val_rows, _ = rows_from_responses(responses[len(train_prompts):], data_cfg.max_length)
    return train_rows, val_rows, report


def describe(report: DataReport) -> str:
    """One line for the terminal and the run's report."""
    d = asdict(report)
    frac = report.trainable_tokens / max(report.tokens, 1)
    return ", ".join(f"{k}={v}" for k, v in d.items()) + f", trainable_fraction={frac:.2f}"
