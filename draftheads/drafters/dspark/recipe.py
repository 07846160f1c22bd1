"""DSpark as a drafter (DeepSeek, arXiv 2607.05147): DFlash's recipe (a block drafter on the target's
multi-layer features, validated teacher-forced, saved as its export) with DSpark's heads, block layout and
objective; saved as ``export/dspark`` (what vLLM loads with ``method: dspark``) and measured drafting one block
per pass with its Markov head, as vLLM drafts (``dspark``)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from draftheads.drafters.dflash.model import choose_mask_token, default_target_layer_ids
from draftheads.drafters.dflash.recipe import DFlash
from draftheads.drafters.dspark.config import DSparkConfig, DSparkRunConfig
from draftheads.drafters.dspark.export import export_dspark, load_dspark
from draftheads.drafters.dspark.model import DSparkDraftModel, DSparkDrafter
from draftheads.drafters.dspark.serving import SERVING
from draftheads.drafters.dspark.training import DSparkTraining, reads_target
from draftheads.models.speculative import Sampling
from draftheads.training.objectives import loss_mix
from draftheads.training.recipe import Trained

DEEPSPEC_DECAY = math.exp(-1 / 4)
"""DeepSpec's ``loss_decay_gamma=4`` (position k weighs ``exp(-k/4)``) as ``position_decay``."""


class DSpark(DFlash):
    """The DSpark recipe: DFlash's (:class:`~draftheads.drafters.dflash.recipe.DFlash`: which rows it can train
    on, how it trains, saves and reloads), its own settings (``dspark``), drafter, export and decoding."""
    name = "dspark"
    schema = DSparkRunConfig
    serving = SERVING

    def default_layers(self, conf: DSparkRunConfig, target) -> list[int]:
        """K = ``dspark.num_target_features`` layers spaced from 1 to L-3, as DFlash's (DeepSpec's
        ``[1, 9, 17, 25, 33]`` for Qwen3's 36)."""
        return default_target_layer_ids(target.config.num_hidden_layers, conf.dspark.num_target_features)

    def check_settings(self, conf: DSparkRunConfig, target) -> None:
        """A block of at least two positions (the DFlash backbone's), a Markov rank of at least 1, a confidence
        weight >= 0 (without building the drafter, so the global RNG is drawn from where it always was)."""
        d = conf.dspark
        if d.block_size < 2:
            raise ValueError(f"dspark.block_size={d.block_size} must be >= 2 (the anchor plus noise tokens)")
        if d.markov_rank < 1:
            raise ValueError(f"dspark.markov_rank={d.markov_rank} must be >= 1")
        if d.confidence_weight < 0:
            raise ValueError(f"dspark.confidence_weight={d.confidence_weight} must be >= 0 (0: no confidence head)")

    def objective(self, conf: DSparkRunConfig) -> DSparkConfig:
        """``dspark``'s objective; ``position_decay`` by default DeepSpec's ``exp(-1/4)``."""
        d = conf.dspark
        return d if d.position_decay is not None else replace(d, position_decay=DEEPSPEC_DECAY)

    def state_layers(self, conf: DSparkRunConfig, target) -> tuple[int, ...]:
        """The drafter's layers, and the last one when training reads the target's distribution (a distillation
        objective or the confidence head: :func:`~draftheads.drafters.dspark.training.reads_target`)."""
        d, last = conf.dspark, target.config.num_hidden_layers - 1
        return self.drafter_layers(conf, target) + ((last,) if reads_target(d, d.confidence_weight) else ())

    def build(self, conf: DSparkRunConfig, target, tokenizer, rows: list[dict]) -> DSparkDraftModel:
        """A fresh drafter for ``target`` from ``conf.dspark`` (layer ids and noise token resolved)."""
        d = conf.dspark
        try:
            mask = choose_mask_token(tokenizer, target.config.vocab_size, d.mask_token_id)
        except ValueError as error:  # DFlash's rule, DSpark's key
            raise ValueError(str(error).replace("dflash.mask_token_id", "dspark.mask_token_id")) from None
        drafter = DSparkDraftModel.for_target(target, d.num_layers, d.block_size,
                                              list(self.drafter_layers(conf, target)), mask, d.markov_rank,
                                              d.confidence_weight > 0, d.confidence_with_markov)
        if d.attention != "auto":
            drafter.attention = d.attention.value
        return drafter

    def describe(self, conf: DSparkRunConfig, drafter: DSparkDraftModel) -> str:
        confidence = "a confidence head" if drafter.confidence_head is not None else "no confidence head"
        return (f"{len(drafter.layers)} layers, block {drafter.block_size}, target layers "
                f"{list(drafter.target_layer_ids)}, noise token {drafter.mask_token_id}, Markov rank "
                f"{drafter.config.markov_rank}, {confidence}")

    def training(self, conf: DSparkRunConfig, drafter: DSparkDraftModel, target, online: bool) -> DSparkTraining:
        d = conf.dspark
        return DSparkTraining(drafter, target, d.max_anchors, self.objective(conf), d.confidence_weight, online)

    def write_export(self, drafter: DSparkDraftModel, folder: Path) -> Path:
        return export_dspark(drafter, folder)

    def read_export(self, folder: Path, target) -> DSparkDraftModel:
        return load_dspark(folder, target)

    def drafter_config(self, conf: DSparkRunConfig, drafter: DSparkDraftModel) -> dict:
        objective = self.objective(conf)
        return {"block_size": drafter.block_size, "num_layers": len(drafter.layers),
                "target_layer_ids": list(drafter.target_layer_ids), "mask_token_id": drafter.mask_token_id,
                "markov_rank": drafter.config.markov_rank, "confidence_head": drafter.confidence_head is not None,
                "loss": loss_mix(objective.loss, "dspark.loss"), "confidence_weight": conf.dspark.confidence_weight,
                "position_decay": objective.position_decay}

    def chain(self, conf, trained: Trained, target) -> DSparkDrafter:
        return DSparkDrafter(trained.model)

    def peers(self, conf: DSparkRunConfig, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """None of its own (DFlash's iterative denoising does not apply: every position drafts the next token)."""
        return {}

    def draft_length(self, conf, trained: Trained) -> int:
        """A block's drafts: one per position, the anchor's included."""
        return trained.model.block_size


DSPARK = DSpark()
