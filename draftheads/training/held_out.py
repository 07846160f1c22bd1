"""What a drafter's training measures besides its loss: per-position accuracy and acceptance estimated from
teacher-forced predictions, and the same module's metrics on held-out rows."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from draftheads.data.batching import collate


@torch.no_grad()
def chain_estimates(correct: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position accuracy and acceptance of chains of drafts predicted teacher-forced.

    Args:
        correct: ``[..., G]`` bool, draft position k of a chain (a DFlash block, an EAGLE-3 unroll) predicted its
            target token; valid: ``[..., G]`` bool, that position has a target.
    Returns (detached scalars): ``acc_pos{k}`` (top-1 accuracy at position k over valid ones; NaN when none),
    ``alpha_pos{k}`` (accuracy at k given 1..k-1 correct, EAGLE's n-alpha) and ``tau_estimate`` = 1 + sum_k
    prod_{j<=k} alpha_j: an estimate from teacher-forced chains, the evaluator's tau is the measurement.
    """
    correct = correct & valid
    prefix = correct.long().cumprod(-1).bool()  # positions 1..k all correct (an invalid one ends it)
    reached = torch.cat([valid[..., :1], prefix[..., :-1] & valid[..., 1:]], dim=-1)
    metrics, alpha_prod, tau = {}, 1.0, 1.0
    nan, zero = torch.tensor(float("nan"), device=valid.device), torch.tensor(0.0, device=valid.device)
    for k in range(valid.shape[-1]):
        n_valid, n_reached = valid[..., k].sum(), reached[..., k].sum()
        metrics[f"acc_pos{k + 1}"] = correct[..., k].sum() / n_valid if n_valid else nan
        alpha = prefix[..., k].sum() / n_reached if n_reached else zero
        metrics[f"alpha_pos{k + 1}"] = alpha
        alpha_prod = alpha_prod * alpha
        tau = tau + alpha_prod
    metrics["tau_estimate"] = torch.as_tensor(tau, device=valid.device)
    return metrics


@torch.inference_mode()
def held_out_metrics(module, rows: list[dict], batch_size: int, pad_token_id: int, loss_name: str,
                     seed: int = 0) -> dict[str, float]:
    """``module(batch) -> (loss, metrics)`` (a strategy's module) over held-out ``rows``: ``val/<loss_name>`` and
    ``val/<metric>``, each averaged over batches weighted by rows (a NaN metric, a position no batch reaches,
    is left out). The global RNG is seeded with ``seed`` (a module that draws, like DFlash's anchors, sees the
    same draws on every call) and restored afterwards."""
    device = next(module.parameters()).device
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for s in range(0, len(rows), batch_size):
            chunk = rows[s:s + batch_size]
            batch = {k: v.to(device) for k, v in collate(chunk, pad_token_id).items()}
            loss, metrics = module(batch)
            for name, value in {loss_name: loss, **metrics}.items():
                if not math.isnan(float(value)):
                    sums[f"val/{name}"] += float(value) * len(chunk)
                    weights[f"val/{name}"] += len(chunk)
    return {k: sums[k] / weights[k] for k in sums}
