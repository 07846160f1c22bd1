"""The LM-head loss with and without its ``[tokens, V]`` logits, side by side (not part of the test run).

    python tests/benchmarks/bench_lm_head_loss.py              # SmolLM2's and a Llama-3-sized LM head
    python tests/benchmarks/bench_lm_head_loss.py 4096:49152:576

Per shape (tokens N : vocabulary V : hidden D) and path, each in its own process: seconds per forward+backward
of a mean cross-entropy (the last of 3 runs) and the extra peak memory of the process over its inputs, in total and
per token. ``full``: ``F.cross_entropy`` on float32 logits (the old path); ``chunked``:
``draftheads.training.lm_head_loss.linear_loss``; each with a trainable head (EAGLE-3's, Medusa's
per-head ones: its float32 weight gradient is part of the peak) and a ``frozen`` one (the target's, as DFlash and
Medusa's default read it).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = ["4096:49152:576", "2048:128256:2048"]


def one(path: str, n: int, v: int, d: int) -> dict:
    from draftheads.training.lm_head_loss import linear_loss
    torch.manual_seed(0)
    hidden = torch.empty(n, d).normal_().requires_grad_()  # in place: no temporary raises the baseline peak
    weight = torch.empty(v, d).normal_(0, 0.02).requires_grad_(not path.endswith("frozen"))
    labels = torch.randint(0, v, (n,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(3):
        start = time.perf_counter()
        if path.startswith("full"):
            loss = F.cross_entropy(F.linear(hidden, weight).float(), labels)
        else:
            loss = linear_loss(hidden, weight, labels, weights=torch.full((n,), 1 / n))[0]
        loss.backward()
        seconds = time.perf_counter() - start
        hidden.grad = weight.grad = None  # (a frozen head gets none)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"seconds": seconds, "peak_bytes": peak, "loss": float(loss)}


def main(shapes: list[str]) -> None:
    print(f"{'N:V:D':<20}{'path':<16}{'s/step':>9}{'peak MiB':>10}{'KiB/token':>11}{'loss':>10}")
    for shape in shapes:
        n, v, d = (int(x) for x in shape.split(":"))
        for path in ("full", "chunked", "full-frozen", "chunked-frozen"):
            out = subprocess.run([sys.executable, __file__, "--one", path, str(n), str(v), str(d)],
                                 capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{shape:<20}{path:<16}{r['seconds']:>9.3f}{r['peak_bytes'] / 2 ** 20:>10.0f}"
                  f"{r['peak_bytes'] / n / 1024:>11.1f}{r['loss']:>10.4f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], *(int(x) for x in sys.argv[3:6]))))
    else:
        main(sys.argv[1:] or SHAPES)
