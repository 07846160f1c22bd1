"""DSpark's config schema (``conf/dspark.yaml`` extends :class:`DSparkRunConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftheads.choice import Choice
from draftheads.drafters.dflash.config import Attention
from draftheads.training.config import DrafterConfig, RunConfig, StageConfig


class MarkovHead(Choice):
    """The Markov head's form (``dspark.markov_head``), as the paper's code (deepseek-ai/DeepSpec
    ``deepspec/modeling/dspark/markov_head.py``) defines them: ``vanilla`` (``VanillaMarkov``, :8-90), the only one
    vLLM 0.32 serves (``qwen3_dspark.py:209-217`` builds it whatever the config says); ``gated``
    (``GatedMarkovHead``, :93-122) and ``recurrent`` (``RNNHead``, :125-284; ``markov_head_type: rnn`` in
    ``config.json``), decoded by draftheads' evaluator only."""
    vanilla = "vanilla"
    gated = "gated"
    recurrent = "recurrent"

    @property
    def head_type(self) -> str:
        """The ``markov_head_type`` of ``config.json`` (DeepSpec's word: ``rnn`` for ``recurrent``)."""
        return "rnn" if self is MarkovHead.recurrent else self.value


class BudgetFrom(Choice):
    """Whose confidences size adaptive verification's budget (``dspark.adaptive_budget_from``)."""
    previous = "previous"
    """vLLM 0.32's: the previous block's (it copies them to the CPU a step behind, ``adaptive_verification.py``
    :167-181, :262-270, read at :309; all ones at a request's first block, :183-186)."""
    current = "current"
    """The block's own (no pipelining delay)."""


@dataclass
class DSparkConfig(DrafterConfig):
    """The DSpark drafter (DeepSeek, arXiv 2607.05147): a DFlash backbone, a low-rank Markov head on the token
    drafted before each position and a confidence head; how it trains (its objective:
    :class:`~draftheads.training.objectives.Objective`) and drafts. Defaults are DeepSpec's
    (``config/dspark/dspark_qwen3_8b.py``) but for the depth and anchors, sized for CPUs in ``conf/dspark.yaml``."""
    loss: Any = field(default_factory=lambda: {"ce": 0.1, "tv": 1.8})
    """DeepSpec's ``ce_loss_alpha=0.1`` and ``l1_loss_alpha=0.9``: its L1 distance ``sum_v |q_v - p_v|`` is twice
    the total variation ``tv`` = ``1 - alpha``, so 0.9 x L1 = 1.8 x tv."""
    block_size: int = 7
    """Block positions per draft pass: the anchor (the last verified token) and block_size - 1 noise tokens; every
    position drafts the token after it, so the draft length gamma is block_size (vLLM's num_speculative_tokens)."""
    num_layers: int = 1
    """Draft decoder layers (DeepSpec trains 5)."""
    num_target_features: int = 5
    """K target layers read, spaced evenly from layer 1 to L-3 (ignored when target_layer_ids is set)."""
    target_layer_ids: list[int] | None = None
    """Explicit target layer ids; id i is the output of decoder layer i (0-based)."""
    mask_token_id: int | None = None
    """The noise token at block positions 1..B-1; default: the tokenizer's mask, reserved or a spare special token."""
    max_anchors: int = 512
    """Blocks trained per sequence, anchors drawn at random among response tokens, every epoch anew."""
    markov_rank: int = 256
    """Rank r of the Markov head: the bias on position k's logits is ``markov_w2(markov_w1[x_{k-1}])``."""
    markov_head: MarkovHead = MarkovHead.vanilla
    """The Markov head's form: vanilla (what vLLM serves), gated or recurrent (:class:`MarkovHead`; exported, and
    refused for vLLM)."""
    confidence_weight: float = 1.0
    """Weight of the confidence head's binary cross-entropy against each position's acceptance probability
    ``alpha`` (DeepSpec's ``confidence_head_alpha``); 0 builds no confidence head. The head reads the target's
    distribution, so it trains with the target's last layer as a distillation objective does."""
    confidence_with_markov: bool = True
    """The confidence head reads the Markov embedding of the previous token beside the position's hidden state."""
    attention: Attention = Attention.auto
    """Training attention over many blocks: flex (block-sparse flex_attention, compiled), sdpa (dense boolean
    mask), auto (flex on GPUs, sdpa on CPUs)."""
    adaptive_verification: bool = True
    """Measure adaptive verification beside fixed-length verification (the peer ``dspark_adaptive``: vLLM 0.32's
    ``enable_adaptive_verification`` rule, :mod:`draftheads.drafters.dspark.adaptive`); needs the confidence head."""
    verify_token_cost: float = 0.1
    """Adaptive verification's cost model: a step verifying b drafts costs ``1 + verify_token_cost * b`` (1: the
    step with no draft verified, the draft pass included). vLLM profiles these costs on its GPU at startup
    (``adaptive_verification.py:188-253``), so it has no such number; 0 verifies every draft (a flat cost:
    fixed-length verification), larger values trim drafts of lower survival probability."""
    adaptive_budget_from: BudgetFrom = BudgetFrom.previous
    """Whose confidences size the budget: the previous block's (vLLM's) or the current one's."""
    position_decay: float | None = None
    """Position k weighs ``position_decay ** k`` under ``position_weights: decay``; default DeepSpec's
    ``loss_decay_gamma=4``: ``exp(-1/4)``."""


@dataclass
class DSparkRunConfig(RunConfig):
    """``train/dspark.py``: DSpark training, evaluation and export (export/dspark)."""
    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    train: StageConfig = field(default_factory=StageConfig)
    output_dir: str = "runs/dspark"
    drafter: str = "dspark"
