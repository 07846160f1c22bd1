"""Training under a sharding engine (FSDP2, DeepSpeed ZeRO) and getting plain trained weights back.

accelerate prepares a strategy's trainable module in place: FSDP2 turns its parameters into DTensor shards and
DeepSpeed ZeRO-3 partitions them, so after training those objects cannot run on one rank alone. Rank 0's
validation, export and evaluation (and the next stage) need ordinary modules, so :func:`plain_twin` copies
the module before it is prepared and :func:`full_state_dict` gathers the trained weights into it afterwards.
DDP and single-process runs train the objects themselves and need neither.
"""

from __future__ import annotations

import copy
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn


def sharded(accelerator: Accelerator) -> bool:
    """Whether accelerate set up FSDP or DeepSpeed (the prepared module then is not the plain one)."""
    return accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def check_engine(accelerator: Accelerator) -> None:
    """Raise ``RuntimeError`` when the launch asked for FSDP or DeepSpeed but accelerate set up something else
    (it runs them on GPUs only, and otherwise falls back to plain data parallelism without a word), and
    ``ValueError`` for FSDP version 1, whose flat parameters would detach the target's unfrozen layers (shared
    by the target and the trainable module in Medusa stage 2) from the target's own forward: FSDP2
    (``fsdp_version: 2``, launch/fsdp.yaml) shards them in place instead."""
    for engine, env in ((DistributedType.FSDP, "ACCELERATE_USE_FSDP"),
                        (DistributedType.DEEPSPEED, "ACCELERATE_USE_DEEPSPEED")):
        if os.environ.get(env, "false").lower() == "true" and accelerator.distributed_type != engine:
            raise RuntimeError(f"the launch asked for {engine.value} but accelerate set up "
                               f"{accelerator.distributed_type.value} on {accelerator.device.type}: accelerate runs "
                               f"{engine.value} on GPUs only (on CPUs use launch/ddp_cpu.yaml)")
    if accelerator.distributed_type == DistributedType.FSDP and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ValueError(f"FSDP version {accelerator.state.fsdp_plugin.fsdp_version} is not supported: set "
                         f"fsdp_version: 2 in the accelerate config (launch/fsdp.yaml) or pass --fsdp_version 2")


def keep_models_whole(accelerator: Accelerator) -> None:
    """Stop transformers treating models as ZeRO-3 partitioned. accelerate registers its DeepSpeed config with
    transformers, which would then build the target with ``zero.Init`` and make ``generate`` wait for every
    rank (``synced_gpus``); but the frozen target stays outside the engine, run whole by every rank, and by
    rank 0 alone at the end. The trainable module is still partitioned by the engine at ``prepare``."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from transformers.integrations import unset_hf_deepspeed_config
        unset_hf_deepspeed_config()


def configure_engine(accelerator: Accelerator, trainer) -> None:
    """Set the engine up from ``trainer`` before ``prepare``, so every engine keeps float32 weights and float32
    gradient reductions and computes in ``trainer.mixed_precision``:

    - FSDP2: bf16/fp16 copies of the gathered weights for compute, gradients reduced and outputs returned in
      float32 (accelerate's own policy would reduce gradients and return the loss in bf16).
    - DeepSpeed: micro-batch per GPU (there is no prepared dataloader to infer it from: ``trainer.batch_size``
      rows, or one packed sequence with ``trainer.tokens_per_batch``), gradient accumulation
      and clipping (DeepSpeed clips inside its own step); a different value in the DeepSpeed config is replaced,
      with a note. Its bf16 mode trains bf16 weights with float32 master weights, which :func:`full_state_dict`
      returns.
    """
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(trainer.mixed_precision)
        accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32, output_dtype=torch.float32)
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    config = accelerator.state.deepspeed_plugin.deepspeed_config
    wanted = {"train_micro_batch_size_per_gpu": trainer.batch_size if trainer.tokens_per_batch is None else 1,
              "gradient_accumulation_steps": trainer.grad_accum,
              "gradient_clipping": trainer.max_grad_norm}
    for key, value in wanted.items():
        if config.get(key, "auto") not in ("auto", value):
            accelerator.print(f"DeepSpeed config {key}={config[key]} replaced by the trainer's {value}")
        config[key] = value
    config.pop("train_batch_size", None)  # derived by DeepSpeed from the two above and the world size
    config.setdefault("zero_allow_untested_optimizer", True)  # torch's AdamW, which ZeRO wraps


def plain_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s registered parameters and buffers, taken before ``prepare``, sharing every object
    a ``frozen`` tuple attribute holds (the target, its embedding, its LM head): nothing frozen is copied."""
    memo = {id(obj): obj for m in module.modules() for obj in getattr(m, "frozen", ())}
    return copy.deepcopy(module, memo)


def full_state_dict(accelerator: Accelerator, prepared: nn.Module) -> dict[str, torch.Tensor]:
    """The prepared module's complete trained weights on every rank (a collective: all ranks call it).

    FSDP2: all-gathers the DTensor shards (``torch.distributed.checkpoint.state_dict``, full state dict).
    DeepSpeed: the float32 master weights (``deepspeed.utils.safe_get_full_fp32_param``, gathered from their
    ZeRO partitions), not the bf16 weights its bf16 mode computes with; buffers, which ZeRO leaves whole.
    Keys are those of the unprepared module.
    """
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        return get_model_state_dict(prepared, options=StateDictOptions(full_state_dict=True))
    inner = accelerator.unwrap_model(prepared)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param
        state = {k: v.detach().clone() for k, v in inner.state_dict().items()}  # buffers; parameters follow
        for name, param in inner.named_parameters():  # the same order on every rank: collectives under ZeRO-3
            master = safe_get_full_fp32_param(param)  # None only without ZeRO and bf16: the parameter is whole
            state[name] = (param if master is None else master).detach().clone()
        return state
    return inner.state_dict()
