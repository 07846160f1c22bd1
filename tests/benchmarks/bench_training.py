"""Training throughput of every stage, measured side by side in one process (not part of the test run).

    python tests/benchmarks/bench_training.py                      # SmolLM2-135M on this machine's CPUs
    python tests/benchmarks/bench_training.py model=tiny steps=20  # any config override; steps per job
    python tests/benchmarks/bench_training.py jobs=stage1,stage1_packed tokens=4096  # packed: tokens per batch
    python tests/benchmarks/bench_training.py model=hf model.name_or_path=meta-llama/Llama-3.2-1B model.dtype=bfloat16
    accelerate launch --config_file launch/fsdp.yaml --num_processes 1 tests/benchmarks/bench_training.py jobs=stage2

Jobs (``jobs=`` keeps some, comma-separated): ``cache`` builds the state cache (timed on its own),
``stage1`` Medusa stage 1 with target states computed in memory, ``stage1_disk`` the same read from the
cache, ``stage2`` Medusa stage 2, ``dflash`` DFlash on precomputed features, ``dflash_online`` with the target
run per batch, all on padded batches of ``trainer.batch_size`` rows; ``stage1_packed``, ``stage2_packed``,
``dflash_packed`` and ``dflash_online_packed`` are the same on packed batches of ``tokens=`` tokens
(``trainer.tokens_per_batch``, default 1280, the shipped jobs' own). Under ``accelerate launch`` give one training
job: accelerate ends its process group with a job.
Overrides go to every job, except ``dflash.*`` ones, which go to the DFlash jobs only.

Prints per job: trainable tokens/s (response tokens trained per second, all ranks) and tokens/s (all attended
tokens), after the first logging window; model TFLOP/s per process (matrix-product FLOPs of the first
micro-batch counted by torch's FlopCounterMode, attention scores excluded, times attended tokens/s); on a GPU,
MFU against the bf16 matrix rate measured here (an 8192^3 product); each job's peak memory (:class:`PeakMemory`:
the GPU allocator's peak, or on the CPU the process's peak resident memory: every job runs in a process of its
own); and each job's wall time (data, target states and training). A last line ``RESULTS <json>`` carries the
same numbers for scripts.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from draftheads.drafters import register_configs
from draftheads.jobs.cache import cache_states
from draftheads.runs.life import train

ROOT = Path(__file__).resolve().parents[2]

register_configs()


def job(name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(name, overrides=overrides)


class PeakMemory:
    """Peak memory of what runs inside, MiB: on a GPU the allocator's peak (``max_memory_allocated``); on the CPU
    the process's peak resident memory (``ru_maxrss``: imports and the target included), which is the job's own
    because every job runs in a process of its own (:func:`run_each`)."""

    def __enter__(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = (torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available()
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def run_job(name: str, overrides: list[str]) -> tuple[dict, float, float]:
    """The job's report, wall seconds and peak memory (MiB, :class:`PeakMemory`)."""
    start = time.perf_counter()
    with PeakMemory() as memory:
        report = train(name, job(name, overrides))
    return report, time.perf_counter() - start, memory.peak


def window_mean(curve: list[dict], key: str) -> float:
    """Mean of ``key`` over the logged windows after the first (warm-up)."""
    logged = curve[1:] or curve
    return sum(x[key] for x in logged) / len(logged)


