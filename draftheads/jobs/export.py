"""Re-export a finished run's drafter for inference servers, read back by its strict loader."""

from __future__ import annotations

from pathlib import Path

from draftheads.jobs.cli import parse_args
from draftheads.jobs.llamacpp import llamacpp_export
from draftheads.runs.output_dir import holding
from draftheads.runs.saved import open_run
from draftheads.serving.llamacpp_env import ensure_llamacpp


def export_run(run_dir: Path, overrides: list[str] = (), llamacpp_dir: str | None = None) -> dict[str, str]:
    """Rewrite ``run_dir``'s server formats under ``export/`` from its saved drafter, and each one's
    ``serving.json`` (:meth:`~draftheads.drafters.contract.Serving.write_serving`); with ``llamacpp_dir`` also the
    GGUF llama.cpp serves (:func:`~draftheads.jobs.llamacpp.llamacpp_export`, llama.cpp built there on first use).
    Returns ``{format: folder}`` (empty for a drafter whose saved model is its export, like DFlash's, without
    ``llamacpp_dir``). Raises ``ValueError`` for a drafter llama.cpp does not serve as trained; what
    :func:`~draftheads.runs.saved.open_run` raises: ``FileNotFoundError`` for a run that has not finished its save
    (``resume=true`` finishes it), ``ValueError`` for overrides choosing another target than its drafter's,
    ``RuntimeError`` naming the holder while another job works in the run's folder (its ``.lock``)."""
    llamacpp = ensure_llamacpp(llamacpp_dir) if llamacpp_dir else None
    with holding(Path(run_dir)):
        run = open_run(run_dir, overrides)
        paths = run.recipe.export(Path(run_dir), run.target, run.trained)
        for path in run.recipe.write_serving(Path(run_dir), run.conf, run.trained):
            print(f"serving: {path}", flush=True)
    if llamacpp is not None:
        run = open_run(run_dir, overrides, run.recipe.spec.vllm_weights)
        paths["llama.cpp"] = str(llamacpp_export(run, llamacpp))
    return paths


def cli(argv: list[str], usage: str = __doc__) -> dict[str, str]:
    """``train/export.py``'s command line: the run (first or ``run_dir=``), ``llamacpp=DIR`` and config overrides;
    prints each format's folder."""
    run_dir, options, overrides = parse_args(argv, ("llamacpp",), usage)
    paths = export_run(run_dir, overrides, options.get("llamacpp"))
    for name, path in paths.items():
        print(f"{name}: {path}")
    if not paths:
        print(f"{run_dir}: its saved model is its only export; nothing else to export")
    return paths
