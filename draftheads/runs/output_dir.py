"""A run's output folder: what a run writes there (:data:`RUN_ENTRIES`, ``target.json``) and every job's claim on
it (refused when it holds a training run, unless resumed or overwritten; an overwrite deletes only a run's own)."""

from __future__ import annotations

import os
import shutil
import socket
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import yaml

from draftheads.drafters.spec import DrafterSpec
from draftheads.models.target import weights_sample
from draftheads.run_folder import CHECKPOINTS, CONFIG, EXPORT, LEDGER, PLOT, REPORT, TARGET, finished_steps
from draftheads.runs.rows import state_cache_dir
from draftheads.training.config import RunConfig, TargetStates


def target_record(target, identity: dict) -> dict:
    """The target's identity (:func:`~draftheads.models.target.model_identity`) and a sample of its weights,
    which tells apart targets of one architecture and size."""
    return {**identity, "weights_sample_sha256": weights_sample(target)}


RUN_ENTRIES = (CONFIG, TARGET, LEDGER, LEDGER + ".tmp", REPORT, REPORT + ".tmp", CHECKPOINTS, EXPORT, PLOT,
               "vllm_parity.json", "hidden_states", "logs", "wandb", "wandb_run_id")
"""What a run, its state cache build, its tracker and the jobs reading it back write in its output_dir (with
what its drafter saves beside ``export/``: ``DrafterSpec.saved_entries``): an overwriting run deletes these and
nothing else."""

LOCK = ".lock"
"""The file a job holds an exclusive lock on while it works in the folder (:func:`lock_output_dir`)."""

PROBE = ".write-probe-"
"""Name prefix of :func:`check_writable`'s probe file (one left by a killed job is a run's too)."""


def claim_job_dir(conf: RunConfig, spec: DrafterSpec | None, delete: bool) -> None:
    """:func:`claim_output_dir` for a job of the drafter ``spec`` declares (None: a state cache build). A resumed
    training run continues its folder unclaimed; a state cache build claims it even with ``resume`` (it resumes by
    itself) and keeps the cache it writes; a training run keeps the cache it reads (``data.target_states=disk``)."""
    if spec is not None and conf.resume:
        return
    reads_cache = spec is None or conf.data.target_states == TargetStates.disk
    claim_output_dir(Path(conf.output_dir), conf.overwrite, delete, keep=state_cache_dir(conf) if reads_cache else None,
                     resumable=spec is not None, saved=spec.saved_entries if spec is not None else ())


def claim_output_dir(out: Path, overwrite: bool, delete: bool, keep: Path | None = None,
                     resumable: bool = True, saved: tuple[str, ...] = ()) -> None:
    """Every job's claim on its output_dir. A folder holding a training run (:func:`run_marks`) is refused:
    ``FileExistsError`` naming the choices (``resume=true`` for a ``resumable`` job, ``overwrite=true``, another
    output_dir), before any work. With ``overwrite`` and ``delete`` (the main process, once) the old run's files
    (:data:`RUN_ENTRIES`, and ``saved``: what the job's drafter saves there) are deleted but the state cache at
    ``keep`` (the one this job reads or writes), so nothing of the old run is left beside this one's. A folder
    holding a run and files no run writes (output_dir=. or $HOME by mistake) is refused with ``FileExistsError``
    naming them, nothing in it deleted. A folder holding no run (a state cache build, a run that failed before
    training) is taken as it is."""
    marks = run_marks(out)
    if not marks:
        strays = foreign_entries(out, RUN_ENTRIES + tuple(saved), keep, runless=True)
        if strays:
            raise FileExistsError(f"output_dir={out} holds no run but files no run writes ({', '.join(strays)}), which "
                                  f"this run's files would be written beside or over: choose an empty or new "
                                  f"output_dir, or move them away")
        return
    if not overwrite:
        choices = "resume=true continues it, " if resumable else ""
        raise FileExistsError(f"output_dir={out} holds a training run ({', '.join(marks)}): {choices}overwrite=true "
                              f"starts afresh there, or choose another output_dir")
    old = _old_run(out, keep, RUN_ENTRIES + tuple(saved))  # refused before anything is deleted
    for p in old if delete else ():
        p.unlink() if p.is_symlink() or not p.is_dir() else shutil.rmtree(p)  # a link goes, never its target


