"""What every training job does around its drafter's own stages: open the run (accelerator, target, eval sets,
the recipe's early checks, resume point), build the self-distilled rows and their target states, close the run."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from draftheads.data.batching import DataReport, data_scalars, padding_fraction, rank_shard
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.pipeline import self_distilled_rows
from draftheads.data.state_cache import CacheSpec, cache_spec, read_cache
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.methods import load_eval_sets
from draftheads.models.decoding import GenerationDefaults, generation_defaults
from draftheads.models.partial import place
from draftheads.models.target import load_target, model_identity, weights_sample
from draftheads.training.checkpoint import latest_checkpoint
from draftheads.training.config import RunConfig, TargetStates, apply_generation_defaults, to_schema
from draftheads.training.recipe import Recipe
from draftheads.training.runtime import make_accelerator, print0, start_tracker


@dataclass
class Job:
    """An open run on this process."""
    conf: RunConfig
    accelerator: Accelerator
    out: Path
    eval_sets: dict[str, list]
    target: object
    tokenizer: object
    target_path: str
    identity: dict
    resume: tuple[Path, dict] | None
    """The checkpoint to continue from (``resume=true``) and its meta."""


TARGET_FILE = "target.json"
"""What a run trained against (:func:`target_record`), written beside ``config.yaml`` when the run opens; peer
runs are checked against it."""


def target_record(target, identity: dict) -> dict:
    """The target's identity (:func:`~draftheads.models.target.model_identity`) and a sample of its weights,
    which tells apart targets of one architecture and size."""
    return {**identity, "weights_sample_sha256": weights_sample(target)}


def open_job(cfg: DictConfig, recipe: Recipe | None = None) -> Job:
    """Typed config, accelerator and tracker, the target on this process's device, eval sets (read with its
    tokenizer, which long sets count with: a bad file fails now, not after training), ``recipe.check`` (settings
    that would fail later), the resume point, and ``config.yaml`` and ``target.json`` in the run directory.
    ``recipe`` None opens a job that trains nothing (a state cache build).

    Raises ``ValueError`` for an undeclared config key, a config of another drafter than ``recipe``, what
    ``recipe.check`` refuses, and, with ``resume=true``, for a checkpoint of another target or of a stage not
    in ``recipe.stages``; ``FileExistsError`` for an output_dir holding a training run (:func:`claim_output_dir`)
    — before any work.
    """
    conf = to_schema(cfg)
    if recipe is not None and conf.drafter != recipe.name:
        raise ValueError(f"drafter={conf.drafter!r}: this job trains {recipe.name!r} (use train/{conf.drafter}.py)")
    if conf.model.partial and recipe is not None:
        check_partial(conf)
    out = Path(conf.output_dir)
    claim_job_dir(conf, recipe, delete=False)  # refused before any process starts
    accelerator = make_accelerator(cfg)
    if accelerator.is_main_process:
        check_writable(out)
        claim_job_dir(conf, recipe, delete=True)
    accelerator.wait_for_everyone()
    start_tracker(accelerator, cfg, run_name=out.name)  # in the claimed folder: an old run's tracker files are gone
    with accelerator.main_process_first():  # rank 0 converts/downloads; the others then read its cache
        target, tokenizer, target_path = load_target(conf.model, conf.cache_dir)
    eval_sets = load_eval_sets(conf.eval, tokenizer)  # long sets count the target's tokens
    place(target, accelerator.device)
    set_seed(conf.trainer.seed)  # building or converting an uncached target drew from the global RNG
    identity = model_identity(target, conf.model)
    print0(accelerator, f"target: {target_path} ({identity['num_hidden_layers']} layers, "
                        f"hidden {identity['hidden_size']}, vocab {identity['vocab_size']})")
    apply_generation_defaults(conf, target.generation_config)
    print0(accelerator, decoding_line(conf, target, tokenizer))
    if recipe is not None:
        recipe.check(conf, target)
    resume = latest_checkpoint(out, identity, recipe.stages) if recipe is not None and conf.resume else None
    if accelerator.is_main_process:
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)
        (out / TARGET_FILE).write_text(json.dumps(target_record(target, identity), indent=1))
    return Job(conf, accelerator, out, eval_sets, target, tokenizer, target_path, identity, resume)


def check_partial(conf: RunConfig) -> None:
    """``model.partial=true`` trains from cached states only: ``ValueError`` saying what to change when the run
    would run the target's decoder layers (states computed in the run or per batch, the evaluator), before any
    work. Answers still to regenerate are refused where regeneration starts; a recipe refuses its own stages in
    ``check`` (Medusa's stage 2)."""
    if conf.data.target_states != TargetStates.disk:
        raise ValueError(f"model.partial=true holds no decoder layer to compute states with (data.target_states="
                         f"{conf.data.target_states}): use data.target_states=disk with a cache made by "
                         f"train/cache_hidden_states.py (whole target)")
    if conf.eval.enabled:
        raise ValueError("model.partial=true: the evaluator decodes with the whole target; set eval.enabled=false and "
                         "evaluate afterwards with train/evaluate.py RUN where the target fits")


def decoding_line(conf, target, tokenizer) -> str:
    """What every path decodes with: the stop set, and the target's ``generation_config`` defaults ignored or
    applied (:func:`~draftheads.training.config.apply_generation_defaults`)."""
    stop, defaults = stop_token_ids(tokenizer, target.generation_config), generation_defaults(target.generation_config)
    line = f"decoding: stops at {tokenizer.convert_ids_to_tokens(sorted(stop))}"
    if conf.model.generation_defaults == GenerationDefaults.apply:
        g = conf.data.generation
        return line + (f"; the target's generation_config defaults {defaults} are applied: temperature "
                       f"{g.temperature:g}, top_k {g.top_k}, top_p {g.top_p:g} in regeneration and every evaluated "
                       f"method")
    return line + (f"; the target's generation_config defaults {defaults} are ignored (model.generation_defaults="
                   f"apply applies them): every path decodes with the configured settings" if defaults else "")


RUN_ENTRIES = ("config.yaml", TARGET_FILE, "report.json", "report.json.tmp", "checkpoints", "export",
               "acceptance.png", "vllm_parity.json", "hidden_states", "logs", "wandb", "wandb_run_id")
"""What a run, its state cache build, its tracker and the jobs reading it back write in its output_dir (with
what its drafter saves beside ``export/``: ``Recipe.saved_entries``): an overwriting run deletes these and
nothing else."""

PROBE = ".write-probe-"
"""Name prefix of :func:`check_writable`'s probe file (one left by a killed job is a run's too)."""


def claim_job_dir(conf: RunConfig, recipe: Recipe | None, delete: bool) -> None:
    """:func:`claim_output_dir` for a job of ``recipe`` (None: a state cache build). A resumed training run
    continues its folder unclaimed; a state cache build claims it even with ``resume`` (it resumes by itself)
    and keeps the cache it writes; a training run keeps the cache it reads (``data.target_states=disk``)."""
    if recipe is not None and conf.resume:
        return
    reads_cache = recipe is None or conf.data.target_states == TargetStates.disk
    claim_output_dir(Path(conf.output_dir), conf.overwrite, delete, keep=state_cache_dir(conf) if reads_cache else None,
                     resumable=recipe is not None, saved=recipe.saved_entries if recipe is not None else ())


def claim_output_dir(out: Path, overwrite: bool, delete: bool, keep: Path | None = None,
                     resumable: bool = True, saved: tuple[str, ...] = ()) -> None:
    """Every job's claim on its output_dir. A folder holding a training run (:func:`run_marks`) is refused:
    ``FileExistsError`` naming the choices (``resume=true`` for a ``resumable`` job, ``overwrite=true``, another
    output_dir), before any work. With ``overwrite`` and ``delete`` (the main process, once) the old run's files
    (:data:`RUN_ENTRIES`, and ``saved``: what the job's drafter saves there) are deleted but the state cache at
    ``keep`` (the one this job reads or writes), so nothing of the old run is left beside this one's. A folder holding a run and files no run writes
    (output_dir=. or $HOME by mistake) is refused with ``FileExistsError`` naming them, nothing in it deleted.
    A folder holding no run (a state cache build, a run that failed before training) is taken as it is."""
    marks = run_marks(out)
    if not marks:
        return
    if not overwrite:
        choices = "resume=true continues it, " if resumable else ""
        raise FileExistsError(f"output_dir={out} holds a training run ({', '.join(marks)}): {choices}overwrite=true "
                              f"starts afresh there, or choose another output_dir")
    old = _old_run(out, keep, RUN_ENTRIES + tuple(saved))  # refused before anything is deleted
    for p in old if delete else ():
        p.unlink() if p.is_symlink() or not p.is_dir() else shutil.rmtree(p)  # a link goes, never its target


def run_marks(out: Path) -> list[str]:
    """What shows that ``out`` holds a training run: its ``checkpoints/`` or ``report.json``. A report saying
    nothing finished beside no checkpoint is a run that failed before training produced anything (bad data, no
    row left): no run, so the corrected rerun needs no ``overwrite``."""
    marks = [p.name for p in (out / "checkpoints", out / "report.json") if p.exists()]
    return [] if marks == ["report.json"] and _nothing_finished(out / "report.json") else marks


def _nothing_finished(report: Path) -> bool:
    """Whether ``report`` is the one a run writes as it starts (``finished`` empty); an unreadable one is not."""
    try:
        return json.loads(report.read_text()).get("finished") == []
    except (OSError, ValueError):  # OSError: also one the main process deletes meanwhile (overwrite=true)
        return False


def _old_run(out: Path, keep: Path | None, entries: tuple[str, ...]) -> list[Path]:
    """The entries of ``out`` an overwriting run deletes: all but the one holding ``keep``.
    Raises ``FileExistsError`` naming those not in ``entries`` (no run writes them), before anything is deleted."""
    old = [p for p in out.iterdir() if not (keep is not None and _holds(p, keep))]
    foreign = sorted(p.name for p in old if p.name not in entries and not p.name.startswith(PROBE))
    if foreign:
        raise FileExistsError(f"output_dir={out} holds a training run and files no run writes ({', '.join(foreign)}): "
                              f"overwrite=true deletes only a run's own ({', '.join(entries)}); move them away or "
                              f"choose another output_dir")
    return old


def _holds(entry: Path, path: Path) -> bool:
    """Whether ``path`` is ``entry`` or inside it, read through symbolic links or not."""
    return (path.resolve().is_relative_to(entry.resolve())
            or Path(os.path.abspath(path)).is_relative_to(os.path.abspath(entry)))


def check_writable(out: Path) -> None:
    """Create the run directory and write a probe file in it; ``OSError`` naming it otherwise, before any
    work (not at the first checkpoint)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{PROBE}{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"output_dir={out} is not a writable directory: {e}") from e


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
    train_rows, val_rows, report = self_distilled_rows(conf.data, job.target, job.tokenizer, job.identity,
                                                       conf.cache_dir, accelerator.is_main_process,
                                                       accelerator.process_index, accelerator.num_processes,
                                                       accelerator.wait_for_everyone)
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


def close_job(job: Job, report: dict) -> dict:
    """Wait for every process, end the tracker; returns ``report`` (empty on other processes)."""
    job.accelerator.wait_for_everyone()
    job.accelerator.end_training()
    return report
