"""What ``trainer.mixed_precision=auto`` chooses on this machine, and what the product that dominates a training
step costs in it beside float32: one 1024-token chunk of SmolLM2's LM head (1024 x 576 by 576 x 49152, 58 GFLOP),
the best of three after a warm-up. A precision that would be emulated is not timed (tens of seconds a product).

    python tests/benchmarks/bench_precision.py
    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 \
        python tests/benchmarks/bench_precision.py

CI runs the second line (an ordinary CPU's paths on any x86 CPU, docs/scale-out.md) and prints its timing line.
"""

from __future__ import annotations

import time

import torch

from draftheads.models.precision import choose_precision, default_device

SHAPE = (1024, 576, 49152)
"""Tokens of one LM-head chunk, SmolLM2's hidden size and vocabulary."""


def seconds(dtype: torch.dtype | None, autocast: bool) -> float:
    """Best of three products of :data:`SHAPE` in ``dtype`` (float32 inputs under bf16 autocast if ``autocast``)."""
    n, d, v = SHAPE
    a, b = torch.randn(n, d), torch.randn(d, v)
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    best = float("inf")
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        a @ b
        for _ in range(3):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    chosen = choose_precision("auto", default_device())
    flops = 2 * SHAPE[0] * SHAPE[1] * SHAPE[2]
    line = f"{chosen.line}; {torch.get_num_threads()} threads"
    fp32 = seconds(None, False)
    line += f"; LM-head chunk product: float32 {fp32:.3f} s ({flops / fp32 / 1e9:.0f} GFLOP/s)"
    if chosen.value == "bf16":
        bf16 = seconds(None, True)
        line += f", bf16 autocast {bf16:.3f} s ({flops / bf16 / 1e9:.0f} GFLOP/s)"
    print(line)


if __name__ == "__main__":
    main()
