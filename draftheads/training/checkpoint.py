"""Checkpoints for resuming: accelerate's ``save_state`` (trainable weights, optimizer, scheduler, RNG
states, the registered train state) written atomically, with a ``meta.json`` that says what they are.

Layout: ``<output_dir>/checkpoints/<stage>-step<NNNNNN>/``; a folder without ``meta.json`` is incomplete
and ignored. The previous checkpoint stays until the new one is complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from accelerate import Accelerator


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints, oldest first, with their meta (ordered by the ``order`` field)."""
    root = checkpoint_root(output_dir)
    found = []
    for d in root.glob("*") if root.exists() else []:
        meta = d / "meta.json"
        if d.is_dir() and not d.name.endswith(".tmp") and meta.exists():
            found.append((d, json.loads(meta.read_text())))
    return sorted(found, key=lambda x: x[1]["order"])


def latest_checkpoint(output_dir: str | Path, identity: dict, stages: tuple[str, ...]) -> tuple[Path, dict] | None:
    """The newest complete checkpoint, or None.

    Raises ``ValueError`` naming the differing fields when it was made for another target model, or naming
    its stage when that is not one of ``stages`` (another job's run directory).
    """
    found = complete_checkpoints(output_dir)
    if not found:
        return None
    path, meta = found[-1]
    if meta["stage"] not in stages:
        raise ValueError(f"checkpoint {path} is of stage {meta['stage']!r}, not one of this job's {list(stages)}: "
                         f"another job's run directory?")
    diff = {k: (meta["model"].get(k), v) for k, v in identity.items() if meta["model"].get(k) != v}
    if diff:
        raise ValueError(f"checkpoint {path} was made for another target model; differing fields "
                         f"(checkpoint, this run): {diff}")
    return path, meta


def save_checkpoint(accelerator: Accelerator, output_dir: str | Path, meta: dict, keep_last: int) -> Path:
    """Write a checkpoint on every rank (``save_state`` is collective), then make it visible atomically.

    ``meta`` must hold ``stage`` and ``step``; ``order`` (a global counter) is added. Older checkpoints
    beyond ``keep_last`` are deleted once the new one is complete.
    Raises ``OSError`` naming the checkpoint and the previous complete one (left intact) when writing fails
    (disk full, unwritable directory); the partial folder is removed.
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
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = f"the previous checkpoint {previous[-1][0]} is intact" if previous else "no earlier checkpoint"
        raise OSError(e.errno, f"cannot write checkpoint {final} ({e.strerror or e}); {kept}; free space or "
                               f"fix output_dir, then resume=true") from e
    if accelerator.is_main_process:
        for old, _ in complete_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final
