"""DFlash 2 training as a spine strategy: DFlash's (random anchors, every block of a row in one pass over the
target's multi-layer features, cached or computed per batch) with the selector's K-way cross-entropy beside the
unary objective (:func:`~draftheads.drafters.dflash2.model.dflash2_loss`). Only the drafter is registered."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftheads.drafters.dflash.model import block_labels, block_states
from draftheads.drafters.dflash.training import DFlashTraining, _DFlashModule
from draftheads.drafters.dflash2.model import DFlash2DraftModel, dflash2_loss
from draftheads.training.objectives import Objective


class _DFlash2Module(_DFlashModule):
    def __init__(self, drafter: DFlash2DraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective,
                 selector_weight: float):
        super().__init__(drafter, target, max_anchors, settings)
        self.selector_weight = selector_weight

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Padded or packed batches (DFlash's :meth:`blocks`): the objective and the selector's loss over each
        block's S - 1 drafts, each drafted token's predecessor the true token before it (teacher-forced)."""
        S = self.drafter.block_size
        batch, anchors, hidden, last = self.blocks(batch)
        labels, valid = block_labels(batch["input_ids"], batch["loss_mask"], anchors, S)
        T = batch["input_ids"].shape[1]
        pos = (anchors.clamp(min=0)[..., None] + torch.arange(S - 1, device=anchors.device)).clamp(max=T - 1)
        prev = batch["input_ids"].gather(1, pos.flatten(1)).view(pos.shape)  # token[anchor + k - 1], k = 1..S-1
        loss, metrics = dflash2_loss(self.drafter, hidden, labels, valid, prev, self.settings, self.selector_weight,
                                     None if last is None else block_states(last, anchors, S))
        metrics["blocks_per_row"] = (anchors >= 0).float().sum(1).mean()
        return loss, metrics


class DFlash2Training(DFlashTraining):
    """The DFlash 2 drafter on target features: ``target_features`` from the batch (precomputed) or from a target
    forward per batch (online)."""
    name = "dflash2"

    def __init__(self, drafter: DFlash2DraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective,
                 selector_weight: float, online: bool):
        self.module = _DFlash2Module(drafter, target, max_anchors, settings, selector_weight)
        self.required_fields = ("input_ids", "loss_mask") + (() if online else ("target_features",))
