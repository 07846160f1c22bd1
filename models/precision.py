"""Which low precision this machine computes natively, and the precisions ``auto`` chooses from it.

A CPU without bf16 instructions (AVX2-only x86, AVX-512 before Cooper Lake, most AMD EPYC before Zen 4) emulates
every bf16 matrix product: the LM-head product of one 1024-token chunk of SmolLM2 (1024 x 576 by 576 x 49152)
took 12.7 s in bf16 against 2.16 s in float32 on an AVX2 EPYC (issue 56), about 50x per training step. So on a
CPU, ``auto`` means bf16 only where the CPU has it in hardware (AVX512-BF16 or AMX-BF16 on x86, the BF16
extension on Arm), float32 otherwise; on a GPU it means bf16, as before.

oneDNN, which computes torch's bf16 products on CPU, can be capped below what the CPU has with
``ONEDNN_MAX_CPU_ISA`` (``AVX2`` reproduces an ordinary CPU on an AVX-512 one, while
``torch.backends.cpu.get_cpu_capability()`` still says AVX512): a cap below ``AVX512_CORE_BF16`` counts as no
native bf16 here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's ISA cap (and its older name): https://uxlfoundation.github.io/oneDNN/dev_guide_cpu_dispatcher_control.html"""
BF16_ISAS = ("BF16", "AMX", "AVX10", "FP16", "ALL", "DEFAULT")
"""Words in a cap's value (``AVX512_CORE_BF16``, ``AVX512_CORE_AMX``, ``AVX10_1_512``, ``AVX512_CORE_FP16``,
``ALL``) that leave oneDNN its bf16 instructions; every lower cap (``AVX2``, ``AVX512_CORE``,
``AVX512_CORE_VNNI``...) emulates bf16."""
LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Native:
    """Whether ``dtype`` products run in hardware on a device, and the evidence, said in words."""
    dtype: torch.dtype
    native: bool
    why: str


def native(dtype: torch.dtype, device: str) -> Native:
    """Whether matrix products in ``dtype`` (``torch.bfloat16`` or ``torch.float16``) run natively on a device
    type (``"cpu"``, ``"cuda"``...). On a CPU from ``torch.cpu.get_capabilities()`` (cpuinfo) and oneDNN's ISA cap
    (:data:`ISA_CAPS`); on CUDA from ``torch.cuda.is_bf16_supported()`` (fp16 always); any other accelerator is
    taken as native (its trainers' default)."""
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    if device == "cuda":
        ok = dtype == torch.float16 or torch.cuda.is_bf16_supported(including_emulation=False)
        return Native(dtype, ok, f"{torch.cuda.get_device_name()} {'has' if ok else 'has no'} native {name}")
    if device != "cpu":
        return Native(dtype, True, f"{device} accelerator")
    caps = _cpu_capabilities()
    flags = (("avx512_bf16", "amx_bf16", "bf16", "sve_bf16") if dtype == torch.bfloat16
             else ("avx512_fp16", "amx_fp16", "fp16_arith"))
    have = [f for f in flags if caps.get(f)]
    if not have:
        return Native(dtype, False, f"this CPU has none of {', '.join(flags[:2])} (cpuinfo): {name} is emulated")
    cap = next((os.environ[v] for v in ISA_CAPS if os.environ.get(v)), None)
    if cap is not None and not any(word in cap.upper() for word in BF16_ISAS):
        return Native(dtype, False, f"this CPU has {', '.join(have)} but {ISA_CAPS[0]}={cap} keeps oneDNN from "
                                    f"them: {name} is emulated")
    return Native(dtype, True, f"this CPU has {', '.join(have)}")


def _cpu_capabilities() -> dict:
    """cpuinfo's flags (``torch.cpu.get_capabilities``, torch 2.10+; the two bf16 flags before it)."""
    if hasattr(torch.cpu, "get_capabilities"):
        return dict(torch.cpu.get_capabilities())
    return {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_bf16": torch.cpu._is_amx_tile_supported()}


def default_device() -> str:
    """The device type a job computes on: the current accelerator's, else ``"cpu"``."""
    acc = torch.accelerator.current_accelerator()
    return acc.type if acc is not None else "cpu"


def auto_dtype(device: str | None = None) -> tuple[torch.dtype, str]:
    """``model.dtype=auto``: bfloat16 weights where bf16 is native on ``device`` (default: this job's), float32
    otherwise; with the reason in words."""
    bf16 = native(torch.bfloat16, device or default_device())
    return (torch.bfloat16 if bf16.native else torch.float32), bf16.why


@dataclass(frozen=True)
class Precision:
    """A training precision (``trainer.mixed_precision``) as chosen: ``value`` is what accelerate and autocast are
    given (``bf16``, ``fp16`` or ``no``), ``line`` what the job prints and the report records."""
    requested: str
    value: str
    line: str
    emulated: bool


def choose_precision(requested: str, device: str | None = None) -> Precision:
    """``trainer.mixed_precision`` on this machine. ``auto``: bf16 where it is native on ``device`` (default:
    this job's), ``no`` (float32) otherwise. An explicit ``bf16``/``fp16`` is kept, with ``emulated`` true and a
    warning in ``line`` where this device would emulate it; ``no`` is kept as it is."""
    device = device or default_device()
    if requested == "no":
        return Precision(requested, "no", "precision: float32 (trainer.mixed_precision=no)", False)
    low = native(LOW.get(requested, torch.bfloat16), device)
    if requested == "auto":
        value = "bf16" if low.native else "no"
        what = "bf16 autocast" if low.native else "float32"
        return Precision(requested, value, f"precision: {what} (trainer.mixed_precision=auto: {low.why})", False)
    if low.native:
        return Precision(requested, requested, f"precision: {requested} autocast ({low.why})", False)
    return Precision(requested, requested, f"WARNING: precision: {requested} autocast as asked, but {low.why}: "
                                           f"a training step may be tens of times slower than in float32 "
                                           f"(trainer.mixed_precision=auto chooses float32 here)", True)
