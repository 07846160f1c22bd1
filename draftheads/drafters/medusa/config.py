"""Medusa's config schema (``conf/medusa.yaml`` extends :class:`MedusaRunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.training.config import RunConfig, StageConfig


@dataclass
class MedusaConfig:
    """The Medusa heads (arXiv 2401.10774)."""
    num_heads: int = 4
    num_layers: int = 1
    """Residual blocks per head."""
    per_head_lm_head: bool = False
    """Give every head its own LM head (initialised from the target's); default shares the frozen one."""
    decay: float = 0.8
    """Head k's loss weight is decay^k."""


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
    output_dir: str = "runs/medusa"
    drafter: str = "medusa"
