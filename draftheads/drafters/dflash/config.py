"""DFlash's config schema (``conf/dflash.yaml`` extends :class:`DFlashRunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.choice import Choice
from draftheads.training.config import DrafterConfig, RunConfig, StageConfig
from draftheads.training.objectives import PositionWeights


class Attention(Choice):
    """Training attention over many blocks (``dflash.attention``)."""
    auto = "auto"
    flex = "flex"
    sdpa = "sdpa"


@dataclass
class DFlashConfig(DrafterConfig):
    """The DFlash drafter (arXiv 2602.06036) and how it trains (its objective:
    :class:`~draftheads.training.objectives.Objective`) and drafts."""
    block_size: int = 16
    """The anchor plus block_size - 1 drafted tokens per target forward (draft length gamma = block_size - 1)."""
    num_layers: int = 1
    """Draft decoder layers (the paper uses 1-5)."""
    num_target_features: int = 5
    """K target layers read, spaced evenly from layer 1 to L-3 (ignored when target_layer_ids is set)."""
    target_layer_ids: list[int] | None = None
    """Explicit target layer ids; id i is the output of decoder layer i (0-based)."""
    mask_token_id: int | None = None
    """Token at block positions 1..B-1; default: the tokenizer's mask, reserved or a spare special token."""
    max_anchors: int = 512
    """Blocks trained per sequence, anchors drawn at random among response tokens, every epoch anew."""
    loss_decay: float | None = None
    """Removed (``RENAMED`` in draftheads/training/config.py): ``dflash.position_decay``."""
    position_weights: PositionWeights = PositionWeights.dpace
    """D-PACE by default (as speculators and Model Optimizer train DFlash): the default job measured ahead of
    ``decay`` (docs/dflash.md, Results)."""
    position_decay: float | None = None
    """Position k weighs ``position_decay ** k`` under ``position_weights: decay``; default: the paper's
    ``exp(-(k-1)/d)``, d = 7/5/4 for B = 16/10/8, i.e. ``exp(-1/d)`` (0.867 for 16)."""
    attention: Attention = Attention.auto
    """Training attention over many blocks: flex (block-sparse flex_attention, compiled), sdpa (dense boolean
    mask), auto (flex on GPUs, sdpa on CPUs)."""
    features: str | None = None
    """Removed (``RENAMED`` in draftheads/training/config.py): ``data.target_states``."""
    denoise_steps: int = 4
    """Also evaluate iterative denoising with this many passes per block (greedy only); 1 skips it."""
    denoise_confidence: float = 0.9
    """Denoising fixes any position whose top probability reaches this, and stops when all left do."""


@dataclass
class DFlashRunConfig(RunConfig):
    """``train/dflash.py``: DFlash training, evaluation and export (export/dflash)."""
    dflash: DFlashConfig = field(default_factory=DFlashConfig)
    train: StageConfig = field(default_factory=StageConfig)
    output_dir: str = "runs/dflash"
    drafter: str = "dflash"
