"""Medusa's config schema (``conf/medusa.yaml`` extends :class:`MedusaRunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.training.config import DrafterConfig, RunConfig, StageConfig


@dataclass
class MedusaConfig(DrafterConfig):
    """The Medusa heads (arXiv 2401.10774) and their objective (:class:`~draftheads.training.objectives.Objective`,
    in both stages; a distillation objective's target is the original target's distribution)."""
    num_heads: int = 4
    num_layers: int = 1
    """Residual blocks per head."""
    per_head_lm_head: bool = False
    """Give every head its own LM head (initialised from the target's); default shares the frozen one."""
    decay: float | None = None
    """Removed (``RENAMED`` in draftheads/training/config.py): ``medusa.position_decay``."""
    position_decay: float | None = 0.8
    """Head k weighs ``position_decay ** k`` under ``position_weights: decay`` (Medusa paper eq. 2, lambda_k;
    its code's 0.8), each head's loss a mean over its positions."""


@dataclass
class TreeConfig:
    """Medusa's tree verification, measured beside the heads' chain (``medusa_tree``; with typical acceptance,
    at t > 0 or with ``typical``, ``medusa_tree_typical``)."""
    enabled: bool = True
    choices: list[list[int]] | None = None
    """The tree as paths of top-k indices (Medusa's ``medusa_choices`` format); default: grown from the heads'
    measured rank accuracies for ``budget`` nodes."""
    budget: int = 64
    typical: bool = False
    """Typical acceptance at temperature 0 too (Medusa paper eq. 3): faster, not lossless; reported as such."""
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3


@dataclass
class Stage2Config(StageConfig):
    """Medusa-2: heads and the target's last decoder layers trained jointly."""
    unfreeze_last_n_layers: int = 4
    """Decoder layers unfrozen, taken from the end of the model's own layer list."""
    backbone_lr_scale: float = 0.1
    """Learning rate of the unfrozen layers = trainer.lr * backbone_lr_scale."""
    kl_weight: float = 1.0
    """Weight of the self-distillation term KL(original target || trained target) on next tokens."""


@dataclass
class MedusaRunConfig(RunConfig):
    """``train/medusa.py``: two-stage Medusa training, evaluation and export (export/vllm, export/tgi, and
    export/target after stage 2)."""
    medusa: MedusaConfig = field(default_factory=MedusaConfig)
    stage1: StageConfig = field(default_factory=StageConfig)
    stage2: Stage2Config = field(default_factory=Stage2Config)
    tree: TreeConfig = field(default_factory=TreeConfig)
    output_dir: str = "runs/medusa"
    drafter: str = "medusa"
