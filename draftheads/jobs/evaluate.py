"""Speculative evaluation of a finished run of any drafter (the evaluator its training run ended with)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from draftheads import drafters
from draftheads.data.regenerate import target_prompt_ids
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.evaluator import NOTES, format_table, hardware, write_report_and_plot
from draftheads.evaluation.methods import load_eval_sets, unmeasured_peers
from draftheads.jobs.cli import parse_args
from draftheads.models.target import context_window, load_target, model_identity
from draftheads.run_folder import REPORT, TARGET, read_report
from draftheads.runs.life import eval_set_maker, evaluate_drafter
from draftheads.runs.output_dir import holding
from draftheads.runs.preflight import vllm_serving
from draftheads.runs.saved import SavedRun, load_peer_runs, open_run
from draftheads.serving.vllm_eval import evaluate_in_vllm


def evaluate_run(run_dir: Path, overrides: list[str] = (), weights: str | None = None, backend: str = "transformers",
                 vllm_venv: str | None = None) -> dict:
    """Evaluate ``run_dir``'s drafter (or the export folder ``weights``) on the run's eval sets with
    ``overrides`` applied, beside its own methods, ``eval.peer_runs`` and prompt lookup. The run's
    ``report.json`` keeps other sets; the sets measured replace those of the same name, each saying which
    drafter it measured, and ``evaluations`` records the invocation. An explicit evaluation evaluates, whatever
    the run's ``eval.enabled`` said. Returns the report.

    ``backend="vllm"``: the target is not loaded here (only its ends, ``model.partial``, to read the drafter);
    vLLM decodes with the run's export and without it, greedily, in its own environment (``vllm_venv``, made on
    first use at ``$DRAFTHEADS_CACHE/vllm-venv``): :func:`~draftheads.serving.vllm_eval.evaluate_in_vllm`, no
    peers. Raises ``ValueError`` for another backend, a name in ``eval.peers`` that is no method's
    (:func:`~draftheads.drafters.check_method_names`), and what :func:`~draftheads.runs.saved.open_run` raises:
    ``FileNotFoundError`` for a run that has not finished its save (``resume=true`` finishes it), ``ValueError``
    for overrides choosing another target than the one its drafter was trained with; ``RuntimeError`` naming the
    holder while another job works in the run's folder (its ``.lock``)."""
    if backend not in ("transformers", "vllm"):
        raise ValueError(f"backend={backend!r}: transformers (the target in process) or vllm")
    check_writable_report(Path(run_dir))  # the report is written after the evaluation: refused before it
    with holding(Path(run_dir)):  # no training resumed, export or other evaluation writes there meanwhile
        return _evaluate(run_dir, overrides, weights, backend, vllm_venv)


def _evaluate(run_dir: Path, overrides: list[str], weights: str | None, backend: str, vllm_venv: str | None) -> dict:
    """:func:`evaluate_run` once the run's folder is held."""
    in_vllm = backend == "vllm"
    run = open_run(run_dir, overrides, weights or (drafters.of_run(run_dir).spec.vllm_weights if in_vllm else None),
                   partial=in_vllm)
    conf = replace(run.conf, eval=replace(run.conf.eval, enabled=True))
    drafters.check_method_names(conf.eval.peers or ())
    if in_vllm:
        notes = ["peer runs are not measured with backend=vllm"]
        sets = vllm_sets(run, conf, vllm_venv)
    else:
        record = json.loads((Path(run_dir) / TARGET).read_text())
        peers, notes = load_peer_runs(conf.eval.peer_runs, record, run.target_path, run.target,
                                      conf.eval.unusable_peers)
        sets = evaluate_drafter(conf, run.recipe, run.trained, run.target, run.tokenizer,
                                load_eval_sets(conf.eval, run.tokenizer, context_window(run.target),
                                               configured_target_writes(run, conf)),
                                peers)
        notes += unmeasured_peers(conf.eval, sets)
    source = str(Path(run_dir) / weights) if weights else "run"
    for m in sets.values():
        m["drafter"] = source
    report = read_report(run_dir)
    report["eval"] = {**report.get("eval", {}), **sets}
    report["notes"], report["peer_runs"] = NOTES, notes
    report.setdefault("evaluations", []).append({
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "drafter": source,
        "overrides": list(overrides), "backend": backend, "sets": sorted(sets), "peer_runs": notes,
        "eval": json.loads(json.dumps(asdict(conf.eval), default=str)), "hardware": hardware(),
        "dtype": conf.model.dtype})
    print(format_table(sets))
    print(f"report: {write_report_and_plot(report, run_dir)}")
    return report


