"""Medusa's two training stages as spine strategies.

Medusa (paper sections 2.2.1 and 2.2.2):
- Stage 1 (Medusa-1): the target is frozen and never runs in the loop; heads train on its cached
  last hidden states.
- Stage 2 (Medusa-2): the last N decoder layers of the target train jointly with the heads, at a lower
  learning rate, with a self-distillation term KL(original target || trained target) on next tokens so the
  target's own output drifts as little as possible. The first L - N layers are frozen, so their output is a
  cached state like the last one (:func:`stage2_layers`): a step runs the N trained layers only, and the
  trainer needs to hold no other layer (``model.partial``).

Only trainable modules are registered in each strategy's module (what DDP wraps and checkpoints save);
frozen parts are held outside registration.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from draftheads.drafters.medusa.heads import MedusaHeads, medusa_loss, medusa_targets
from draftheads.models.target import decoder_layers, hidden_states_from
from draftheads.training.objectives import Objective, add_noise, needs_target
from draftheads.training.spine import ModuleStrategy


def next_token_positions(loss_mask: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T]`` bool: positions t whose next token t+1 is trained (the base LM head's label) and, in a packed
    batch (``documents``, each token's row), of the same row."""
    nxt = torch.zeros_like(loss_mask)
    nxt[:, :-1] = loss_mask[:, 1:]
    if documents is not None:
        nxt[:, :-1] &= documents[:, 1:] == documents[:, :-1]
    return nxt


class _Stage1Module(nn.Module):
    def __init__(self, heads: MedusaHeads, lm_head: nn.Module, settings: Objective):
        super().__init__()
        self.heads = heads
        self.frozen = (lm_head,)  # a tuple hides it from registration: not trained, not saved
        self.settings = settings

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        labels, valid = medusa_targets(batch["input_ids"], batch["loss_mask"], self.heads.num_heads,
                                       batch.get("documents"))
        hidden = batch["hidden_states"]
        return medusa_loss(self.heads, add_noise(hidden, self.settings.feature_noise), labels, valid,
                           self.frozen[0], self.settings, hidden if needs_target(self.settings) else None)


class MedusaStage1(ModuleStrategy):
    """Heads only, on cached target hidden states."""
    name = "stage1"
    required_fields = ("input_ids", "loss_mask", "hidden_states")

    def __init__(self, heads: MedusaHeads, target: PreTrainedModel, settings: Objective):
        self.module = _Stage1Module(heads, target.get_output_embeddings(), settings)

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": [p for p in self.module.heads.parameters() if p.requires_grad], "lr": lr}]



def self_distillation(new_logits: torch.Tensor, teacher_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``KL(p_teacher || p_new)`` averaged over positions, and greedy agreement, for ``[N, V]`` logits."""
    teacher = F.log_softmax(teacher_logits.float(), -1)
    new = F.log_softmax(new_logits.float(), -1)
    kl = F.kl_div(new, teacher, log_target=True, reduction="batchmean")
    agree = (new.argmax(-1) == teacher.argmax(-1)).float().mean()
    return kl, agree


def stage2_layers(num_layers: int, n_layers: int) -> tuple[int, ...]:
    """The layer ids whose outputs stage 2 reads (``[T, 2D]`` per row, or ``[T, D]`` when every layer trains):
    the input of the first trained layer ``L - N`` (id ``L - N - 1``) and the last layer's output (id ``L - 1``,
    before the final norm: :func:`split_states` norms it into the last hidden state)."""
    start = num_layers - n_layers
    return (start - 1, num_layers - 1) if start else (num_layers - 1,)


def split_states(rows: list[dict], norm: nn.Module) -> None:
    """Rows' stage-2 ``target_features`` (:func:`stage2_layers`) into ``layer_input`` ``[T, D]`` (absent when
    every layer trains) and ``hidden_states`` ``[T, D]``, the last layer's output through the target's final
    ``norm``: what the LM head reads, as the whole forward gives it. In place; rows split before are left."""
    width = norm.weight.shape[-1]
    with torch.no_grad():
        for r in rows:
            features = r.pop("target_features", None)
            if features is None:
                continue
            if features.shape[-1] == 2 * width:
                layer_input, features = features.split(width, dim=-1)
                r["layer_input"] = layer_input.clone()
            r["hidden_states"] = norm(features.to(norm.weight.device, norm.weight.dtype)).to("cpu", features.dtype)


def trained_hidden_states(target: PreTrainedModel, batch: dict, n_layers: int) -> torch.Tensor:
    """``[B, T, D]`` last hidden states of ``target`` whose last ``n_layers`` layers train: those layers run on
    the batch's cached ``layer_input`` (the whole forward when every layer trains); padded or packed."""
    start = len(decoder_layers(target)) - n_layers
    return hidden_states_from(target, batch["input_ids"], batch.get("attention_mask"), start,
                              batch.get("layer_input"), batch.get("position_ids"))


