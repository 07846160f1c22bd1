"""Re-export a finished run's drafter for inference servers, read back by its strict loader."""

from __future__ import annotations

from pathlib import Path

from draftheads.jobs.cli import parse_args
from draftheads.runs.output_dir import holding
from draftheads.runs.saved import open_run


def export_run(run_dir: Path, overrides: list[str] = ()) -> dict[str, str]:
    """Rewrite ``run_dir``'s server formats under ``export/`` from its saved drafter, and each one's
    ``serving.json`` (:meth:`~draftheads.drafters.contract.Recipe.write_serving`); returns ``{format: folder}``
    (empty for a drafter whose saved model is its export, like DFlash's). Raises what
    :func:`~draftheads.runs.saved.open_run` raises: ``FileNotFoundError`` for a run that has not finished its save
    (``resume=true`` finishes it), ``ValueError`` for overrides choosing another target than its drafter's,
    ``RuntimeError`` naming the holder while another job works in the run's folder (its ``.lock``)."""
    with holding(Path(run_dir)):
        run = open_run(run_dir, overrides)
        paths = run.recipe.export(Path(run_dir), run.target, run.trained)
        for path in run.recipe.write_serving(Path(run_dir), run.conf, run.trained):
            print(f"serving: {path}", flush=True)
    return paths


def cli(argv: list[str], usage: str = __doc__) -> dict[str, str]:
    """``train/export.py``'s command line: the run (first or ``run_dir=``) and config overrides; prints each
    format's folder."""
    run_dir, _, overrides = parse_args(argv, (), usage)
    paths = export_run(run_dir, overrides)
    for name, path in paths.items():
        print(f"{name}: {path}")
    if not paths:
        print(f"{run_dir}: its saved model is its only export; nothing else to export")
    return paths
