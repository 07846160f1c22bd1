"""The LM-head loss with and without its ``[tokens, V]`` logits, side by side (not part of the test run).

    python tests/benchmarks/bench_lm_head_loss.py              # SmolLM2's and a Llama-3-sized LM head
    python tests/benchmarks/bench_lm_head_loss.py 4096:49152:576

Per shape (tokens N : vocabulary V : hidden D) and path, each in its own process: seconds per forward+backward
of a mean cross-entropy (the last of 3 runs) and the extra peak memory of the process over its inputs, in total and
per token. ``full``: ``F.cross_entropy`` on float32 logits (the old path); ``chunked``:
``draftheads.training.lm_head_loss.linear_loss``; each with a trainable head (EAGLE-3's, Medusa's
per-head ones: its float32 weight gradient is part of the peak) and a ``frozen`` one (the target's, as DFlash and
Medusa's default read it).

    python tests/benchmarks/bench_lm_head_loss.py --objectives              # DSpark-like: 2048:49152:576
    python tests/benchmarks/bench_lm_head_loss.py --objectives 1024:49152:576

Per objective (``ce``, ``kl``, ``tv``, ``lk_hybrid``, DSpark's ``{ce: 0.1, tv: 1.8}``; temperature 1) and path, each
in its own process: seconds per forward+backward of ``linear_loss`` through a frozen head (the drafter's hidden
states train; a distillation objective also makes the target's logits from its own ``[N, D]`` states and
``[V, D]`` head), the minimum of ``RUNS`` runs after a warm-up, and the extra peak memory. ``closed``: the library's
closed-form gradients; ``autograd``: the path they replaced (:func:`autograd_linear_loss`, the objective's
gradient by autograd on each chunk's logits, chunks a sixth of ``CHUNK_BYTES``).
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
OBJECTIVES = {"ce": {"ce": 1.0}, "kl": {"kl": 1.0}, "tv": {"tv": 1.0}, "lk_hybrid": {"lk_hybrid": 1.0},
              "ce+tv": {"ce": 0.1, "tv": 1.8}}
RUNS = 3


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


def autograd_linear_loss(hidden, weight, labels, weights, teacher, mix, temperature, chunk_bytes):
    """``linear_loss(...).loss`` through a frozen head, as it was before the closed form: a distillation
    objective's gradient in each chunk's logits by autograd on the objective (ce, kl, tv, lk_hybrid and their
    mixes, as ``position_losses`` wrote them), ``ce`` alone in closed form. Sets ``hidden.grad``."""
    v = weight.shape[0]
    chunk = max(1, chunk_bytes // (4 * v * (1 if teacher is None else 6)))
    grad_h, total = torch.zeros_like(hidden, dtype=torch.float32), 0.0
    for s in range(0, len(hidden), chunk):
        h, y, w = hidden[s:s + chunk].detach(), labels[s:s + chunk], weights[s:s + chunk, None]
        logits = (h @ weight.t()).float()
        lse = logits.logsumexp(-1, keepdim=True)
        ce = (lse - logits.gather(1, y[:, None]))[:, 0]
        logits.argmax(-1)  # the top-1 token, as linear_loss returns it
        if teacher is None:
            g = logits.sub_(lse).exp_()
            g[torch.arange(len(h)), y] -= 1
            g, loss = g * w, ce
        else:
            leaf = logits.detach().requires_grad_()
            with torch.enable_grad():
                loss = _autograd_losses(leaf, y, (teacher[0][s:s + chunk] @ teacher[1].t()).float(), mix,
                                        temperature)
                (g,) = torch.autograd.grad((loss * w[:, 0]).sum(), leaf)
        grad_h[s:s + chunk] = g @ weight
        total += float((loss.detach() * w[:, 0]).sum())
    hidden.grad = grad_h
    return total


def _autograd_losses(z, labels, z_t, mix, temperature):
    log_q = F.log_softmax(z / temperature, -1)
    log_p = F.log_softmax(z_t / temperature, -1)
    q, p = log_q.exp(), log_p.exp()
    alpha = torch.minimum(p, q).sum(-1)
    kl = lambda: (p * (log_p - log_q)).sum(-1)  # noqa: E731 (each term made only when the mix names it)
    lam = torch.exp(-3.0 * alpha.detach())
    terms = {"ce": lambda: F.cross_entropy(z, labels, reduction="none"), "kl": kl, "tv": lambda: 1 - alpha,
             "lk_hybrid": lambda: lam * kl() + (1 - lam) * (1 - alpha)}
    return sum(weight * terms[name]() for name, weight in mix.items())


def one_objective(path: str, name: str, n: int, v: int, d: int) -> dict:
    from draftheads.training.lm_head_loss import CHUNK_BYTES, linear_loss
    torch.manual_seed(0)
    hidden = torch.empty(n, d).normal_().requires_grad_()
    weight = torch.empty(v, d).normal_(0, 0.05)
    mix = OBJECTIVES[name]
    teacher = None if set(mix) == {"ce"} else (torch.empty(n, d).normal_(), torch.empty(v, d).normal_(0, 0.05), None)
    labels = torch.randint(0, v, (n,))
    weights = torch.full((n,), 1 / n)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(RUNS + 1):
        start = time.perf_counter()
        if path == "closed":
            out = linear_loss(hidden, weight, labels, weights=weights, k=1, teacher=teacher, mix=mix)
            out.loss.backward()
            loss = float(out.loss.detach())
        else:
            loss = autograd_linear_loss(hidden, weight, labels, weights, teacher, mix, 1.0, CHUNK_BYTES)
        times.append(time.perf_counter() - start)
        grad, hidden.grad = hidden.grad, None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"seconds": min(times[1:]), "peak_bytes": peak, "loss": loss, "grad_norm": float(grad.norm())}


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


def main_objectives(shape: str) -> None:
    n, v, d = (int(x) for x in shape.split(":"))
    print(f"N:V:D {shape}, float32, {torch.get_num_threads()} threads; s/step: min of {RUNS} after a warm-up")
    print(f"{'objective':<12}{'autograd s':>11}{'closed s':>10}{'speedup':>9}{'autograd MiB':>14}{'closed MiB':>12}"
          f"{'loss diff':>11}{'gnorm diff':>11}")
    for name in OBJECTIVES:
        r = {}
        for path in ("autograd", "closed"):
            out = subprocess.run([sys.executable, __file__, "--one-objective", path, name, str(n), str(v), str(d)],
                                 capture_output=True, text=True, check=True).stdout
            r[path] = json.loads(out.strip().splitlines()[-1])
        a, c = r["autograd"], r["closed"]
        print(f"{name:<12}{a['seconds']:>11.2f}{c['seconds']:>10.2f}{a['seconds'] / c['seconds']:>8.1f}x"
              f"{a['peak_bytes'] / 2 ** 20:>14.0f}{c['peak_bytes'] / 2 ** 20:>12.0f}"
              f"{abs(a['loss'] - c['loss']):>11.1e}{abs(a['grad_norm'] - c['grad_norm']):>11.1e}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(sys.argv[2], *(int(x) for x in sys.argv[3:6]))))
    elif sys.argv[1:2] == ["--one-objective"]:
        print(json.dumps(one_objective(sys.argv[2], sys.argv[3], *(int(x) for x in sys.argv[4:7]))))
    elif sys.argv[1:2] == ["--objectives"]:
        main_objectives((sys.argv[2:3] or ["2048:49152:576"])[0])
    else:
        main(sys.argv[1:] or SHAPES)
