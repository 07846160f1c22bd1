"""The training spine: one loop for every drafter and stage.

A :class:`Strategy` says what differs (the trainable module and its parameter groups, forward + loss,
which batch fields it needs); the spine does the rest the same way for all: per-rank data, the optimizer with
warmup + cosine, gradient accumulation and clipping, metrics, checkpoints and exact resume.
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import FlopCounterMode, flop_registry
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from draftheads.data.batching import BatchPlan, rows_sha256
from draftheads.training.checkpoint import check_plan, save_checkpoint
from draftheads.training.optimizer import make_optimizer
from draftheads.training.sharding import configure_engine, full_state_dict, plain_twin, sharded


# trainer.count_flops counts matrix products only: torch's attention formulas reject grouped-query shapes
# (DFlash's block attention), and attention is a few percent of the FLOPs at these lengths.
_NO_ATTENTION_FLOPS = {op: (lambda *args, **kwargs: 0) for op in flop_registry if "attention" in str(op)}


class Strategy(Protocol):
    """What one drafter/stage contributes to the spine."""
    name: str
    """Stage name, used for checkpoints and metric namespaces (``stage1``)."""
    module: nn.Module
    """The module whose registered parameters train; ``accelerator.prepare`` wraps it."""
    required_fields: tuple[str, ...]
    """Batch keys the strategy reads (checked on the first batch)."""
    unpacks: bool
    """Whether it reads a packed batch's rows one per line (:func:`~draftheads.data.batching.unpack`), so its
    packed batches keep rows times the longest row within the token budget."""

    def param_groups(self, lr: float) -> list[dict]:
        """Parameter groups (``params`` and ``lr`` each; :func:`~draftheads.training.optimizer.make_optimizer`)."""

    def forward_loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar loss and detached metric tensors for one micro-batch (``module`` is the wrapped one)."""

    def adopt(self, module: nn.Module) -> None:
        """Take ``module``, a plain copy of ``self.module`` holding the trained weights, in its place (after
        training under FSDP or DeepSpeed, whose prepared module is sharded)."""


