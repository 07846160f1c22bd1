"""DSpark training as a spine strategy: DFlash's (random anchors, every block of a row in one pass over the
target's multi-layer features, cached or computed per batch), with the Markov head's bias on each position's
logits (teacher-forced: the true previous token) and the confidence head's binary cross-entropy
(:func:`~draftheads.drafters.dspark.model.dspark_loss`). Only the drafter is registered (what DDP wraps and
checkpoints save); the target is held outside registration.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftheads.drafters.dflash.model import block_states
from draftheads.drafters.dflash.training import DFlashTraining, _DFlashModule
from draftheads.drafters.dspark.model import DSparkDraftModel, block_targets, dspark_loss
from draftheads.training.objectives import Objective, needs_target


def reads_target(settings: Objective, confidence_weight: float) -> bool:
    """Whether training reads the target's distribution: a distillation objective, or a confidence head to train
    (its target is each position's acceptance probability)."""
    return needs_target(settings) or confidence_weight > 0


class _DSparkModule(_DFlashModule):
    def __init__(self, drafter: DSparkDraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective,
                 confidence_weight: float):
        super().__init__(drafter, target, max_anchors, settings)
        self.confidence_weight = confidence_weight if drafter.confidence_head is not None else 0.0
        self.teacher = reads_target(settings, self.confidence_weight)
        last = (target.config.num_hidden_layers - 1,) if self.teacher else ()
        self.layer_ids = tuple(drafter.target_layer_ids) + last  # as with_last_layer lists them

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Padded or packed batches (DFlash's :meth:`blocks`): the objective over each block's S drafts, with the
        Markov bias of the true previous token, and the confidence head's loss."""
        S = self.drafter.block_size
        batch, anchors, hidden, last = self.blocks(batch)
        labels, valid, prev = block_targets(batch["input_ids"], batch["loss_mask"], anchors, S)
        teacher = None if last is None else block_states(last, anchors, S + 1)  # states at anchor + k
        loss, metrics = dspark_loss(self.drafter, hidden, labels, valid, prev, self.settings, self.confidence_weight,
                                    teacher)
        metrics["blocks_per_row"] = (anchors >= 0).float().sum(1).mean()
        return loss, metrics


class DSparkTraining(DFlashTraining):
    """The DSpark drafter on target features: ``target_features`` from the batch (precomputed) or from a target
    forward per batch (online)."""
    name = "dspark"

    def __init__(self, drafter: DSparkDraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective,
                 confidence_weight: float, online: bool):
        self.module = _DSparkModule(drafter, target, max_anchors, settings, confidence_weight)
        self.required_fields = ("input_ids", "loss_mask") + (() if online else ("target_features",))