def run_marks(out: Path) -> list[str]:
    """What shows that ``out`` holds a training run: its ``checkpoints/``, its ledger (``progress.json``) or
    ``report.json``. A ledger saying nothing finished beside no checkpoint is a run that failed before training
    produced anything (bad data, no row left, a failed preflight): no run, so the corrected rerun needs no
    ``overwrite``. A folder of an older version, without a ledger, is read by its ``report.json``
    (:func:`~draftheads.run_folder.finished_steps`)."""
    marks = [p.name for p in (out / CHECKPOINTS, out / LEDGER, out / REPORT) if p.exists()]
    return [] if marks and CHECKPOINTS not in marks and _nothing_finished(out) else marks


def _nothing_finished(out: Path) -> bool:
    """Whether the run in ``out`` finished nothing (its ledger as the run writes it at its start); an unreadable
    ledger or report is not."""
    try:
        return finished_steps(out) == []
    except (OSError, ValueError):  # OSError: also one the main process deletes meanwhile (overwrite=true)
        return False


def foreign_entries(out: Path, entries: tuple[str, ...], keep: Path | None = None,
                    runless: bool = False) -> list[str]:
    """The names in ``out`` (sorted) that no run writes: not in ``entries``, not a probe, the lock or the entry
    holding ``keep`` (the state cache the job reads or writes); in a folder holding no run (``runless``), also a
    ``config.yaml`` that is not a draftheads run's (a mapping with ``drafter`` and ``output_dir``: a user's own
    config of that name). An ``out`` that does not exist holds none."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir()
                  if (p.name not in entries and not p.name.startswith(PROBE) and p.name != LOCK
                      and not (keep is not None and _holds(p, keep)))
                  or (runless and p.name == CONFIG and not _run_config(p)))


def _run_config(path: Path) -> bool:
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and {"drafter", "output_dir"} <= set(config)


def lock_output_dir(out: Path):
    """Claim ``out`` for this process alone, for as long as the returned handle is open (:func:`release`; the
    operating system releases it when the process ends, killed or not): an exclusive ``flock`` on ``out/.lock``,
    which names the holder. A second job on the same folder is refused at once with ``RuntimeError`` naming the
    holder, before it reads or writes anything there. Where ``fcntl`` is missing (Windows), nothing is locked."""
    try:
        import fcntl
    except ImportError:
        return None
    out.mkdir(parents=True, exist_ok=True)
    handle = open(out / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RuntimeError(f"output_dir={out} is in use by another job ({holder}): wait for it to end, or choose "
                           f"another output_dir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since "
                 f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}")
    handle.flush()
    return handle


@contextmanager
def holding(out: Path):
    """:func:`lock_output_dir` on an existing run folder for the length of a ``with`` block (the tools that write
    into a finished run: ``train/evaluate.py``, ``train/export.py``), released at its end; nothing is locked (or
    made) for a folder that does not exist (the tool then names what is missing)."""
    lock = lock_output_dir(Path(out)) if Path(out).is_dir() else None
    try:
        yield
    finally:
        release(lock)


def release(lock) -> None:
    """Give up :func:`lock_output_dir`'s claim (the file stays: deleting it could let two jobs lock two files)."""
    if lock is not None:
        lock.close()


def _old_run(out: Path, keep: Path | None, entries: tuple[str, ...]) -> list[Path]:
    """The entries of ``out`` an overwriting run deletes: all but the one holding ``keep`` and the lock.
    Raises ``FileExistsError`` naming those not in ``entries`` (no run writes them), before anything is deleted."""
    old = [p for p in out.iterdir() if not (keep is not None and _holds(p, keep)) and p.name != LOCK]
    foreign = foreign_entries(out, entries, keep)
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
