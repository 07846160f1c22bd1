"""A training job's rows: the self-distilled training and validation rows answered by the target, with their
target states (computed in the run or read from the state cache), and where that cache lies."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from draftheads.data.batching import DataReport, data_scalars, padding_fraction, rank_shard
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.pipeline import self_distilled_rows
from draftheads.data.state_cache import CacheSpec, cache_spec, read_cache
from draftheads.runs.job import Job
from draftheads.serving.vllm_env import ensure_vllm
from draftheads.training.config import RunConfig, TargetStates
from draftheads.training.runtime import print0


def job_rows(job: Job, layer_ids: tuple[int, ...] | None = None, attach: bool = True,
             unusable: Callable[[dict], str | None] | None = None,
             trains: bool = True) -> tuple[list[dict], list[dict], DataReport]:
    """Training and validation rows answered by the target (cached; the ranks share the regeneration), with
    ``attach`` each with its cached target states: ``hidden_states`` (last layer) or, with ``layer_ids``,
    ``target_features``. Every process attaches states to its own training share; the main process also to
    the validation rows. A row ``unusable`` names a reason for (the drafter cannot train on it) is skipped and
    counted in the data report; with ``trains`` (not for a state cache, which holds every row) so are the
    training rows beyond the processes' equal shares (:func:`rank_shard`), as left out.

    Raises ``ValueError`` before any target state is computed when no training or no validation row is left.
    """
    accelerator, conf = job.accelerator, job.conf
    # every rank reads the data and answers its share of what is not regenerated yet
    held_out = [p.text for prompts in job.eval_sets.values() for p in prompts]  # never trained on: flagged if so
    train_rows, val_rows, report = self_distilled_rows(conf.data, job.target, job.tokenizer, job.identity,
                                                       conf.cache_dir, accelerator.is_main_process,
                                                       accelerator.process_index, accelerator.num_processes,
                                                       accelerator.wait_for_everyone, held_out,
                                                       lambda: (ensure_vllm(conf.vllm.venv), job.target_path,
                                                                conf.vllm.engine()))
    if unusable is not None:
        train_rows, val_rows = _usable(train_rows, unusable, report), _usable(val_rows, unusable, report)
    if not train_rows or not val_rows:
        raise ValueError(f"no {'training' if not train_rows else 'validation'} row left after skipping bad ones "
                         f"({report.describe()}; first errors: {report.examples}): add rows "
                         f"(data.num_train_prompts, data.num_val_prompts) or fix the data")
    if trains:
        report.rows_left_out = len(train_rows) % accelerator.num_processes
        report.rows_out -= report.rows_left_out
    report.padding_fraction = padding_fraction(train_rows, conf.trainer.batch_size, conf.trainer.seed,
                                               packed=conf.trainer.tokens_per_batch is not None)
    print0(accelerator, f"data: {report.describe()}")
    if report.near_eval.get("count"):
        print0(accelerator, f"WARNING: {report.near_eval['count']} training prompts near-duplicate eval prompts "
                            f"(the eval sets then measure rows trained on): {report.near_eval['examples']}")
    for reason, example in report.examples.items():
        print0(accelerator, f"  first {reason}: {example}")
    accelerator.log({f"data/{k}": v for k, v in data_scalars(report).items()}, step=0)
    if not attach:
        return train_rows, val_rows, report
    pad, bs = job.tokenizer.pad_token_id, conf.data.target_batch_size
    if conf.data.target_states == TargetStates.disk:
        rows = train_rows + val_rows
        spec = state_cache_spec(job, rows, layer_ids)
        per_rank = len(rank_shard(train_rows, accelerator.process_index, accelerator.num_processes))
        mine = range(accelerator.process_index * per_rank, (accelerator.process_index + 1) * per_rank)
        held_out = range(len(train_rows), len(rows)) if accelerator.is_main_process else range(0)
        read_cache(state_cache_dir(conf), spec, rows, [*mine, *held_out], job.target.dtype)
        print0(accelerator, f"target states: read from {state_cache_dir(conf)}")
        return train_rows, val_rows, report
    attach_hidden_states(job.target, rank_shard(train_rows, accelerator.process_index, accelerator.num_processes),
                         bs, pad, accelerator.is_main_process, layer_ids=layer_ids)
    if accelerator.is_main_process:
        attach_hidden_states(job.target, val_rows, bs, pad, False, layer_ids=layer_ids)
    return train_rows, val_rows, report


def _usable(rows: list[dict], unusable: Callable[[dict], str | None], report: DataReport) -> list[dict]:
    """``rows`` without those ``unusable`` gives a reason for, each counted as ``unusable_row``."""
    kept = []
    for row in rows:
        why = unusable(row)
        if why is None:
            kept.append(row)
        else:
            report.skip("unusable_row", f"{row['source']} row {row['row']}: {why}")
            report.rows_out -= 1
    return kept


def state_cache_dir(conf: RunConfig) -> Path:
    """``data.target_states_dir``, by default ``<output_dir>/hidden_states``."""
    return Path(conf.data.target_states_dir or Path(conf.output_dir) / "hidden_states")


def state_cache_spec(job: Job, rows: list[dict], layer_ids) -> CacheSpec:
    """What the state cache of ``rows`` must have been made for (this target, layers, tokenizer, data)."""
    return cache_spec(job.target, job.identity, job.tokenizer, rows, layer_ids, job.conf.data.max_length,
                      job.conf.data.target_states_dtype)
