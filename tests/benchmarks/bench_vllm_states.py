"""The state cache made by vLLM beside the one the in-process target makes, on the same rows (not part of the
test run).

    python tests/benchmarks/bench_vllm_states.py vllm.venv=/path/to/vllm-venv            # SmolLM2, the main job's rows
    python tests/benchmarks/bench_vllm_states.py vllm.venv=... data.num_train_prompts=64 stage1.max_steps=20

For the Medusa job's cache (with stage 2: the outputs of the layer before the last 4 and of the last layer)
and the DFlash job's (5 layers): the wall time of ``train/cache_hidden_states.py`` with each backend (vLLM's
includes its engine start), the largest difference between the two caches' states (absolute, and relative to
the row's largest state), and each drafter trained on the partial target from each cache (Medusa both stages,
``stage1.``/``stage2.``/``train.`` overrides set the steps): its loss curve, held-out accuracy, and the largest
difference between the two trained drafters' weights and their relative distance (L2 over all weights). The
answers must be regenerated already (run the job once).
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


STEPS = {"medusa": ["stage1.max_steps=30", "stage2.max_steps=10"], "dflash": ["train.max_steps=30"]}
"""Training steps per drafter; an override of the same group (``stage1.``, ``stage2.``, ``train.``) replaces them."""
WEIGHTS = {"medusa": "medusa_heads/medusa_heads.safetensors", "dflash": "export/dflash/model.safetensors"}
ACCURACY = {"medusa": "val/head1_top1", "dflash": "val/acc_pos1"}


def group(override: str) -> str:
    return override.split(".")[0]


def main(overrides: list[str]) -> None:
    steps = [o for o in overrides if group(o) in {group(k) for keys in STEPS.values() for k in keys}]
    job_keys = [o for o in overrides if not o.startswith("vllm.") and o not in steps]
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'cache':<8} {'backend':<13} {'wall s':>7} {'max |diff|':>11} {'max rel':>9}")
        caches = {}
        for name in ("medusa", "dflash"):
            for backend in ("transformers", "vllm"):
                folder = Path(tmp) / f"{name}-{backend}"
                caches[name, backend] = folder
                extra = [o for o in overrides if o.startswith("vllm.")] if backend == "vllm" else []
                seconds = run("train/cache_hidden_states.py", "--config-name", name, f"target_backend={backend}",
                              "data.target_states_dtype=float32", f"data.target_states_dir={folder}",
                              f"output_dir={tmp}/run", "tracker=none", *extra, *job_keys)
                diff = compare(caches[name, "transformers"], folder) if backend == "vllm" else (0.0, 0.0)
                print(f"{name:<8} {backend:<13} {seconds:>7.1f} {diff[0]:>11.2e} {diff[1]:>9.2e}")
        for name in ("medusa", "dflash"):
            weights = {}
            for backend in ("transformers", "vllm"):
                out = Path(tmp) / f"train-{name}-{backend}"
                mine = [o for o in steps if group(o) in {group(k) for k in STEPS[name]}] or STEPS[name]
                run(f"train/{name}.py", "data.target_states=disk", "data.target_states_dtype=float32",
                    f"data.target_states_dir={caches[name, backend]}", "model.partial=true", "eval.enabled=false",
                    "tracker=none", f"output_dir={out}", *mine, *job_keys)
                report = json.loads((out / "report.json").read_text())
                losses = [p[f"{stage}/loss"] for stage, curve in report["train_curves"].items() for p in curve]
                weights[backend] = load_file(str(out / WEIGHTS[name]))
                print(f"{name} from the {backend} cache: loss {' '.join(f'{x:.4f}' for x in losses)}, "
                      f"{ACCURACY[name]} {report['validation'][ACCURACY[name]]:.4f}")
            a, b = weights["transformers"], weights["vllm"]
            norm = sum((a[k].float() ** 2).sum().item() for k in a) ** 0.5
            apart = sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in a) ** 0.5
            print(f"{name}: largest weight difference {max((a[k] - b[k]).abs().max().item() for k in a):.2e} "
                  f"(largest weight {max(a[k].abs().max().item() for k in a):.2e}); |a - b| / |a| {apart / norm:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])
