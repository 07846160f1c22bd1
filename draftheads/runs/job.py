"""An open run on this process (:class:`Job`): what :func:`~draftheads.runs.life.open_job` hands every part of
the run's life."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator

from draftheads.training.config import RunConfig


@dataclass
class Job:
    """An open run on this process."""
    conf: RunConfig
    accelerator: Accelerator
    out: Path
    eval_sets: dict[str, list]
    target: object
    tokenizer: object
    target_path: str
    identity: dict
    resume: tuple[Path, dict] | None
    """The checkpoint to continue from (``resume=true``) and its meta."""
    precision: str
    """What ``trainer.mixed_precision`` and ``model.dtype`` were settled to on this machine, and why."""
    lock: object | None
    """The main process's hold on the output_dir (:func:`~draftheads.runs.output_dir.lock_output_dir`)."""
    finished: list[str]
    """The steps the run's ledger listed as finished when it opened (a resume; empty otherwise)."""
    done: bool
    """A resume with nothing left to do: every step its config asks for is finished."""
