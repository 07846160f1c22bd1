"""Training throughput of every stage, measured side by side in one process (not part of the test run).

    python tests/benchmarks/bench_training.py                      # SmolLM2-135M on this machine's CPUs
    python tests/benchmarks/bench_training.py model=tiny steps=20  # any config override; steps per job
    python tests/benchmarks/bench_training.py model=hf model.name_or_path=meta-llama/Llama-3.2-1B model.dtype=bfloat16

Jobs: Medusa stage 1 with target states computed in memory vs read from the offline cache (the cache build
timed on its own), Medusa stage 2, DFlash with precomputed vs online target features. Prints trainable
tokens/s (response tokens trained per second, all ranks, after the first logging window) and each job's wall
time (data, target states and training).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from train.config import register_configs  # noqa: E402

register_configs()


def job(name: str, overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(name, overrides=overrides)


def run_job(name: str, overrides: list[str]) -> tuple[dict, float]:
    from train.dflash import run as dflash
    from train.medusa import run as medusa
    start = time.perf_counter()
    report = (medusa if name == "medusa" else dflash)(job(name, overrides))
    return report, time.perf_counter() - start


def throughput(curve: list[dict]) -> float:
    """Mean trainable tokens/s over the logged windows after the first (warm-up)."""
    logged = curve[1:] or curve
    return sum(x["perf/trainable_tokens_per_s"] for x in logged) / len(logged)


def main(argv: list[str]) -> None:
    steps = int(next((a.split("=")[1] for a in argv if a.startswith("steps=")), 12))
    user = [a for a in argv if not a.startswith("steps=")]
    out = Path(tempfile.mkdtemp(prefix="bench-"))
    common = ["tracker=none", "eval.enabled=false", "export=false", "trainer.log_every=2",
              f"trainer.checkpoint_every={10 ** 6}", "data.num_train_prompts=64", "data.num_val_prompts=8", *user]
    medusa = [*common, "stage1.max_steps=" + str(steps), "stage1.epochs=100", "stage2.enabled=false"]
    cache = [f"data.hidden_states_dir={out / 'hs'}"]
    rows = []

    from train.cache_hidden_states import run as cache_states
    start = time.perf_counter()
    cache_states(job("medusa", [*medusa, f"output_dir={out / 'cache'}", *cache]))
    cache_s = time.perf_counter() - start
    plans = [
        ("medusa stage 1, states in memory", "medusa", [*medusa, f"output_dir={out / 'm1'}"], "stage1"),
        ("medusa stage 1, offline cache", "medusa", [*medusa, f"output_dir={out / 'm2'}", "data.hidden_states=offline",
                                                     *cache], "stage1"),
        ("medusa stage 2 (last 4 layers)", "medusa", [*common, f"output_dir={out / 'm3'}", "stage1.max_steps=1",
                                                      f"stage2.max_steps={steps}", "stage2.epochs=100"], "stage2"),
        ("dflash, features precomputed", "dflash", [*common, f"output_dir={out / 'd1'}", f"train.max_steps={steps}",
                                                    "train.epochs=100", "dflash.medusa_run=null"], "dflash"),
        ("dflash, features online", "dflash", [*common, f"output_dir={out / 'd2'}", f"train.max_steps={steps}",
                                               "train.epochs=100", "dflash.medusa_run=null",
                                               "dflash.features=online"], "dflash"),
    ]
    for label, name, overrides, stage in plans:
        report, wall = run_job(name, overrides)
        rows.append((label, throughput(report["train_curves"][stage]), wall))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"\ndevice: {device}; {steps} optimizer steps per job; offline cache build: {cache_s:.1f} s")
    print(f"{'job':<34}{'trainable tok/s':>16}{'job wall s':>12}")
    for label, tps, wall in rows:
        print(f"{label:<34}{tps:>16.0f}{wall:>12.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