def peak_tflops() -> float | None:
    """Measured dense bf16 matrix rate of this GPU (median of 10 timed 8192^3 products), None on CPU."""
    if not torch.cuda.is_available():
        return None
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192 ** 3 / sorted(times)[len(times) // 2] / 1e12


def format_row(r: dict, peak: float | None) -> str:
    mfu = f"{r['tflops'] / peak:.1%}" if peak else "-"
    return (f"{r['label']:<34}{r['engine']:>10}{r['trainable_tok_s']:>16.0f}{r['tok_s']:>10.0f}"
            f"{r['tflops']:>9.2f}{mfu:>7}{r['peak_mib']:>9.0f}{r['wall_s']:>8.1f}")


OPTIONS = ("steps=", "jobs=", "tokens=", "out=")
"""The benchmark's own arguments; the others are config overrides."""


def run_each(jobs: list[str], argv: list[str]) -> tuple[list[dict], float | None, float | None]:
    """Every job in a process of its own (this script with ``jobs=<job>``, sharing one ``out=`` folder, so the
    state cache job feeds the next), its output streamed; returns the rows, the cache build seconds and the
    measured bf16 peak, from each process's ``RESULTS`` line."""
    out = tempfile.mkdtemp(prefix="bench-")
    own = [a for a in argv if not a.startswith(("jobs=", "out="))]
    rows, cache_s, peak = [], None, None
    for name in jobs:
        child = subprocess.Popen([sys.executable, __file__, f"jobs={name}", f"out={out}", *own],
                                 stdout=subprocess.PIPE, text=True)
        for line in child.stdout:
            print(line, end="", flush=True)
            if line.startswith("RESULTS "):
                result = json.loads(line.removeprefix("RESULTS "))
                rows += result["rows"]
                cache_s, peak = result["cache_s"] or cache_s, result["peak_tflops"]
        child.wait()
    return rows, cache_s, peak


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv if a.startswith(OPTIONS))
    steps = int(options.get("steps", 12))
    padded, packed = "trainer.tokens_per_batch=null", f"trainer.tokens_per_batch={options.get('tokens', 1280)}"
    user = [a for a in argv if not a.startswith((*OPTIONS, "dflash."))]
    dflash_only = [a for a in argv if a.startswith("dflash.")]  # DFlash's own keys reach its jobs only
    out = Path(options.get("out") or tempfile.mkdtemp(prefix="bench-"))
    common = ["tracker=none", "eval.enabled=false", "export=false", "trainer.log_every=2", "trainer.count_flops=true",
              f"trainer.checkpoint_every={10 ** 6}", "data.num_train_prompts=64", "data.num_val_prompts=8", *user]
    medusa = [*common, "stage1.max_steps=" + str(steps), "stage1.epochs=100", "stage2.enabled=false"]
    stage2 = [*common, "stage1.max_steps=1", f"stage2.max_steps={steps}", "stage2.epochs=100"]
    cache = [f"data.target_states_dir={out / 'hs'}"]
    dflash = [*common, f"train.max_steps={steps}", "train.epochs=100", "eval.peer_runs=[]"]
    online = "data.target_states=online"
    plans = {
        "stage1": ("medusa stage 1, states in memory", "medusa", [*medusa, padded], "stage1"),
        "stage1_disk": ("medusa stage 1, states from disk", "medusa",
                           [*medusa, padded, "data.target_states=disk", *cache], "stage1"),
        "stage2": ("medusa stage 2 (last 4 layers)", "medusa", [*stage2, padded], "stage2"),
        "stage1_packed": ("medusa stage 1, packed", "medusa", [*medusa, packed], "stage1"),
        "stage2_packed": ("medusa stage 2, packed", "medusa", [*stage2, packed], "stage2"),
        "dflash": ("dflash, features precomputed", "dflash", [*dflash, padded], "dflash"),
        "dflash_online": ("dflash, features online", "dflash", [*dflash, padded, online], "dflash"),
        "dflash_packed": ("dflash, packed", "dflash", [*dflash, packed], "dflash"),
        "dflash_online_packed": ("dflash, features online, packed", "dflash", [*dflash, packed, online], "dflash"),
    }
    wanted = options.get("jobs", "cache," + ",".join(plans)).split(",")
    unknown = set(wanted) - {"cache", *plans}
    if unknown:
        raise SystemExit(f"unknown jobs {sorted(unknown)}; choose from cache, {', '.join(plans)}")
    several = len(wanted) > 1 and "out" not in options and int(os.environ.get("WORLD_SIZE", 1)) == 1
    if several:
        rows, cache_s, peak = run_each(wanted, argv)
        print_table(rows, steps, cache_s, peak)
        return
    rows, cache_s = [], None
    if "cache" in wanted:
        start = time.perf_counter()
        cache_states(job("medusa", [*medusa, f"output_dir={out / 'cache'}", *cache]))
        cache_s = time.perf_counter() - start
        print(f"state cache build: {cache_s:.1f} s", flush=True)
    peak = peak_tflops()
    for name in (n for n in plans if n in wanted):
        label, job_name, overrides, stage = plans[name]
        try:
            report, wall, memory = run_job(job_name, [*overrides, *(dflash_only if job_name == "dflash" else []),
                                              f"output_dir={out / name}"])
        except Exception as e:  # one job's failure is a result too; the others still run
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
            continue
        curve = report["train_curves"][stage] if report else []
        if curve:  # the main process reports
            rows.append({"job": name, "label": label, "engine": report["distributed"]["type"],
                         "trainable_tok_s": window_mean(curve, "perf/trainable_tokens_per_s"),
                         "tok_s": window_mean(curve, "perf/tokens_per_s"),
                         "tflops": window_mean(curve, "perf/tflops_per_s"), "peak_mib": memory, "wall_s": wall})
            print("ROW " + format_row(rows[-1], peak), flush=True)
    print_table(rows, steps, cache_s, peak, table="out" not in options)  # a job's own process: RESULTS only


def print_table(rows: list[dict], steps: int, cache_s: float | None, peak: float | None, table: bool = True) -> None:
    """The rows as a table (with ``table``), then ``RESULTS <json>``."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    if table and rows:
        print(f"\ndevice: {device}; {steps} optimizer steps per job"
              + (f"; measured bf16 peak {peak:.0f} TFLOP/s" if peak else ""))
        print(f"{'job':<34}{'engine':>10}{'trainable tok/s':>16}{'tok/s':>10}{'TFLOP/s':>9}{'MFU':>7}"
              f"{'peak MiB':>9}{'wall s':>8}")
        for r in rows:
            print(format_row(r, peak))
    print("RESULTS " + json.dumps({"device": device, "peak_tflops": peak, "cache_s": cache_s, "rows": rows}))


if __name__ == "__main__":
    main(sys.argv[1:])
