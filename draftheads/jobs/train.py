"""A training job for any registered drafter, and the one end of run they all share.

    open the job (config, accelerator, target, eval sets, the recipe's checks, resume point, peer runs)
    -> the serving preflight (vLLM reads the untrained export as meant)
    -> self-distilled rows and target states -> the recipe's stages on the spine
    -> rank 0: validate, save, export -> report.json (atomic) -> evaluate -> report.json again

Everything that can fail runs before training; nothing that fails after it loses the trained drafter: it is
saved and exported before evaluation, and ``report.json`` says which steps finished.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import DictConfig

from draftheads import drafters
from draftheads.evaluation.evaluator import NOTES, format_table, hardware, log_eval, write_report
from draftheads.jobs.preflight import serving_preflight
from draftheads.jobs.runs import evaluate_drafter, load_peer_runs
from draftheads.models.target import resolve_target_path
from draftheads.training.config import TargetStates
from draftheads.training.job import TARGET_FILE, Job, close_job, job_rows, open_job
from draftheads.training.recipe import Recipe, Trained
from draftheads.training.runtime import distributed


def train(name: str, cfg: DictConfig) -> dict:
    """The whole job of drafter ``name`` for a composed config; returns the report (main process) or {}."""
    recipe = drafters.get(name)
    job = open_job(cfg, recipe)
    previous = _report(job.out)
    if job.conf.resume and set(_steps(job.conf)) <= set(previous.get("finished", ())):
        print(f"{job.out} finished already ({', '.join(previous['finished'])}): nothing to resume", flush=True)
        return close_job(job, previous if job.accelerator.is_main_process else {})
    # an old report must not look like this run's; this one, nothing finished, lets a rerun claim the folder until
    # a checkpoint is written (claim_output_dir), so a start that fails on the data blocks no corrected rerun
    if job.accelerator.is_main_process and not job.conf.resume:
        write_report({"drafter": recipe.name, "finished": [],
                      "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}, job.out)
    preflight = serving_preflight(job, recipe)  # a server that misreads the export stops the job here, cheaply
    job.accelerator.wait_for_everyone()
    train_rows, val_rows, data_report = job_rows(job, recipe.state_layers(job.conf, job.target),
                                                 attach=job.conf.data.target_states != TargetStates.online,
                                                 unusable=recipe.unusable)
    trained = recipe.train(job, train_rows)
    report = {}
    if job.accelerator.is_main_process:
        report = finish_run(job, recipe, trained, val_rows, {"preflight": preflight, "data": data_report.as_dict(),
                                                             "train_curves": trained.curves})
    return close_job(job, report)


def _steps(conf) -> list[str]:
    """The steps a run of ``conf`` finishes, in order (``report["finished"]`` lists those done)."""
    return ["training", "validation", "save", *(["export"] if conf.export else []),
            *(["evaluation"] if conf.eval.enabled else [])]


def _record(out: Path) -> dict:
    """The run's ``target.json``: what it trained against (a stage-2 target has changed since)."""
    return json.loads((out / TARGET_FILE).read_text())


def _report(out: Path) -> dict:
    path = out / "report.json"
    return json.loads(path.read_text()) if path.exists() else {}


def finish_run(job: Job, recipe: Recipe, trained: Trained, val_rows: list[dict], extra: dict) -> dict:
    """Validate, save, export (each export with its ``serving.json``: :meth:`Recipe.write_serving`), write
    ``report.json``, then evaluate and write it again; returns the report.
    ``report["finished"]`` lists the steps done, so a report left by a failed evaluation says so. Metrics are
    logged at ``trained.step``, the last training step on the tracker's axis."""
    conf, out = job.conf, job.out
    val = recipe.validate(job, trained, val_rows)
    job.accelerator.log(val, step=trained.step)
    print("validation (held-out rows): " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())
                                                     if "pos" not in k or k.endswith(("pos1", "pos2"))), flush=True)
    report = {"drafter": recipe.name, "config": json.loads(json.dumps(asdict(conf), default=str)),
              "target": job.target_path, "hardware": hardware(), "distributed": distributed(job.accelerator),
              "dtype": conf.model.dtype, "resumed_from": str(job.resume[0]) if job.resume else None,
              "init_from": trained.init_from,
              "validation": val, **extra, "notes": NOTES}
    report |= recipe.save(job, trained)
    report["finished"] = ["training", "validation", "save"]
    if conf.export:
        report["exports"] = {**report.get("exports", {}), **recipe.export(out, job.target, trained)}
        report["finished"].append("export")
    for path in recipe.write_serving(out, conf, trained):  # beside every export, who serves it (docs/serving.md)
        print(f"serving: {path}", flush=True)
    print(f"report: {write_report(report, out)}", flush=True)
    if conf.eval.enabled:  # peers after the save: this run's target is then the one it is served with
        host = resolve_target_path(recipe.target_of(out, conf), conf.cache_dir)
        peers, report["peer_runs"] = load_peer_runs(conf.eval.peer_runs, _record(out), host, job.target)
        report["eval"] = evaluate_drafter(conf, recipe, trained, job.target, job.tokenizer, job.eval_sets, peers)
        report["finished"].append("evaluation")
        print(format_table(report["eval"]), flush=True)
        print(f"report: {write_report(report, out)}", flush=True)
        log_eval(job.accelerator, report["eval"], out / "acceptance.png", trained.step)
    return report
