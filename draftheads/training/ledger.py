"""The resume ledger: which steps of a run's end finished, in ``progress.json`` in the run folder, apart from
the user's ``report.json``.

    {"drafter": "dflash", "started": "2025-01-01T00:00:00+00:00", "finished": ["training", "validation", "save"]}

A training run writes it empty as it starts (no ``resume``) and again, whole and atomically, as each step
finishes (``training``, ``validation``, ``save``, ``export``, ``evaluation``). It is the only thing read back for
which steps finished: a resumed run that has nothing left to do, a tool or peer run asking whether the save
finished (:func:`~draftheads.runs.saved.check_finished`, warm starts), and whether an output_dir holds a run
(:func:`~draftheads.runs.output_dir.run_marks`). It lives in the training layer because warm starts
(:mod:`draftheads.training.warm_start`) read it too.

A run folder without it (made by an older version) is read as before: ``report.json``'s ``finished``
(:func:`finished_steps`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

LEDGER = "progress.json"
"""The ledger's file name in the run folder."""

STEPS = ("training", "validation", "save", "export", "evaluation")
"""Every step a run can finish, in order (a run finishes those its config asks for)."""


def start_ledger(out: Path, drafter: str) -> Path:
    """A new run's ledger in ``out``: nothing finished, ``started`` now."""
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
    report = Path(out) / "report.json"
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


def _write(out: Path, ledger: dict) -> Path:
    """``ledger`` as ``out/progress.json``, atomically (as ``report.json`` is written: whole, then renamed)."""
    path = Path(out) / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ledger, indent=1))
    os.replace(tmp, path)
    return path
