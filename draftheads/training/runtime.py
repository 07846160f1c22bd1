"""Rank-aware setup in one place: the accelerator, its tracker, seeding and printing.

Scripts never read RANK or WORLD_SIZE themselves; ``accelerate launch`` sets them and accelerate reads them.
"""

from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed
from omegaconf import DictConfig, OmegaConf

from draftheads.training.optimizer import check_optimizer
from draftheads.training.sharding import check_engine, keep_models_whole, sharded

TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard", "none": None}


def make_accelerator(cfg: DictConfig) -> Accelerator:
    """An Accelerator for the configured tracker, seeded; the tracker is started by :func:`start_tracker`, once
    the run's folder is claimed (its files are the run's).

    Raises:
        RuntimeError: accelerate set up other processes or another engine than the launch asked for
            (:func:`~draftheads.training.sharding.check_engine`).
        ValueError: FSDP version 1 (the same), or a ``trainer.optimizer`` that cannot train under this engine
            (:func:`~draftheads.training.optimizer.check_optimizer`): before the target loads.
    """
    log_with = TRACKERS[str(cfg.tracker.name)]
    # Rank 0 works alone while the others wait at a barrier (regenerating an uncached dataset, the final
    # validation, export and evaluation): the collective timeout must outlast that, not torch's default.
    timeout = InitProcessGroupKwargs(timeout=timedelta(minutes=cfg.trainer.collective_timeout_min))
    # Without any accelerator, `accelerate launch --multi_gpu` would leave every process believing it is
    # alone (DistributedType.NO); cpu=True makes it real DDP over gloo instead.
    accelerator = Accelerator(cpu=torch.accelerator.current_accelerator() is None, log_with=log_with,
                              kwargs_handlers=[timeout], mixed_precision=str(cfg.trainer.mixed_precision),
                              gradient_accumulation_steps=cfg.trainer.grad_accum,
                              project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                                                  logging_dir=str(Path(cfg.output_dir) / "logs")))
    if accelerator.device.type == "cpu":
        # `accelerate launch` sets OMP_NUM_THREADS=1 unless given --cpu; share the cores between local ranks.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local))
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise RuntimeError(f"{launched} processes were launched but accelerate set up {accelerator.num_processes}: "
                           f"check the accelerate config (distributed type {accelerator.distributed_type})")
    check_engine(accelerator)
    check_optimizer(cfg.trainer.optimizer, sharded(accelerator))
    keep_models_whole(accelerator)
    set_seed(cfg.trainer.seed)
    return accelerator


def start_tracker(accelerator: Accelerator, cfg: DictConfig, run_name: str) -> None:
    """Start the configured tracker on the main process (nothing for ``tracker.name=none``).

    W&B runs offline unless an API key is set (``WANDB_API_KEY`` or ``wandb login``), so a run never
    blocks on a network. A resumed run reuses its W&B run id (stored in ``output_dir/wandb_run_id``).
    """
    log_with = TRACKERS[str(cfg.tracker.name)]
    if log_with is None:
        return
    init_kwargs = {}
    if log_with == "wandb" and accelerator.is_main_process:
        if not os.environ.get("WANDB_API_KEY") and not _wandb_logged_in():
            os.environ.setdefault("WANDB_MODE", "offline")
        init_kwargs["wandb"] = {"name": run_name, "dir": cfg.output_dir, "id": _run_id(cfg.output_dir),
                                "resume": "allow"}
    config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    if log_with == "tensorboard":  # its hparams take flat scalars only
        config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _flatten(config).items()}
    accelerator.init_trackers(cfg.tracker.project, config=config, init_kwargs=init_kwargs)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out |= _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def _wandb_logged_in() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text()


def _run_id(output_dir: str) -> str:
    """The W&B run id of this output directory, created on first use (main process only calls this)."""
    path = Path(output_dir) / "wandb_run_id"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(4))  # W&B accepts any id of letters and digits
    return path.read_text().strip()


def distributed(accelerator: Accelerator) -> dict:
    """How the run was distributed (recorded in the report)."""
    return {"type": accelerator.distributed_type.value, "num_processes": accelerator.num_processes,
            "device": accelerator.device.type}


def print0(accelerator: Accelerator, *args) -> None:
    """Print on the main process only."""
    if accelerator.is_main_process:
        print(*args, flush=True)
