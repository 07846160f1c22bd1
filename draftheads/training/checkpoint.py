"""Checkpoints for resuming: accelerate's ``save_state`` (trainable weights, optimizer, scheduler, RNG
states, the registered train state) written atomically, with a ``meta.json`` that says what they are: the
stage and step, the target's identity, the batch plan, and a sha256 of every file (checked before a resume).

Layout: ``<output_dir>/checkpoints/<stage>-step<NNNNNN>/``; a folder without ``meta.json`` is incomplete
and ignored. The previous checkpoint stays until the new one is complete; ``trainer.keep_last`` (2 by
default) keeps one to fall back on when the newest is found damaged.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

from accelerate import Accelerator

from draftheads.data.state_cache import file_sha256
from draftheads.run_folder import CHECKPOINTS

CHECKSUMS = "files_sha256"
"""The ``meta.json`` key holding each file's sha256 by its path in the checkpoint (absent in checkpoints of
versions before it: those are resumed unchecked)."""


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS


def complete_checkpoints(output_dir: str | Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints, oldest first, with their meta (ordered by the ``order`` field)."""
    return _scan(output_dir)[0]


def _scan(output_dir: str | Path) -> tuple[list[tuple[Path, dict]], list[Path]]:
    """Complete checkpoints (oldest first, with their meta), and folders whose ``meta.json`` cannot be read
    (damaged since it was written: written last into a temporary folder, it is never left half-written)."""
    root = checkpoint_root(output_dir)
    found, unreadable = [], []
    for d in root.glob("*") if root.exists() else []:
        meta = d / "meta.json"
        if not (d.is_dir() and not d.name.endswith(".tmp") and meta.exists()):
            continue
        try:
            found.append((d, json.loads(meta.read_text())))
        except ValueError:  # not JSON, or not text
            unreadable.append(d)
    return sorted(found, key=lambda x: x[1]["order"]), unreadable


def latest_checkpoint(output_dir: str | Path, identity: dict, stages: tuple[str, ...]) -> tuple[Path, dict] | None:
    """The newest complete checkpoint whose files are intact, or None when there is no checkpoint.

    A damaged one (a file missing, or its sha256 not the one in ``meta.json``: truncated or changed since) is
    passed over with a warning naming the file, for the one before it.
    Raises ``ValueError`` naming each checkpoint and its damaged file when none is intact; naming the
    differing fields when the one found was made for another target model, or naming its stage when that is
    not one of ``stages`` (another job's run directory).
    """
    found, unreadable = _scan(output_dir)
    damaged = [(d, "meta.json is unreadable") for d in unreadable]
    for path, meta in reversed(found):
        what = _damaged_file(path, meta)
        if what is not None:
            damaged.append((path, what))
            continue
        for d, why in damaged:
            warnings.warn(f"checkpoint {d} is damaged: {why}; resuming from {path}", stacklevel=2)
        _check_origin(path, meta, identity, stages)
        return path, meta
    if damaged:
        raise ValueError(f"no intact checkpoint to resume from in {checkpoint_root(output_dir)}: "
                         f"{'; '.join(f'{d}: {why}' for d, why in damaged)}. Start afresh with overwrite=true (or "
                         f"restore the files)")
    return None


def _damaged_file(path: Path, meta: dict) -> str | None:
    """What is wrong with checkpoint ``path``: its first file that is missing or whose sha256 differs from the
    one ``meta`` records, or None (intact, or recorded without checksums: nothing to check)."""
    for name, digest in meta.get(CHECKSUMS, {}).items():
        if not (path / name).is_file():
            return f"{name} is missing"
        if file_sha256(path / name) != digest:
            return f"{name} differs from its sha256 in meta.json (truncated or corrupted)"
    return None


def _check_origin(path: Path, meta: dict, identity: dict, stages: tuple[str, ...]) -> None:
    """``ValueError`` when checkpoint ``path`` is of a stage not in ``stages`` or made for another target."""
    if meta["stage"] not in stages:
        raise ValueError(f"checkpoint {path} is of stage {meta['stage']!r}, not one of this job's {list(stages)}: "
                         f"another job's run directory?")
    diff = {k: (meta["model"].get(k), v) for k, v in identity.items() if meta["model"].get(k) != v}
    if diff:
        raise ValueError(f"checkpoint {path} was made for another target model; differing fields "
                         f"(checkpoint, this run): {diff}")


def check_plan(checkpoint: str | Path, plan: dict) -> None:
    """Refuse to resume from ``checkpoint`` on another batch plan than the one it was written on: the
    micro-batch counter it holds would then point at other rows, replaying some and skipping others.

    Raises ``ValueError`` naming each field of ``plan`` that differs (the checkpoint's value, this run's).
    Fields the checkpoint does not record (written by an earlier version) are not compared.
    """
    saved = json.loads((Path(checkpoint) / "meta.json").read_text()).get("plan", {})
    diff = {k: (saved[k], v) for k, v in plan.items() if k in saved and saved[k] != v}
    if diff:
        raise ValueError(f"checkpoint {checkpoint} was written on another batch plan; resuming would replay or skip "
                         f"rows. Differing (checkpoint, this run): {diff}. Resume with the checkpoint's settings "
                         f"and data, or start afresh with overwrite=true or another output_dir")


def file_checksums(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by its path relative to it."""
    return {str(p.relative_to(folder)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, meta: dict, keep_last: int) -> Path:
    """Write a checkpoint on every rank (``save_state`` is collective), then make it visible atomically.

    ``meta`` must hold ``stage`` and ``step``; ``order`` (a global counter) is added. Older checkpoints
    beyond ``keep_last`` are deleted once the new one is complete.
    Every rank's files are summed (sha256, into ``meta.json``) on the main process once all are written.
    Raises ``OSError`` naming the checkpoint and the previous complete one (left intact) when writing fails
    in any way (a full disk is a ``RuntimeError`` from torch.save, an ``OSError`` from other writes; the
    original is chained); the partial folder is removed.
    """
    root = checkpoint_root(output_dir)
    previous = complete_checkpoints(output_dir)
    meta = {**meta, "order": (previous[-1][1]["order"] + 1) if previous else 0}
    final = root / f"{meta['stage']}-step{meta['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()  # every rank's files are in tmp before they are summed
        if accelerator.is_main_process:
            record = {**meta, CHECKSUMS: file_checksums(tmp)}
            (tmp / "meta.json").write_text(json.dumps(record, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    except Exception as e:  # whatever a library raises for a failed write, the run must say which and clean up
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(e, final, previous) from e
    if accelerator.is_main_process:
        for old, _ in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _write_error(e: Exception, final: Path, previous: list[tuple[Path, dict]]) -> OSError:
    """The error for checkpoint ``final`` not written because of ``e``, naming the previous complete one (the
    one a resume takes) and the fix; an ``OSError``'s errno is kept."""
    kept = f"the previous checkpoint {previous[-1][0]} is intact" if previous else "no earlier checkpoint"
    reason = e.strerror if isinstance(e, OSError) and e.strerror else e
    message = f"cannot write checkpoint {final} ({reason}); {kept}; free space or fix output_dir, then resume=true"
    return OSError(e.errno, message) if isinstance(e, OSError) and e.errno else OSError(message)
