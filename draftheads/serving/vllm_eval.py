"""Acceptance measured where the target lives: a finished run's export decoded by vLLM itself
(``train/evaluate.py RUN backend=vllm``), for a target the trainer does not hold. vLLM decodes the eval set's
prompts greedily twice, with the drafter (the run's export, as the parity tool configures it) and without (the
baseline), in its own environment; tau and per-position acceptance come from vLLM's spec-decode counters, as the
parity tool reads them, and the entry has the evaluator's keys.
"""

from __future__ import annotations

from pathlib import Path

from draftheads.serving.parity import acceptance, run_vllm


def evaluate_in_vllm(python: Path, target: str, speculative_config: dict, prompts: list[list[int]],
                     max_new_tokens: int, stop: list[int], engine: dict) -> dict:
    """One eval set's entry measured in vLLM's offline engine: ``acceptance_length`` (tau = 1 + accepted drafts
    per verification step, vLLM's counters), ``acceptance_rate_per_position`` (conditional) and
    ``cumulative_acceptance_per_position``, ``accepted_histogram`` (steps with k drafts accepted: a chain's
    position k+1 is reached only through position k), ``tokens_per_second`` (speculative and baseline, wall time of each
    ``generate`` call, prefill included), ``speedup``, ``greedy_match`` (prompts whose speculative output is the
    baseline's), ``num_prompts``, ``max_new_tokens``, ``gamma``, ``new_tokens``, ``backend: vllm``. ``engine``:
    ``LLM`` arguments (dtype, parallel sizes)."""
    job = {"mode": "offline", "target": target, "prompts": prompts, "max_tokens": max_new_tokens,
           "stop_token_ids": stop, "engine": engine}
    spec = run_vllm(python, job | {"speculative_config": speculative_config})
    plain = run_vllm(python, job | {"speculative_config": None})
    tau, cumulative = acceptance(spec["metrics"])
    at_least = [spec["metrics"].get("drafts", 0), *spec["metrics"].get("accepted_per_pos", []), 0]
    tokens, baseline = sum(map(len, spec["outputs"])), sum(map(len, plain["outputs"]))
    rates = {"speculative": tokens / spec["seconds"], "baseline": baseline / plain["seconds"]}
    return {"method": f"{speculative_config['method']} (vllm)", "backend": "vllm", "acceptance_length": tau,
            "acceptance_rate_per_position": [c / p if p else 0.0 for c, p in zip(cumulative, [1.0, *cumulative])],
            "cumulative_acceptance_per_position": cumulative, "tokens_per_second": rates,
            "accepted_histogram": [int(a - b) for a, b in zip(at_least, at_least[1:])],
            "speedup": rates["speculative"] / rates["baseline"],
            "greedy_match": sum(a == b for a, b in zip(spec["outputs"], plain["outputs"])) / len(prompts),
            "num_prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "gamma": speculative_config["num_speculative_tokens"], "new_tokens": tokens,
            "sampling": {"temperature": 0.0}, "decoding": {"stop_token_ids": list(stop)}}
