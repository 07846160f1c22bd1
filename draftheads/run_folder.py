"""A run's folder: the name of every entry a run writes, its ledger, its report. The one module that knows them
(as nanochat's ``checkpoint_manager.py`` holds its checkpoint folder's), at the bottom of the house so that every
layer reads a run through it.

The ledger (``progress.json``) is the only record of which steps of a run finished:

    {"drafter": "dflash", "started": "2025-01-01T00:00:00+00:00", "finished": ["training", "validation", "save"]}

A training run writes it empty as it starts (no ``resume``) and again, whole and atomically, as each step
finishes (``training``, ``validation``, ``save``, ``export``, ``evaluation``). It is what is read back for which
steps finished: a resumed run that has nothing left to do, a tool or peer run asking whether the save finished
(:func:`check_saved`; :func:`~draftheads.runs.saved.check_finished`, warm starts), and whether an output_dir
holds a run (:func:`~draftheads.runs.output_dir.run_marks`). A run folder without one (made by an older version,
which kept the list in ``report.json``'s ``finished``) is read from there (:func:`finished_steps`).

The report (``report.json``, the user's record: docs/report.md) is written whole and atomically by
:func:`write_report` only, or read, updated and written back by :func:`update_report` (a preflight's refusal, a
later evaluation).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

from omegaconf import OmegaConf

CONFIG = "config.yaml"
"""The run's composed config (Hydra's, resolved), written when it opens."""

TARGET = "target.json"
"""What a run trained against (its identity and a sample of its weights), written beside :data:`CONFIG` when the
run opens; peer runs are checked against it."""

LEDGER = "progress.json"
"""The ledger: which steps finished."""

REPORT = "report.json"
"""The report: what the run measured (docs/report.md)."""

CHECKPOINTS = "checkpoints"
"""Training checkpoints, one folder per saved step."""

EXPORT = "export"
"""Server formats of the drafter (and a trained target), one folder each."""

PLOT = "acceptance.png"
"""The evaluation's plot, beside the report."""

STEPS = ("training", "validation", "save", "export", "evaluation")
"""Every step a run can finish, in order (a run finishes those its config asks for)."""


def is_run(folder: Path) -> bool:
    """Whether ``folder`` holds a run (its :data:`CONFIG`) rather than, say, an export folder."""
    return (Path(folder) / CONFIG).is_file()


def recorded(folder: Path, key: str) -> str | None:
    """The value of dotted ``key`` in the run's :data:`CONFIG` in ``folder`` (``drafter``: which drafter the run
    trained; ``trainer.optimizer``: what a resumed run keeps), None without one (no run, or a run of a version
    without the key)."""
    if not is_run(folder):
        return None
    value = OmegaConf.select(OmegaConf.load(Path(folder) / CONFIG), key, default=None)
    return None if value is None else str(value)


def start_ledger(out: Path, drafter: str) -> Path:
    """A new run's ledger in ``out``: nothing finished, ``started`` now. A report left in ``out`` (by a start that
    failed, which leaves the folder to its corrected rerun) is removed: no report speaks for this run before it
    writes its own."""
    (Path(out) / REPORT).unlink(missing_ok=True)
    return _write(out, {"drafter": drafter, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "finished": []})


def record_finished(out: Path, drafter: str, finished: list[str]) -> Path:
    """Write ``finished`` (the steps done so far, in order) into ``out``'s ledger, keeping when it started (a
    resumed run of an older version, without one, starts it now)."""
    old = read_ledger(out) or {}
    return _write(out, {"drafter": drafter,
                        "started": old.get("started") or datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "finished": list(finished)})


def read_ledger(out: Path) -> dict | None:
    """``out``'s ledger, None without one. Raises ``ValueError`` naming the file and what to do for one that is
    not JSON (damaged) or not a JSON object with a ``finished`` list."""
    path = Path(out) / LEDGER
    if not path.exists():
        return None
    try:
        ledger = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        ledger = e
    if not isinstance(ledger, dict) or not isinstance(ledger.get("finished"), list):
        why = f"unreadable ({ledger})" if isinstance(ledger, Exception) else "not a JSON object with a 'finished' list"
        raise ValueError(f"{path}: the run's ledger is {why}. It is written atomically, so something else changed it: "
                         f"restore it (e.g. {{\"drafter\": ..., \"finished\": [\"training\", \"validation\", "
                         f"\"save\"]}} lists the steps done), or start afresh with overwrite=true")
    return ledger


def finished_steps(out: Path) -> list[str] | None:
    """The steps the run in ``out`` finished, from its ledger; None when ``out`` holds neither a ledger nor a
    report. A folder without a ledger (made by an older version, which kept them in ``report.json``) is read
    from ``report.json``'s ``finished``; a report without ``finished`` was written by a version that wrote it
    after the save only (``["save"]``). Raises ``ValueError`` (JSON's included) for an unreadable ledger or
    report, ``OSError`` for one that cannot be read."""
    ledger = read_ledger(out)
    if ledger is not None:
        return list(ledger["finished"])
    report = Path(out) / REPORT
    if not report.exists():
        return None
    return list(json.loads(report.read_text()).get("finished", ["save"]))


def check_saved(out: Path, what: str, resume: str) -> None:
    """``FileNotFoundError`` unless the run in ``out`` finished its save (:func:`finished_steps`): a run killed
    before its save, or a new run started over an old one, holds no drafter of its own config (whatever an older
    run left there). ``what`` names who asks (the ledger's path, or the key naming the run), ``resume`` how to
    finish the run (the command to rerun)."""
    finished = finished_steps(out) or []
    if "save" not in finished:
        raise FileNotFoundError(f"{what}: the run has not finished its save (finished: {finished}), so no drafter "
                                f"there is known to be its config's; resume=true finishes it: {resume}")


def read_report(out: Path) -> dict:
    """``out``'s report, ``{}`` without one."""
    path = Path(out) / REPORT
    return json.loads(path.read_text()) if path.exists() else {}


def write_report(out: Path, report: dict) -> Path:
    """``report`` as ``out``'s report, whole and atomically (the previous one stays whole until the new one
    replaces it); returns its path."""
    return _write_json(Path(out) / REPORT, report)


def update_report(out: Path, fields: dict) -> Path:
    """``out``'s report (:func:`read_report`) with ``fields`` set, written back (:func:`write_report`)."""
    return write_report(out, {**read_report(out), **fields})


def _write(out: Path, ledger: dict) -> Path:
    """``ledger`` as ``out``'s ledger, atomically."""
    return _write_json(Path(out) / LEDGER, ledger)


def _write_json(path: Path, value: dict) -> Path:
    """``value`` as JSON at ``path``: written whole beside it, then renamed over it (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)
    return path
