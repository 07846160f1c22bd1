"""A training run's life, for any registered drafter, read top to bottom: open, train, finish, evaluate, close.

    open the job (config, accelerator, target, eval sets, the recipe's checks, resume point, peer runs)
    -> the serving preflight (vLLM reads the untrained export as meant)
    -> self-distilled rows and target states -> the recipe's stages on the spine
    -> rank 0: validate, save, export -> report.json (atomic) -> evaluate -> report.json again

Everything that can fail runs before training; nothing that fails after it loses the trained drafter: it is
saved and exported before evaluation, and the run's ledger (``progress.json``,
:mod:`draftheads.run_folder`) says which steps finished. What is not the life itself lives beside it:
claiming the output folder (:mod:`~draftheads.runs.output_dir`), the rows (:mod:`~draftheads.runs.rows`), the
preflight (:mod:`~draftheads.runs.preflight`), finished and peer runs read back (:mod:`~draftheads.runs.saved`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from draftheads import drafters
from draftheads.data.pipeline import made_source
from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import Recipe, Trained
from draftheads.evaluation.evaluator import NOTES, format_table, hardware, log_eval, write_report_and_plot
from draftheads.evaluation.methods import evaluate_methods, load_eval_sets, prompt_lookup_peer, unmeasured_peers
from draftheads.models.decoding import GenerationDefaults, generation_defaults
from draftheads.models.partial import place
from draftheads.models.speculative import Sampling
from draftheads.models.target import context_window, load_target, model_identity, resolve_target_path
from draftheads.run_folder import (
    CONFIG,
    PLOT,
    TARGET,
    finished_steps,
    read_report,
    record_finished,
    recorded,
    start_ledger,
)
from draftheads.runs.job import Job
from draftheads.runs.output_dir import check_writable, claim_job_dir, lock_output_dir, release, target_record
from draftheads.runs.preflight import llamacpp_preflight, serving_preflight
from draftheads.runs.resume import check_resume
from draftheads.runs.rows import job_rows
from draftheads.runs.saved import PeerRun, check_peer_runs, load_peer_runs, peer_methods
from draftheads.training.checkpoint import check_plan, latest_checkpoint
from draftheads.training.config import RunConfig, TargetStates, apply_generation_defaults, to_schema
from draftheads.training.runtime import (
    distributed,
    make_accelerator,
    print0,
    settle_optimizer,
    settle_precision,
    start_tracker,
)
from draftheads.training.sharding import sharded
from draftheads.training.spine import plan_settings
from draftheads.training.warm_start import check_init_path


def train(name: str, cfg: DictConfig) -> dict:
    """The whole job of drafter ``name`` for a composed config; returns the report (main process) or {}.
    With ``resume=true``, a run whose ledger lists every step its config asks for does nothing (the report it
    returns is read only to return it, and its ``config.yaml`` is left as it is)."""
    recipe = drafters.get(name)
    job = open_job(cfg, recipe)
    try:
        if job.done:
            print(f"{job.out} finished already ({', '.join(job.finished)}): nothing to resume (to measure it with "
                  f"other eval settings: python train/evaluate.py {job.out} eval....)", flush=True)
            return close_job(job, read_report(job.out) if job.accelerator.is_main_process else {})
        # an old ledger must not look like this run's; this ledger, nothing finished, lets a rerun claim the folder
        # until a checkpoint is written (claim_output_dir), so a start that fails on the data blocks no corrected
        # rerun
        if job.accelerator.is_main_process and job.resume is None and not job.finished:
            start_ledger(job.out, recipe.spec.name)
        preflight = serving_preflight(job, recipe)  # a server that misreads the export stops the job here, cheaply
        if served := llamacpp_preflight(job, recipe):
            preflight["llama.cpp"] = served
        job.accelerator.wait_for_everyone()
        # a run stopped after its save (during its export or evaluation) neither trains nor validates again: its
        # rows need no target states (the DSpark default job's took 1.5 minutes to compute, for nothing)
        attach = job.conf.data.target_states != TargetStates.online and "save" not in job.finished
        train_rows, val_rows, data_report = job_rows(job, recipe.state_layers(job.conf, job.target), attach=attach,
                                                     unusable=recipe.unusable)
        trained = recipe.train(job, train_rows)
        report = {}
        if job.accelerator.is_main_process:
            report = finish_run(job, recipe, trained, val_rows, {"preflight": preflight,
                                                                 "data": data_report.as_dict(),
                                                                 "train_curves": trained.curves})
        return close_job(job, report)
    finally:
        release(job.lock)


def open_job(cfg: DictConfig, recipe: Recipe | None = None) -> Job:
    """Typed config, precision, accelerator, the output_dir's lock, the target on this process's device, eval sets
    (read with its tokenizer, which long sets count with: a bad file fails now, not after training),
    ``recipe.check`` (settings that would fail later), the resume point, then the output_dir claimed (an overwritten
    run deleted only now, every check above passed), the tracker, and ``config.yaml`` and ``target.json`` in the
    run directory (left as they are by a resume with nothing left to do). ``recipe`` None opens a job that trains
    nothing (a state cache build). The caller releases ``job.lock`` (:func:`~draftheads.runs.output_dir.release`).

    Raises ``ValueError`` for an undeclared config key, a config of another drafter than ``recipe``, a name in
    ``eval.peers`` that is no method's (:func:`~draftheads.drafters.check_method_names`), ``resume=true`` with
    ``overwrite=true``, a resume with settings other than the run's (:func:`~draftheads.runs.resume.check_resume`),
    an ``init_from`` inside output_dir, what ``recipe.check`` refuses, and, with ``resume=true``, for a checkpoint
    of another target or of a stage not in ``recipe.spec.stages``; ``FileNotFoundError`` for an ``init_from`` that is
    not there; ``FileExistsError`` for an output_dir holding a training run or files no run writes
    (:func:`~draftheads.runs.output_dir.claim_output_dir`); ``RuntimeError`` for an output_dir another job holds —
    all before anything in output_dir is deleted or rewritten.
    """
    conf, spec = to_schema(cfg), recipe.spec if recipe is not None else None
    if not conf.data.mixture and cfg.data.mixture:  # a single source named replaced the preset's mixture
        cfg.data.mixture = []  # (DataConfig): the saved config and the tracker's say what trains
    if spec is not None and conf.drafter != spec.name:
        raise ValueError(f"drafter={conf.drafter!r}: this job trains {spec.name!r} (use train/{conf.drafter}.py)")
    drafters.check_method_names(conf.eval.peers or ())
    if conf.model.partial and recipe is not None:
        check_partial(conf)
    if conf.resume and conf.overwrite:
        raise ValueError("resume=true continues the run in output_dir and overwrite=true deletes it: set one of them")
    out = Path(conf.output_dir)
    precision = settle_precision(cfg, conf)  # auto: bf16 where this machine has it natively, else float32
    if recipe is not None:
        check_init_path(recipe, conf)
        if conf.eval.enabled:
            check_peer_runs(conf.eval.peer_runs, conf.eval.unusable_peers)
        if conf.resume:
            check_resume(out, cfg)
    claim_job_dir(conf, spec, delete=False)  # refused before any process starts
    accelerator = make_accelerator(cfg)
    print0(accelerator, precision)
    optimizer = settle_optimizer(cfg, conf, sharded(accelerator), recorded(out, "trainer.optimizer")
                                 if conf.resume else None)
    if optimizer:
        print0(accelerator, optimizer)
    lock = None
    if accelerator.is_main_process:
        check_writable(out)
        lock = lock_output_dir(out)
    try:
        with accelerator.main_process_first():  # rank 0 converts/downloads; the others then read its cache
            target, tokenizer, target_path = load_target(conf.model, conf.cache_dir)
        place(target, accelerator.device)
        identity = model_identity(target, conf.model)
        with accelerator.main_process_first():  # rank 0 writes a self-made set's prompts; the others read them
            eval_sets = load_eval_sets(conf.eval, tokenizer, context_window(target),  # in the target's tokens
                                       eval_set_maker(target, tokenizer, identity, conf.cache_dir))
        set_seed(conf.trainer.seed)  # building or converting an uncached target, or self-made prompts, drew from it
        print0(accelerator, f"target: {target_path} ({identity['num_hidden_layers']} layers, "
                            f"hidden {identity['hidden_size']}, vocab {identity['vocab_size']})")
        apply_generation_defaults(conf, target.generation_config)
        print0(accelerator, decoding_line(conf, target, tokenizer))
        if recipe is not None:
            recipe.check(conf, target)
        resume = latest_checkpoint(out, identity, spec.stages) if spec is not None and conf.resume else None
        if resume is not None:  # the plan's settings now, its rows once they are made (the spine)
            check_plan(resume[0], plan_settings(accelerator, conf.trainer))
        finished = (finished_steps(out) or []) if recipe is not None and conf.resume else []
        done = bool(recipe is not None and conf.resume and set(_steps(conf)) <= set(finished))
        if recipe is not None and conf.resume and resume is None and not finished:
            print0(accelerator, f"resume=true: {out} holds no checkpoint to continue from: starting afresh")
        if accelerator.is_main_process:
            claim_job_dir(conf, spec, delete=True)  # an overwritten run goes only now: every check has passed
        accelerator.wait_for_everyone()
        start_tracker(accelerator, cfg, run_name=out.name)  # in the claimed folder: an old run's files are gone
        if accelerator.is_main_process and not done:
            OmegaConf.save(cfg, out / CONFIG, resolve=True)
            (out / TARGET).write_text(json.dumps(target_record(target, identity), indent=1))
    except BaseException:
        release(lock)
        raise
    return Job(conf, accelerator, out, eval_sets, target, tokenizer, target_path, identity, resume, precision, lock,
               finished, done)


def eval_set_maker(target, tokenizer, identity: dict, cache_dir: str):
    """``make(set, count)`` for :func:`~draftheads.evaluation.methods.load_eval_sets`: a ``self_made`` eval set's
    prompts written by ``target`` (:func:`~draftheads.data.pipeline.made_source`)."""
    return lambda src, count: made_source(src, count, target, tokenizer, identity, cache_dir, show_progress=False)


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


def _steps(conf) -> list[str]:
    """The steps a run of ``conf`` finishes, in order (its ledger lists those done)."""
    return ["training", "validation", "save", *(["export"] if conf.export else []),
            *(["evaluation"] if conf.eval.enabled else [])]


def _record(out: Path) -> dict:
    """The run's ``target.json``: what it trained against (a stage-2 target has changed since)."""
    return json.loads((out / TARGET).read_text())


