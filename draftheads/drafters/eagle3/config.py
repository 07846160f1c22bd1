"""EAGLE-3's config schema (``conf/eagle3.yaml`` extends :class:`Eagle3RunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftheads.training.config import DrafterConfig, RunConfig, StageConfig


@dataclass
class Eagle3Config(DrafterConfig):
    """The EAGLE-3 drafter (Li et al., arXiv 2503.01840) and how it trains (its objective:
    :class:`~draftheads.training.objectives.Objective`) and drafts."""
    target_layer_ids: list[int] | None = None
    """The target layers fused by ``fc`` (low, middle, high); id i is the output of decoder layer i (0-based),
    as DFlash's. Default ``[1, L//2 - 1, L - 4]``: the layers vLLM reads for a target that names none (its ids
    ``(2, L//2, L-3)`` count layer inputs). The export writes vLLM's ids (each + 1)."""
    draft_vocab_size: int = 32000
    """The drafter's own LM head covers this many target tokens, the most frequent trained tokens of the rows
    (capped at the target's vocabulary; equal to it: no ``d2t`` mapping)."""
    ttt_steps: int = 7
    """Training-time test: the drafter is unrolled this many steps per position, step j > 1 fed its own hidden
    state of step j-1 (the paper's 7)."""
    step_decay: float | None = None
    """Removed (``RENAMED`` in draftheads/training/config.py): ``eagle3.position_decay``."""
    position_decay: float | None = 0.8
    """Step k weighs ``position_decay ** k`` under ``position_weights: decay`` (the EAGLE-3 reference's 0.8);
    the loss is normalised by the weights' sum."""
    gamma: int = 5
    """Draft length when decoding: tokens proposed per verification (vLLM's ``num_speculative_tokens``)."""
    fc_norm: bool = False
    """EAGLE-3.1 (arXiv 2605.09992): an RMSNorm on each target feature before ``fc`` (weights
    ``fc_norm.{k}.weight``, ``[target hidden]`` each), so that layers of different scales enter the fusion alike.
    Exported as vLLM reads it: config ``fc_norm`` (vLLM 0.32 ``llama_eagle3.py:231``, applied per chunk in
    ``combine_hidden_states``, :414)."""
    norm_before_fc: bool = True
    """One RMSNorm over the concatenated features before ``fc`` (weight ``input_norm.weight``, ``[K * target
    hidden]``), applied before ``fc_norm`` when both are on. Config ``norm_before_fc`` (vLLM 0.32
    ``llama_eagle3.py:184``, which reads ``eagle_config`` first). On by default, and read by every server: with
    ``norm_output`` it measured ahead of neither, and without it level with both (docs/eagle3.md, Results); all
    off: the EAGLE-3 drafter of the paper."""
    norm_output: bool = False
    """EAGLE-3.1: each step (training-time test and drafting alike) is fed the previous step's hidden state
    after the final ``norm`` instead of before it (config ``norm_output``; vLLM 0.32 ``llama_eagle3.py:286``).
    Off by default since 2026-12-06: on and off measured level (+0.01 [-0.03, 0.05] tau, 64 chitchat prompts,
    docs/eagle3.md), and llama.cpp b11434 cannot read it (``src/models/eagle3.cpp:279-288``)."""
    norm_before_residual: bool = False
    """The decoder layer's residual stream starts at ``hidden_norm(h)`` instead of the fused feature ``h``
    (config ``norm_before_residual``; vLLM 0.32 ``llama_eagle3.py:101-122``; on in speculators' defaults). SGLang
    0.5.23 does not read the key and would serve such an export on the other residual (docs/serving.md)."""
    features: str | None = None
    """Removed (``RENAMED`` in draftheads/training/config.py): ``data.target_states``."""


@dataclass
class Eagle3RunConfig(RunConfig):
    """``train/eagle3.py``: EAGLE-3 training, evaluation and export (export/eagle3)."""
    eagle3: Eagle3Config = field(default_factory=Eagle3Config)
    train: StageConfig = field(default_factory=StageConfig)
    output_dir: str = "runs/eagle3"
    drafter: str = "eagle3"
