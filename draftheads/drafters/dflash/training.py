"""DFlash training as a spine strategy (arXiv 2602.06036, section 3): the drafter trains on the target's
multi-layer features (cached or computed per batch), many random blocks per sequence in one pass, with its
objective weighted per block position (:mod:`draftheads.training.objectives`). Only the drafter is registered
(what DDP wraps and checkpoints save); the target is held outside registration.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from draftheads.data.batching import unpack
from draftheads.data.hidden_states import batch_features
from draftheads.drafters.dflash.model import DFlashDraftModel, block_labels, block_states, dflash_loss, sample_anchors
from draftheads.training.objectives import Objective, add_noise, needs_target, split_last, with_last_layer
from draftheads.training.spine import ModuleStrategy


class _DFlashModule(nn.Module):
    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective):
        super().__init__()
        self.drafter = drafter
        self.frozen = (target,)
        self.max_anchors, self.settings = max_anchors, settings
        self.teacher = needs_target(settings)  # the features end in the target's last layer (DSpark's may set it)
        self.layer_ids = with_last_layer(drafter.target_layer_ids, settings, target.config.num_hidden_layers)

    def blocks(self, batch: dict) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The drafter's pass over a batch's blocks, shared by DFlash and DSpark (``dspark/training.py``).

        Padded or packed batches: a packed batch's target features come from its packed sequence, and the drafter
        reads its rows one per line (:func:`~draftheads.data.batching.unpack`: its blocks attend within a row).
        Returns ``(batch, anchors, hidden, last)``: the batch as the drafter read it (unpacked: ``[R, T]`` fields),
        ``anchors`` ``[R, A]`` int64 (-1: no block; :func:`~draftheads.drafters.dflash.model.sample_anchors`, the
        global RNG, then the feature noise's, so a resumed run draws the same), the drafter's output ``hidden``
        ``[R, A, S, D]`` and, when :attr:`teacher`, the target's last hidden states ``[R, T, D]`` (through its final
        norm: :func:`~draftheads.training.objectives.split_last`), else None. Raises what
        :func:`~draftheads.data.hidden_states.batch_features` raises for a batch without its features."""
        target = self.frozen[0]
        features = batch_features(batch, target, self.layer_ids)
        if "documents" in batch:
            batch = unpack({**batch, "target_features": features})
            features = batch["target_features"]
        last = None
        if self.teacher:
            features, last = split_last(features, target)
        anchors = sample_anchors(batch["loss_mask"], self.max_anchors)  # global RNG: checkpointed, resumes exactly
        features = add_noise(features, self.settings.feature_noise)
        hidden = self.drafter(features, batch["input_ids"], batch["attention_mask"], anchors)
        return batch, anchors, hidden, last

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Padded or packed batches (:meth:`blocks`): the objective over each block's S - 1 drafts."""
        S = self.drafter.block_size
        batch, anchors, hidden, last = self.blocks(batch)
        labels, valid = block_labels(batch["input_ids"], batch["loss_mask"], anchors, S)
        loss, metrics = dflash_loss(self.drafter, hidden, labels, valid, self.settings,
                                    None if last is None else block_states(last, anchors, S))
        metrics["blocks_per_row"] = (anchors >= 0).float().sum(1).mean()
        return loss, metrics


class DFlashTraining(ModuleStrategy):
    """The DFlash drafter on target features: ``target_features`` from the batch (precomputed) or from a target
    forward per batch (online)."""
    name = "dflash"
    unpacks = True

    def __init__(self, drafter: DFlashDraftModel, target: PreTrainedModel, max_anchors: int, settings: Objective,
                 online: bool):
        self.module = _DFlashModule(drafter, target, max_anchors, settings)
        self.required_fields = ("input_ids", "loss_mask") + (() if online else ("target_features",))

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.module.drafter.parameters()), "lr": lr}]