def finish_run(job: Job, recipe: Recipe, trained: Trained, val_rows: list[dict], extra: dict) -> dict:
    """Validate, save, export (each export with its ``serving.json``: :meth:`Recipe.write_serving`), write
    ``report.json``, then evaluate and write it again; returns the report.
    The ledger (:mod:`draftheads.run_folder`) is written as each step finishes, so a run a failed step
    stopped says which steps it finished (the report does not repeat it). A resumed run
    whose ledger lists the save (stopped during its export or evaluation) does not validate or save again: its
    saved drafter is read back and its report, written after the save, carried on; only the steps left run.
    Metrics are logged at ``trained.step``, the last training step on the tracker's axis."""
    conf, out = job.conf, job.out
    saved = "save" in job.finished
    if saved:  # stopped after its save: the report written then holds the validation and what the save returned
        finished = list(job.finished)
        loaded = recipe.load(out, conf, job.target)  # what was saved, with what validation added for evaluation
        trained = replace(trained, model=loaded.model, saved=loaded.saved)
        report = {**read_report(out), "hardware": hardware(), "distributed": distributed(job.accelerator),
                  "precision": job.precision, "resumed_from": str(job.resume[0]) if job.resume else None}
        print(f"{out}: validation and save finished before ({', '.join(finished)}): carried on", flush=True)
    else:
        finished = _finished(out, recipe, [], "training")
        val = recipe.validate(job, trained, val_rows)
        job.accelerator.log(val, step=trained.step)
        finished = _finished(out, recipe, finished, "validation")
        print("validation (held-out rows): " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())
                                                         if "pos" not in k or k.endswith(("pos1", "pos2"))), flush=True)
        report = {"drafter": recipe.spec.name, "config": json.loads(json.dumps(asdict(conf), default=str)),
                  "target": job.target_path, "hardware": hardware(), "distributed": distributed(job.accelerator),
                  "dtype": conf.model.dtype, "precision": job.precision,
                  "resumed_from": str(job.resume[0]) if job.resume else None, "init_from": trained.init_from,
                  "validation": val, **extra, "notes": NOTES}
        report |= recipe.save(job, trained)
        finished = _finished(out, recipe, finished, "save")
    if conf.export and "export" not in finished:
        report["exports"] = {**report.get("exports", {}), **recipe.export(out, job.target, trained)}
        finished = _finished(out, recipe, finished, "export")
    if "export" not in job.finished:  # beside every export, who serves it (docs/serving.md)
        for path in recipe.write_serving(out, conf, trained):
            print(f"serving: {path}", flush=True)
    print(f"report: {write_report_and_plot(report, out)}", flush=True)
    if conf.eval.enabled:
        report["peer_runs"], report["eval"] = evaluate(job, recipe, trained)
        print(format_table(report["eval"]), flush=True)
        print(f"report: {write_report_and_plot(report, out)}", flush=True)
        _finished(out, recipe, finished, "evaluation")
        log_eval(job.accelerator, report["eval"], out / PLOT, trained.step)
    return report


