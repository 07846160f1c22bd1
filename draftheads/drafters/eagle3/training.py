"""EAGLE-3 training as a spine strategy (arXiv 2503.01840, section 3.2): the drafter unrolled ``ttt_steps`` steps
over whole sequences of the target's three-layer features (cached or computed per batch), its objective at every
step (:mod:`draftheads.training.objectives`). Only the drafter is registered (what DDP wraps and checkpoints save);
the target is held outside registration.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from draftheads.data.batching import unpack
from draftheads.data.hidden_states import batch_features
from draftheads.drafters.eagle3.model import Eagle3DraftModel, eagle3_loss
from draftheads.training.objectives import Objective, add_noise, needs_target, split_last, with_last_layer
from draftheads.training.spine import ModuleStrategy


class _Eagle3Module(nn.Module):
    def __init__(self, drafter: Eagle3DraftModel, target: PreTrainedModel, steps: int, settings: Objective):
        super().__init__()
        self.drafter = drafter
        self.frozen = (target,)
        self.steps, self.settings = steps, settings
        self.layer_ids = with_last_layer(drafter.target_layer_ids, settings, target.config.num_hidden_layers)

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        """Padded or packed batches: a packed batch's target features come from its packed sequence, and the drafter
        reads its rows one per line (:func:`~draftheads.data.batching.unpack`: its steps attend within a row)."""
        target = self.frozen[0]
        features = batch_features(batch, target, self.layer_ids)
        if "documents" in batch:
            batch = unpack({**batch, "target_features": features})
            features = batch["target_features"]
        last = None
        if needs_target(self.settings):
            features, last = split_last(features, target)
        features = add_noise(features, self.settings.feature_noise)
        hidden = self.drafter(features, batch["input_ids"], batch["attention_mask"], self.steps)
        return eagle3_loss(self.drafter, hidden, batch["input_ids"], batch["loss_mask"], self.settings,
                           None if last is None else (last, target.get_output_embeddings()))


class Eagle3Training(ModuleStrategy):
    """The EAGLE-3 drafter on target features: ``target_features`` from the batch (precomputed) or from a target
    forward per batch (online)."""
    name = "eagle3"
    unpacks = True

    def __init__(self, drafter: Eagle3DraftModel, target: PreTrainedModel, steps: int, settings: Objective,
                 online: bool):
        self.module = _Eagle3Module(drafter, target, steps, settings)
        self.required_fields = ("input_ids", "loss_mask") + (() if online else ("target_features",))

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.module.drafter.parameters()), "lr": lr}]
