"""Held-out validation of Medusa heads: head accuracy, and how far the target drifted from the original.

The drift (after stage 2) compares the trained target with the original on held-out rows, teacher-forced:
KL(original || trained) per next token, greedy-token agreement, and response perplexity under both.
The original's hidden states are the cached ones (``row["hidden_states"]``), so the original model is
not kept in memory; the trained target's come from its trained layers run on the cached ``layer_input``.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn.functional as F

from draftheads.data.batching import collate
from draftheads.drafters.medusa.heads import MedusaHeads, medusa_loss, medusa_targets
from draftheads.drafters.medusa.training import next_token_positions, self_distillation, trained_hidden_states
from draftheads.training.objectives import Objective, needs_target


TOPK_RANKS = 10


@torch.inference_mode()
def validate(target, heads: MedusaHeads, rows: list[dict], batch_size: int, pad_token_id: int,
             trained_layers: int = 0, settings: Objective | None = None) -> tuple[dict[str, float], list[list[float]]]:
    """Metrics over ``rows`` (each with the original target's ``hidden_states``, and ``layer_input`` when stage
    2 trained the last ``trained_layers`` layers of ``target``; 0: the target is the original), weighted by
    tokens; ``settings``, the heads' objective: a distillation objective's overlap is reported too.

    Returns:
        ``val/head{k}_top1|top5|loss`` (and ``val/head{k}_overlap`` under a distillation objective: the mean
        ``sum_v min(p_v, q_v)`` against the original target at ``loss_temperature``) and ``drift/kl_to_original``,
        ``drift/greedy_agreement``, ``drift/ppl_original``, ``drift/ppl_trained``, ``drift/ppl_change`` (ratio - 1);
        and ``[K][10]`` rank accuracies: how often head k's rank-r candidate is the label (what the default tree is
        grown from).
    """
    device = next(target.parameters()).device
    lm_head = target.get_output_embeddings()
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    rank_hits = torch.zeros(heads.num_heads, TOPK_RANKS)
    for s in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[s:s + batch_size], pad_token_id).items()}
        hidden = (trained_hidden_states(target, batch, trained_layers) if trained_layers else
                  batch["hidden_states"])
        labels, valid = medusa_targets(batch["input_ids"], batch["loss_mask"], heads.num_heads)
        settings = settings or Objective(position_decay=1.0)
        _, metrics = medusa_loss(heads, hidden, labels, valid, lm_head, settings,
                                 batch["hidden_states"] if needs_target(settings) else None)
        states = heads.head_states(hidden)
        for k in range(heads.num_heads):
            top = heads.head_logits(k, states[k][valid[k]], lm_head).topk(TOPK_RANKS, dim=-1).indices
            rank_hits[k] += (top == labels[k][valid[k]][:, None]).float().sum(0).cpu()
            n = float(valid[k].sum())
            for name in [m for m in ("loss", "top1", "top5", "overlap") if f"head{k + 1}_{m}" in metrics] if n else ():
                sums[f"val/head{k + 1}_{name}"] += float(metrics[f"head{k + 1}_{name}"]) * n
                weights[f"val/head{k + 1}_{name}"] += n
        positions = next_token_positions(batch["loss_mask"])
        n = float(positions.sum())
        new_logits, orig_logits = lm_head(hidden[positions]), lm_head(batch["hidden_states"][positions])
        kl, agree = self_distillation(new_logits, orig_logits)
        nxt = batch["input_ids"][:, 1:][batch["loss_mask"][:, 1:]]
        for name, value in (("kl_to_original", kl), ("greedy_agreement", agree),
                            ("nll_trained", F.cross_entropy(new_logits.float(), nxt)),
                            ("nll_original", F.cross_entropy(orig_logits.float(), nxt))):
            sums[f"drift/{name}"] += float(value) * n
            weights[f"drift/{name}"] += n
    out = {k: sums[k] / weights[k] for k in sums}
    out["drift/ppl_trained"] = math.exp(out.pop("drift/nll_trained"))
    out["drift/ppl_original"] = math.exp(out.pop("drift/nll_original"))
    out["drift/ppl_change"] = out["drift/ppl_trained"] / out["drift/ppl_original"] - 1
    rank_accuracy = [(rank_hits[k] / max(weights[f"val/head{k + 1}_top1"], 1.0)).tolist()
                     for k in range(heads.num_heads)]
    return out, rank_accuracy
