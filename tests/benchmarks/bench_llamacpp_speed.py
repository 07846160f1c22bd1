"""What a drafter buys in llama-server: decode tokens per second without and with each run's drafter GGUF, on the
same prompts (the first run's held-out prompts of its first eval set), threads and target GGUF, greedy, one slot,
no prompt cache; every drafter against the same plain baseline in one run, with tau as llama-server counts it
(1 + accepted / verification steps).

    python tests/benchmarks/bench_llamacpp_speed.py runs/eagle3 runs/dflash [--target-gguf PATH] [--prompts 16] \
        [--llamacpp .llamacpp] [--no-repack]

Each run needs ``train/llamacpp_parity.py RUN`` first (its ``llamacpp_parity.json`` names the drafter's GGUF, the
spec type, the draft length and the target GGUF, the default ``--target-gguf``). Run it alone on the machine:
another process on the same cores changes every number.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer

from draftheads import drafters
from draftheads.data.regenerate import target_prompt_ids
from draftheads.evaluation.methods import load_eval_sets
from draftheads.runs.saved import run_config
from draftheads.serving.llamacpp import LlamaServer, decode_speed
from draftheads.serving.llamacpp_env import BUILD, ensure_llamacpp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--target-gguf", type=Path)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llamacpp", help="llama.cpp's folder (default: $DRAFTHEADS_LLAMACPP, else the cache's)")
    parser.add_argument("--no-repack", dest="repack", action="store_false",
                        help="llama-server --no-repack (a quantized target whose repacked kernels fault on this CPU)")
    args = parser.parse_args()
    llamacpp = ensure_llamacpp(args.llamacpp)
    served = [json.loads((r / "llamacpp_parity.json").read_text()) for r in args.runs]
    target = args.target_gguf or Path(served[0]["target_gguf"])
    tokenizer = AutoTokenizer.from_pretrained(served[0]["target"])
    conf = run_config(args.runs[0], drafters.of_run(args.runs[0]).spec)
    sets = load_eval_sets(replace(conf.eval, enabled=True), tokenizer)
    prompts = [target_prompt_ids(tokenizer, p) for p in next(iter(sets.values()))]
    prompts = prompts[:args.prompts]
    with LlamaServer(llamacpp, target, threads=args.threads, repack=args.repack) as server:
        plain = decode_speed([server.complete(ids, args.tokens) for ids in prompts])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"llama.cpp {BUILD}, target {target.name}{'' if args.repack else ' (--no-repack)'}, {args.threads} threads, "
          f"{len(prompts)} prompts x {args.tokens} new tokens, commit {commit}")
    print(f"{'drafter':<32}{'tok/s':>8}{'speedup':>9}{'tau':>7}")
    print(f"{'none':<32}{plain:>8.1f}{1:>8.2f}x")
    for run, s in zip(args.runs, served):
        with LlamaServer(llamacpp, target, Path(s["draft_gguf"]), s["spec_type"], s["n_max"],
                         threads=args.threads, repack=args.repack) as server:
            done = [server.complete(ids, args.tokens) for ids in prompts]
        tau = 1 + sum(d["draft_n_accepted"] for d in done) / max(sum(d["drafts"] for d in done), 1)
        tps = decode_speed(done)
        print(f"{s['method'] + ' (' + run.name + ')':<32}{tps:>8.1f}{tps / plain:>8.2f}x{tau:>7.2f}")


if __name__ == "__main__":
    main()