class _Stage2Module(nn.Module):
    def __init__(self, heads: MedusaHeads, target: PreTrainedModel, n_layers: int, settings: Objective,
                 kl_weight: float):
        super().__init__()
        self.heads = heads
        self.layers = nn.ModuleList(decoder_layers(target)[-n_layers:])  # the same objects as in the target
        self.frozen = (target,)
        self.settings, self.kl_weight = settings, kl_weight

    def forward(self, batch: dict) -> tuple[torch.Tensor, dict]:
        target = self.frozen[0]
        lm_head = target.get_output_embeddings()
        hidden = trained_hidden_states(target, batch, len(self.layers))
        labels, valid = medusa_targets(batch["input_ids"], batch["loss_mask"], self.heads.num_heads,
                                       batch.get("documents"))
        original = batch["hidden_states"]  # the original target's: the teacher of a distillation objective
        head_loss, metrics = medusa_loss(self.heads, add_noise(hidden, self.settings.feature_noise), labels, valid,
                                         lm_head, self.settings, original if needs_target(self.settings) else None)
        positions = next_token_positions(batch["loss_mask"], batch.get("documents"))
        kl, agree = self_distillation(lm_head(hidden[positions]), lm_head(batch["hidden_states"][positions]))
        metrics.update(heads_loss=head_loss.detach(), kl_to_original=kl.detach(), greedy_agreement=agree)
        return head_loss + self.kl_weight * kl, metrics


def check_unfreeze(target: PreTrainedModel, stage2) -> None:
    """``ValueError`` before any work when stage 2 would unfreeze more layers than the target has."""
    n_total = len(decoder_layers(target))
    if stage2.enabled and not 1 <= stage2.unfreeze_last_n_layers <= n_total:
        raise ValueError(f"stage2.unfreeze_last_n_layers={stage2.unfreeze_last_n_layers} must be in 1..{n_total} "
                         f"(the target's decoder layers)")


class MedusaStage2(ModuleStrategy):
    """Heads plus the last ``n_layers`` decoder layers, run on the batch's ``layer_input`` (the frozen layers'
    output, cached); ``hidden_states`` in the batch are the original (stage-1) target's, the teacher of the
    self-distillation term."""
    name = "stage2"

    def __init__(self, heads: MedusaHeads, target: PreTrainedModel, n_layers: int, settings: Objective,
                 kl_weight: float, backbone_lr_scale: float):
        self.module = _Stage2Module(heads, target, n_layers, settings, kl_weight)
        every = n_layers == len(decoder_layers(target))
        self.required_fields = ("input_ids", "loss_mask", "hidden_states", *(() if every else ("layer_input",)))
        self.module.layers.requires_grad_(True)
        self.backbone_lr_scale = backbone_lr_scale

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.module.heads.parameters()), "lr": lr},
                {"params": list(self.module.layers.parameters()), "lr": lr * self.backbone_lr_scale}]

    def adopt(self, module: nn.Module) -> None:
        """The plain trained layers also go back into the target, replacing the sharded ones."""
        self.module = module
        layers = decoder_layers(module.frozen[0])
        for i, layer in zip(range(len(layers) - len(module.layers), len(layers)), module.layers):
            layers[i] = layer

