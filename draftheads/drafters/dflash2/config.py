"""DFlash 2's config schema (``conf/dflash2.yaml`` extends :class:`DFlash2RunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.drafters.dflash.config import DFlashConfig
from draftheads.training.config import RunConfig, StageConfig


@dataclass
class DFlash2Config(DFlashConfig):
    """The DFlash 2 drafter: DFlash's (:class:`~draftheads.drafters.dflash.config.DFlashConfig`: layers, block,
    target layers, mask token, anchors, objective) with its convolutions and candidate selector. Defaults are
    speculators 0.9.0's (``dflash2/config.py``, ``core.py: get_trainer_kwargs``) but for the block (the paper's 8)."""
    block_size: int = 8
    """The anchor plus block_size - 1 drafted tokens per target forward; also the convolutions' block (vLLM:
    ``1 + num_speculative_tokens``)."""
    conv_kernel_size: int = 2
    """Taps of each grouped dynamic convolution (position k reads k and k-1 with 2)."""
    conv_group_size: int = 16
    """Hidden channels sharing one dynamic coefficient (must divide the hidden size)."""
    selector_rank: int = 256
    """Rank r of the candidate selector's codebooks (``[V, r]`` each) and hidden projection."""
    selector_top_k: int = 16
    """Candidates per drafted position: the LM head's top-k, rescored by the selector."""
    selector_weight: float = 1.0
    """Weight of the selector's K-way cross-entropy beside the unary objective (speculators'
    ``selector_loss_alpha``)."""
    denoise_steps: int = 1
    """DFlash's iterative denoising does not apply (the selector walks one pass); 1 measures none."""


@dataclass
class DFlash2RunConfig(RunConfig):
    """``train/dflash2.py``: DFlash 2 training, evaluation and export (export/dflash2)."""
    dflash2: DFlash2Config = field(default_factory=DFlash2Config)
    train: StageConfig = field(default_factory=StageConfig)
    output_dir: str = "runs/dflash2"
    drafter: str = "dflash2"