class ModuleStrategy:
    """A strategy whose module computes ``(loss, metrics)`` itself: ``forward_loss`` calls it, ``adopt`` takes
    the plain copy. Subclasses set ``name``, ``module``, ``required_fields`` and ``param_groups`` (and ``unpacks``
    when their module unpacks)."""
    unpacks = False

    def forward_loss(self, module: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return module(batch)

    def adopt(self, module: nn.Module) -> None:
        self.module = module


@dataclass
class TrainState:
    """Saved with every checkpoint: micro-batches consumed, optimizer steps taken, the LR scheduler.
    ``history`` holds this process's logged metrics of the stage (saved too: a resumed stage keeps its curve)."""
    micro: int = 0
    step: int = 0
    scheduler: object = None
    skipped_nonfinite: int = 0
    """Micro-batches skipped for a non-finite loss (``trainer.nonfinite=skip``)."""
    history: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return {"micro": self.micro, "step": self.step, "scheduler": self.scheduler.state_dict(),
                "skipped_nonfinite": self.skipped_nonfinite, "history": self.history}

    def load_state_dict(self, state: dict) -> None:
        self.micro, self.step = state["micro"], state["step"]
        self.skipped_nonfinite = state.get("skipped_nonfinite", 0)
        self.history = list(state.get("history", []))
        self.scheduler.load_state_dict(state["scheduler"])


_STATES: "weakref.WeakKeyDictionary[Accelerator, TrainState]" = weakref.WeakKeyDictionary()


def _train_state(accelerator: Accelerator, scheduler) -> TrainState:
    """The accelerator's one registered TrainState, reset for a new stage (accelerate cannot unregister)."""
    if accelerator not in _STATES:
        _STATES[accelerator] = TrainState()
        accelerator.register_for_checkpointing(_STATES[accelerator])
    state = _STATES[accelerator]
    state.micro, state.step, state.scheduler, state.skipped_nonfinite, state.history = 0, 0, scheduler, 0, []
    return state


def fit(accelerator: Accelerator, strategy: Strategy, rows: list[dict], trainer, stage, output_dir: str,
        pad_token_id: int, meta: dict, resume_from: str | None = None) -> TrainState:
    """Train ``strategy`` on ``rows`` (all ranks pass the same list; each takes its own share).

    Args:
        trainer: ``TrainerConfig``; stage: ``StageConfig`` (``epochs``, ``max_steps``).
        meta: recorded in every checkpoint (target identity...), with the batch plan (:func:`batch_plan`).
        resume_from: a checkpoint of this stage to continue from (``accelerator.load_state``).
    Returns:
        the final :class:`TrainState`.
    Raises:
        ValueError: ``resume_from`` was written on another batch plan (naming the fields), before any work.
    """
    meta = {**meta, "plan": batch_plan(accelerator, trainer, rows)}
    if resume_from:
        check_plan(resume_from, meta["plan"])
    plan = BatchPlan(rows, accelerator.process_index, accelerator.num_processes, trainer.batch_size,
                     trainer.tokens_per_batch, trainer.seed, strategy.unpacks)
    total_steps = plan.total(stage.epochs) // trainer.grad_accum
    if stage.max_steps is not None:
        total_steps = min(total_steps, stage.max_steps)
    total_micro = total_steps * trainer.grad_accum
    if total_steps < 1:
        raise ValueError(f"{strategy.name}: {len(plan.shards[0])} rows per process in {plan.count(0)} micro-batches "
                         f"per epoch and grad_accum {trainer.grad_accum} give no optimizer step; add data or epochs")
    if trainer.nonfinite == "skip" and trainer.grad_accum != 1:
        raise ValueError(f"trainer.nonfinite=skip needs trainer.grad_accum 1 (it is {trainer.grad_accum}) "
                         f"(skipping part of an accumulation window would desynchronise the ranks' gradients)")

    configure_engine(accelerator, trainer)
    twin = plain_twin(strategy.module) if sharded(accelerator) else None
    optimizer = make_optimizer(trainer, strategy.module, strategy.param_groups(trainer.lr), sharded(accelerator))
    scheduler = get_cosine_schedule_with_warmup(optimizer, int(trainer.warmup_ratio * total_steps), total_steps)
    # A prepared scheduler is stepped num_processes times per step by accelerate; ours steps once per
    # optimizer step, unprepared, and is checkpointed inside the TrainState.
    module, optimizer = accelerator.prepare(strategy.module, optimizer)
    state = _train_state(accelerator, scheduler)
    if resume_from:
        accelerator.load_state(resume_from)
        accelerator.print(f"[{strategy.name}] resumed from {resume_from} at step {state.step}")

    window: dict[str, list[torch.Tensor]] = defaultdict(list)
    tokens, attended, t0 = 0, 0, time.perf_counter()
    flops_per_token = None  # trainer.count_flops: model FLOPs per attended token, from the first micro-batch
    bar = tqdm(total=total_steps, initial=state.step, desc=f"{strategy.name} training", unit="step",
               disable=not accelerator.is_main_process)
    saved_step = state.step
    module.train()
    while state.micro < total_micro:
        epoch, index = plan.locate(state.micro)
        batch_rows = plan.epoch(epoch)[index]
        batch = plan.collate(batch_rows, pad_token_id)
        tokens += int(batch["loss_mask"].sum())  # on the CPU copies: no device sync
        attended += sum(len(r["input_ids"]) for r in batch_rows)
        batch = _to_device(batch, accelerator.device)
        _check_fields(strategy, batch)
        counter = (FlopCounterMode(display=False, custom_mapping=_NO_ATTENTION_FLOPS)
                   if trainer.count_flops and flops_per_token is None else nullcontext())
        with counter, accelerator.accumulate(module), _autocast(accelerator.device, trainer.mixed_precision):
            loss, metrics = strategy.forward_loss(module, batch)
            if not _finite_everywhere(accelerator, loss):
                where = (f"[{strategy.name}] non-finite loss at optimizer step {state.step + 1} (epoch {epoch}, "
                         f"batch {index}, micro-batch {state.micro}); this rank's loss {loss.item()}, rows "
                         f"{[(r['source'], r['row']) for r in batch_rows]}")
                if trainer.nonfinite == "stop":
                    raise FloatingPointError(where + "; trainer.nonfinite=skip skips such batches")
                accelerator.print(where + ": skipped")
                state.micro += 1
                state.skipped_nonfinite += 1
                optimizer.zero_grad()
                continue
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                metrics["grad_norm"] = _clip_grad_norm(accelerator, module, trainer.max_grad_norm)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        if isinstance(counter, FlopCounterMode):
            flops_per_token = counter.get_total_flops() / sum(len(r["input_ids"]) for r in batch_rows)
        state.micro += 1
        window["loss"].append(loss.detach())
        for k, v in metrics.items():
            window[k].append(v.detach().float())
        if not accelerator.sync_gradients:
            continue
        state.step += 1
        bar.update(1)
        if state.step % trainer.log_every == 0 or state.micro == total_micro:
            logs = _reduce(accelerator, window, strategy.name)
            elapsed = time.perf_counter() - t0
            logs["perf/trainable_tokens_per_s"] = tokens * accelerator.num_processes / elapsed
            logs["perf/tokens_per_s"] = attended * accelerator.num_processes / elapsed
            if flops_per_token is not None:
                logs["perf/tflops_per_s"] = flops_per_token * attended / elapsed / 1e12
            logs[f"{strategy.name}/skipped_nonfinite"] = state.skipped_nonfinite
            logs.update({f"{strategy.name}/lr_group{i}": g["lr"] for i, g in enumerate(optimizer.param_groups)})
            accelerator.log(logs, step=_global_step(meta, state.step))
            state.history.append({"step": state.step, **logs})
            bar.set_postfix(loss=f"{logs[f'{strategy.name}/loss']:.3f}")
            window.clear()
            tokens, attended, t0 = 0, 0, time.perf_counter()
        if state.step % trainer.checkpoint_every == 0 or state.micro == total_micro:
            save_checkpoint(accelerator, output_dir, {**meta, "stage": strategy.name, "step": state.step,
                                                      "done": state.micro == total_micro}, trainer.keep_last)
            saved_step = state.step
    if state.step != saved_step:  # the stage ended on a skipped batch: its last steps need their checkpoint
        save_checkpoint(accelerator, output_dir, {**meta, "stage": strategy.name, "step": state.step, "done": True},
                        trainer.keep_last)
    bar.close()
    if state.step == 0:
        raise FloatingPointError(f"[{strategy.name}] all {state.micro} micro-batches had a non-finite loss and were "
                                 f"skipped: nothing was trained (lower trainer.lr, or check the data)")
    if twin is not None:  # rank 0's evaluation and the next stage need plain modules: gather the shards
        twin.load_state_dict(full_state_dict(accelerator, module))
        strategy.adopt(twin)
    accelerator.free_memory()  # the next stage prepares its own module and optimizer
    return state


def batch_plan(accelerator: Accelerator, trainer, rows: list[dict]) -> dict:
    """What decides which rows each micro-batch holds, so a resumed run must keep it: the settings of
    :func:`plan_settings` and a sha256 of the rows' token ids in order."""
    return {**plan_settings(accelerator, trainer), "data_sha256": rows_sha256(rows)}


def plan_settings(accelerator: Accelerator, trainer) -> dict:
    """The batch plan but its rows, known when a job opens (a resume is checked against them before any row is
    made): the batch sizes, the accumulation, the seed that shuffles, the number of processes sharing the rows.
    ``trainer.batch_size`` only for batches of rows (packed batches do not read it)."""
    rows_per_batch = {"trainer.batch_size": trainer.batch_size} if trainer.tokens_per_batch is None else {}
    return {**rows_per_batch, "trainer.tokens_per_batch": trainer.tokens_per_batch,
            "trainer.grad_accum": trainer.grad_accum, "trainer.seed": trainer.seed,
            "num_processes": accelerator.num_processes}


def _autocast(device: torch.device, mixed_precision: str):
    """``trainer.mixed_precision`` as autocast, for every engine: accelerate wraps a DDP module's forward in
    autocast but neither an FSDP2 one (which computes with bf16 weight copies, while the frozen target keeps its
    own dtype) nor DeepSpeed's (whose bf16 mode casts the trainable module, likewise)."""
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    return torch.autocast(device.type, dtypes.get(mixed_precision), enabled=mixed_precision != "no")


def _clip_grad_norm(accelerator: Accelerator, module: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the gradients; their total norm before clipping as a plain float32 tensor on every engine: DDP
    returns a tensor, FSDP2 a DTensor, DeepSpeed (which clips inside its own step) a float or None (NaN)."""
    norm = accelerator.clip_grad_norm_(module.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return torch.as_tensor(float("nan") if norm is None else norm, dtype=torch.float32, device=accelerator.device)


def _finite_everywhere(accelerator: Accelerator, loss: torch.Tensor) -> bool:
    """Whether the loss is finite on every rank (one scalar gather: all ranks then skip or stop together)."""
    finite = torch.isfinite(loss.detach()).float().reshape(1)
    if accelerator.num_processes > 1:
        finite = accelerator.gather(finite)
    return bool(finite.min() > 0)


def _global_step(meta: dict, step: int) -> int:
    """Tracker step: stages follow each other on one axis."""
    return meta.get("step_offset", 0) + step


def _reduce(accelerator: Accelerator, window: dict, prefix: str) -> dict[str, float]:
    """Mean over the window, then over ranks; ``.item()`` happens here only."""
    names = sorted(window)
    local = torch.stack([torch.stack([v.to(accelerator.device) for v in window[k]]).nanmean() for k in names])
    mean = accelerator.reduce(local, reduction="mean")
    return {f"{prefix}/{k}": v for k, v in zip(names, mean.tolist())}


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _check_fields(strategy: Strategy, batch: dict) -> None:
    missing = [f for f in strategy.required_fields if f not in batch]
    if missing:
        raise KeyError(f"{strategy.name} needs batch fields {missing}; the batch has {sorted(batch)}")