def configured_target_writes(run: SavedRun, conf) -> Callable:
    """``make(set, count)`` for :func:`~draftheads.evaluation.methods.load_eval_sets`: a self-made set's prompts
    written by the target the run's config names (``model``), as the training job writes them before it trains,
    so that every run on that target, and every evaluation of it, reads the same prompts. A run evaluated on a
    target of its own (Medusa's stage-2 target) would write them with its trained weights, and under the cache key
    of the configured target (:func:`~draftheads.models.target.model_identity` names a target, not its weights):
    whichever run wrote a set first would have set it for every later one. That target is loaded (whole, once) when
    a self-made set is asked, even one already cached, and for no other set."""
    if run.recipe.target_of(run.folder, conf) == conf.model:
        return eval_set_maker(run.target, run.tokenizer, model_identity(run.target, conf.model), conf.cache_dir)

    @functools.cache
    def writer() -> Callable:
        target, tokenizer, _ = load_target(conf.model, conf.cache_dir)
        return eval_set_maker(target, tokenizer, model_identity(target, conf.model), conf.cache_dir)
    return lambda src, count: writer()(src, count) if src.source == "self_made" else src


def check_writable_report(run_dir: Path) -> None:
    """``PermissionError`` naming the file, before any work, when ``run_dir`` cannot take the report this
    evaluation writes (a read-only run: copy it first)."""
    probe = run_dir / (REPORT + ".tmp")
    if not run_dir.is_dir():
        return  # open_run names what is missing
    try:
        with open(probe, "a"):
            pass
        probe.unlink()
    except OSError as e:
        raise PermissionError(e.errno, f"{run_dir} cannot take this evaluation's report ({probe}: {e.strerror}): "
                                       f"copy the run somewhere writable and evaluate the copy") from e


def vllm_sets(run, conf, vllm_venv: str | None) -> dict:
    """Every eval set measured in vLLM with the run's export (greedy; see :func:`evaluate_in_vllm`), with the
    run's ``vllm.*`` parallelism; a vLLM without the drafter's method is refused first
    (:func:`~draftheads.runs.preflight.vllm_serving`)."""
    spec = run.recipe.vllm_config(run.folder, conf, run.trained)
    python = vllm_serving(run.recipe.spec, spec["method"], vllm_venv)  # a vLLM without the method: refused here
    stop = sorted(stop_token_ids(run.tokenizer, run.target.generation_config))
    tokenizer = run.tokenizer
    return {name: evaluate_in_vllm(python, run.target_path, spec,
                                   [target_prompt_ids(tokenizer, p) for p in prompts],
                                   conf.eval.max_new_tokens, stop, {"dtype": conf.model.dtype, **conf.vllm.engine()})
            for name, prompts in load_eval_sets(conf.eval, tokenizer).items()}


def cli(argv: list[str], usage: str = __doc__) -> dict:
    """``train/evaluate.py``'s command line: the run (first or ``run_dir=``), ``weights=``, ``backend=``
    (transformers | vllm), ``vllm_venv=``, config overrides."""
    run_dir, options, overrides = parse_args(argv, ("weights", "backend", "vllm_venv"), usage)
    return evaluate_run(run_dir, overrides, options.get("weights"), options.get("backend", "transformers"),
                        options.get("vllm_venv"))
