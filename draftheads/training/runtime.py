"""Rank-aware setup in one place: the accelerator, its tracker, seeding and printing.

Scripts never read RANK or WORLD_SIZE themselves; ``accelerate launch`` sets them and accelerate reads them.
"""

from __future__ import annotations

import atexit
import gc
import os
import secrets
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed
from omegaconf import DictConfig, OmegaConf

from draftheads.models.precision import auto_dtype, choose_precision, default_device, native
from draftheads.models.target import Dtype
from draftheads.training.config import MixedPrecision, Optimizer
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
        threads, why = cpu_threads()
        torch.set_num_threads(threads)
        print0(accelerator, f"threads: {threads} per process ({why})")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise RuntimeError(f"{launched} processes were launched but accelerate set up {accelerator.num_processes}: "
                           f"check the accelerate config (distributed type {accelerator.distributed_type})")
    check_engine(accelerator)
    check_optimizer(cfg.trainer.optimizer, sharded(accelerator))
    keep_models_whole(accelerator)
    set_seed(cfg.trainer.seed)
    # At exit the interpreter would collect torch's, transformers' and DeepSpeed's module graphs object by object:
    # about 1 s a process on one core (2.3 s of an 18 s two-rank smoke launch sharing it). Freezing what exists by
    # then leaves it to the OS; every file the job writes is closed before (atexit runs after the job returns).
    atexit.register(gc.freeze)
    return accelerator


def settle_precision(cfg: DictConfig, conf) -> str:
    """Settle ``trainer.mixed_precision`` and ``model.dtype`` on this machine
    (:func:`~draftheads.models.precision.choose_precision`, :func:`~draftheads.models.precision.auto_dtype`):
    ``auto`` becomes the value chosen, in both the composed ``cfg`` (so ``config.yaml`` records what was in effect)
    and the typed ``conf``. ``auto`` with a bfloat16 target (``model.dtype=bfloat16``) is bf16 autocast wherever
    bf16 is emulated too: the drafter meets the target's bf16 states, which float32 layers would refuse. Returns
    the line saying what was chosen and why (a warning where an explicit bf16 or fp16 will be emulated)."""
    precision = choose_precision(str(conf.trainer.mixed_precision))
    line = precision.line
    if conf.model.dtype == Dtype.auto:
        dtype, why = auto_dtype()
        conf.model.dtype = cfg.model.dtype = Dtype(str(dtype).removeprefix("torch."))
        line += f"; target weights: {conf.model.dtype} (model.dtype=auto: {why})"
    value = precision.value
    if precision.requested == "auto" and value == "no" and conf.model.dtype == Dtype.bfloat16:
        value = "bf16"
        line += ("; bf16 autocast after all, emulated: the target's weights are bfloat16 (model.dtype), so the "
                 "drafter meets its states in bf16")
    conf.trainer.mixed_precision = cfg.trainer.mixed_precision = MixedPrecision(value)
    return line


def settle_optimizer(cfg: DictConfig, conf, sharded: bool, recorded: str | None = None) -> str | None:
    """Settle ``trainer.optimizer=auto`` (:class:`~draftheads.training.config.Optimizer`): the ``recorded`` one of
    a resumed run (its ``config.yaml``), else Muon where bf16 is native on this device
    (:func:`~draftheads.models.precision.native`) and the engine is not ``sharded`` (FSDP, DeepSpeed), AdamW
    otherwise; written into ``cfg`` (so ``config.yaml`` records it) and ``conf``. Returns the line saying what was
    chosen and why, None for an explicit optimizer (left as it is)."""
    if conf.trainer.optimizer != Optimizer.auto:
        return None
    if recorded is not None and recorded != Optimizer.auto:
        chosen, why = Optimizer(recorded), "the run's own, as it started"
    else:
        bf16 = native(torch.bfloat16, default_device())
        muon = bf16.native and not sharded
        chosen = Optimizer.muon if muon else Optimizer.adamw
        why = ("FSDP or DeepSpeed shard the matrices Muon orthogonalises" if sharded else
               f"{bf16.why}: Muon's bf16 orthogonalisation runs {'natively' if bf16.native else 'emulated'}")
    conf.trainer.optimizer = cfg.trainer.optimizer = chosen
    return f"optimizer: {chosen.value} (trainer.optimizer=auto: {why})"


def cpu_threads() -> tuple[int, str]:
    """Intra-op threads for this process, and where the number comes from. The ecosystem's knobs win:
    ``OMP_NUM_THREADS`` as the user set it, or ``accelerate launch --num_cpu_threads_per_process N``. Only when
    neither was given: the cores of this process's affinity shared between the ranks on this machine.

    ``accelerate launch`` and ``torchrun`` always set ``OMP_NUM_THREADS`` in the processes they start (to 1 when
    nobody asked), so under a launcher the request is read from the launcher itself: its command line and the
    environment it was started with (``/proc/<parent>/``, Linux; elsewhere only an explicit value outside a
    launcher counts)."""
    asked = _threads_asked()
    if asked is not None:
        return asked
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local), f"{cores} cores of this process's affinity shared by {local} local rank(s); " \
                                   f"OMP_NUM_THREADS or --num_cpu_threads_per_process sets it"


def _threads_asked() -> tuple[int, str] | None:
    launched = any(k in os.environ for k in ("ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID"))
    if not launched:
        value = os.environ.get("OMP_NUM_THREADS")
        return (int(value), "OMP_NUM_THREADS") if value else None
    parent = Path(f"/proc/{os.getppid()}")
    try:
        argv = (parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        env = dict(kv.split("=", 1) for kv in (parent / "environ").read_bytes().decode(errors="replace").split("\0")
                   if "=" in kv)
    except OSError:
        return None
    flag = "--num_cpu_threads_per_process"
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return int(argv[i + 1]), f"accelerate launch {flag}"
        if arg.startswith(flag + "="):
            return int(arg.split("=", 1)[1]), f"accelerate launch {flag}"
    if env.get("OMP_NUM_THREADS"):
        return int(env["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    return None


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
