"""Parity with vLLM: our chain evaluator's outputs and acceptance counters beside vLLM's, for the same prompts
and export (vLLM's side runs in its own environment, :mod:`draftheads.serving.vllm_runner`).

tau = 1 + accepted / drafts and per-position acceptance = accepted at position i / drafts, both counted as vLLM
counts them (accepted drafts counted before the token budget cuts them). Parity: every output identical and
|tau difference| <= :data:`TOLERANCE` (float32 kernels differ between vLLM and PyTorch, and a flipped near-tie
changes one acceptance, ~0.004 of tau over a 250-draft set).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftheads.data.templates import stop_token_ids
from draftheads.data.vllm_states import run_in_vllm
from draftheads.models.speculative import speculative_decode

RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
TOLERANCE = 0.02


def our_side(target, tokenizer, drafter, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Our chain decoding of every prompt: outputs and vLLM-style counters."""
    outputs, steps = [], []
    device = next(target.parameters()).device
    stop = stop_token_ids(tokenizer, target.generation_config)
    for ids in prompt_ids:
        r = speculative_decode(target, drafter, torch.tensor(ids, device=device), max_new_tokens, stop)
        outputs.append(r.tokens)
        steps += r.accepted_per_step
    return {"outputs": outputs, "metrics": {
        "drafts": len(steps), "accepted": sum(steps),
        "accepted_per_pos": [sum(n > i for n in steps) for i in range(drafter.gamma)]}}


def run_vllm(python: Path, job: dict) -> dict:
    """Run :mod:`~draftheads.serving.vllm_runner` on ``job`` with the vLLM environment's ``python``; its
    result (outputs and vLLM's counters)."""
    return run_in_vllm(python, RUNNER, job)


def acceptance(metrics: dict) -> tuple[float, list[float]]:
    """tau = 1 + accepted / drafts, and accepted at each position / drafts."""
    drafts = max(metrics.get("drafts", 0), 1)
    return 1 + metrics.get("accepted", 0) / drafts, [a / drafts for a in metrics.get("accepted_per_pos", [])]


def compare(name: str, ours: dict, theirs: dict, decode=None) -> dict:
    """One row of the parity table; ``decode`` turns our token ids into text (the server answers in text)."""
    mine = [decode(o) for o in ours["outputs"]] if decode else ours["outputs"]
    same = sum(a == b for a, b in zip(mine, theirs["outputs"])) / len(mine)
    (tau_ours, pos_ours), (tau_vllm, pos_vllm) = acceptance(ours["metrics"]), acceptance(theirs["metrics"])
    return {"set": name, "identical": same, "tau_ours": tau_ours, "tau_vllm": tau_vllm,
            "per_position_ours": pos_ours, "per_position_vllm": pos_vllm, "drafts_ours": ours["metrics"]["drafts"],
            "drafts_vllm": theirs["metrics"].get("drafts", 0),
            "parity": same == 1.0 and abs(tau_ours - tau_vllm) <= TOLERANCE}
