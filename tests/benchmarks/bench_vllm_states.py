"""The state cache made by vLLM beside the one the in-process target makes, on the same rows (not part of the
test run).

    python tests/benchmarks/bench_vllm_states.py vllm.venv=/path/to/vllm-venv            # SmolLM2, the main job's rows
    python tests/benchmarks/bench_vllm_states.py vllm.venv=... data.num_train_prompts=64 stage1.max_steps=20

For the Medusa job's cache (last hidden states) and the DFlash job's (5 layers): the wall time of
``train/cache_hidden_states.py`` with each backend (vLLM's includes its engine start), the largest difference
between the two caches' states (absolute, and relative to the row's largest state), and Medusa stage 1 trained
on the partial target from each cache: its loss curves and the largest difference between the two sets of heads.
The answers must be regenerated already (run the job once).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def compare(a: Path, b: Path) -> tuple[float, float]:
    """Largest absolute and relative state difference between two caches of the same rows."""
    worst_abs = worst_rel = 0.0
    for shard in json.loads((a / "manifest.json").read_text())["shards"]:
        x, y = load_file(str(a / shard["file"])), load_file(str(b / shard["file"]))
        for k in x:
            d = (x[k].float() - y[k].float()).abs().max().item()
            worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, d / x[k].float().abs().max().item())
    return worst_abs, worst_rel


def main(overrides: list[str]) -> None:
    job_keys = [o for o in overrides if not o.startswith(("vllm.", "stage1."))]
    train_keys = [o for o in overrides if o.startswith("stage1.")] or ["stage1.max_steps=30"]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'cache':<8} {'backend':<13} {'wall s':>7} {'max |diff|':>11} {'max rel':>9}")
        caches = {}
        for name in ("medusa", "dflash"):
            for backend in ("transformers", "vllm"):
                folder = Path(tmp) / f"{name}-{backend}"
                caches[name, backend] = folder
                extra = [o for o in overrides if o.startswith("vllm.")] if backend == "vllm" else []
                seconds = run("train/cache_hidden_states.py", "--config-name", name, f"target_backend={backend}",
                              "data.hidden_states_dtype=float32", f"data.hidden_states_dir={folder}",
                              f"output_dir={tmp}/run", "tracker=none", *extra, *job_keys)
                diff = compare(caches[name, "transformers"], folder) if backend == "vllm" else (0.0, 0.0)
                print(f"{name:<8} {backend:<13} {seconds:>7.1f} {diff[0]:>11.2e} {diff[1]:>9.2e}")
        heads = {}
        for backend in ("transformers", "vllm"):
            out = Path(tmp) / f"train-{backend}"
            run("train/medusa.py", "data.hidden_states=offline", "data.hidden_states_dtype=float32",
                f"data.hidden_states_dir={caches['medusa', backend]}", "model.partial=true", "stage2.enabled=false",
                "eval.enabled=false", "export=false", "tracker=none", f"output_dir={out}", *train_keys, *job_keys)
            report = json.loads((out / "report.json").read_text())
            losses = [p["stage1/loss"] for p in report["train_curves"]["stage1"]]
            heads[backend] = load_file(str(out / "medusa_heads" / "medusa_heads.safetensors"))
            print(f"medusa stage 1 from the {backend} cache: loss {' '.join(f'{x:.4f}' for x in losses)}, "
                  f"head1 top-1 {report['validation']['val/head1_top1']:.4f}")
        a, b = heads["transformers"], heads["vllm"]
        print(f"heads: largest weight difference {max((a[k] - b[k]).abs().max().item() for k in a):.2e} "
              f"(largest weight {max(a[k].abs().max().item() for k in a):.2e})")


if __name__ == "__main__":
    main(sys.argv[1:])
