"""Held-out validation of a DFlash drafter: loss, per-position accuracy and the teacher-forced tau estimate."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from draftheads.data.batching import collate


@torch.inference_mode()
def validate_dflash(module, rows: list[dict], batch_size: int, pad_token_id: int, seed: int = 0) -> dict[str, float]:
    """DFlash loss, per-position accuracy and the training-time tau estimate on held-out ``rows``.

    ``module`` is the DFlash strategy's module (it reads ``row["target_features"]`` or runs the target).
    Anchors are drawn from a generator seeded with ``seed``, so two calls see the same blocks. Returns
    ``val/dflash_loss``, ``val/acc_pos{k}``, ``val/alpha_pos{k}`` and ``val/tau_estimate``, averaged over
    batches weighted by rows.
    """
    device = next(module.parameters()).device
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)  # the module draws anchors from the global generator
    try:
        sums: dict[str, float] = defaultdict(float)
        weights: dict[str, float] = defaultdict(float)
        for s in range(0, len(rows), batch_size):
            chunk = rows[s:s + batch_size]
            batch = {k: v.to(device) for k, v in collate(chunk, pad_token_id).items()}
            loss, metrics = module(batch)
            for name, value in {"dflash_loss": loss, **metrics}.items():
                if not math.isnan(float(value)):  # a position no block of this batch reaches
                    sums[f"val/{name}"] += float(value) * len(chunk)
                    weights[f"val/{name}"] += len(chunk)
    finally:
        torch.random.set_rng_state(state)
    return {k: sums[k] / weights[k] for k in sums}