def _finished(out: Path, recipe: Recipe, finished: list[str], step: str) -> list[str]:
    """``finished`` and ``step``, written into the run's ledger (atomically) before the list is returned."""
    finished = [*finished, step]
    record_finished(out, recipe.spec.name, finished)
    return finished


def evaluate(job: Job, recipe: Recipe, trained: Trained) -> tuple[list[str], dict]:
    """The end of run's evaluation: the peer runs (``eval.peer_runs``) that fit, loaded after the save (this
    run's target is then the one it is served with), and :func:`evaluate_drafter` beside them on the job's eval
    sets. Returns the peers' notes (with any ``eval.peers`` name left unmeasured) and the evaluated sets."""
    conf, out = job.conf, job.out
    host = resolve_target_path(recipe.target_of(out, conf), conf.cache_dir)
    peers, notes = load_peer_runs(conf.eval.peer_runs, _record(out), host, job.target, conf.eval.unusable_peers)
    sets = evaluate_drafter(conf, recipe, trained, job.target, job.tokenizer, job.eval_sets, peers)
    return notes + unmeasured_peers(conf.eval, sets), sets


def evaluate_drafter(conf, recipe: Recipe, trained: Trained, target, tokenizer, eval_sets: dict,
                     peers: list[PeerRun] = ()) -> dict:
    """Speculative evaluation of ``trained`` (its chain) beside its own methods, the peer runs' and prompt
    lookup, on every eval set and temperature (:func:`draftheads.evaluation.methods.evaluate_methods`)."""
    drafter = recipe.chain(conf, trained, target)

    def peers_at(sampling: Sampling) -> dict:
        own = recipe.peers(conf, trained, target, tokenizer, sampling)
        own |= peer_methods(conf, list(peers), tokenizer, sampling, {drafter.name, *own}, target)
        return own | prompt_lookup_peer(conf.eval, target, tokenizer, sampling)

    return evaluate_methods(conf.eval, eval_sets, target, tokenizer, drafter, peers_at, conf.model.generation_defaults)


def close_job(job: Job, report: dict) -> dict:
    """Wait for every process, end the tracker; returns ``report`` (empty on other processes)."""
    job.accelerator.wait_for_everyone()
    job.accelerator.end_training()
    return report
