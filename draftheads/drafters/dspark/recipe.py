"""DSpark as a drafter (DeepSeek, arXiv 2607.05147): DFlash's recipe (a block drafter on the target's
multi-layer features, validated teacher-forced, saved as its export) with DSpark's heads, block layout and
objective; saved as ``export/dspark`` (what vLLM loads with ``method: dspark``, its Markov head vanilla) and
measured drafting one block per pass with its Markov head, as vLLM drafts, every draft verified (``dspark``) and
as many as vLLM's adaptive verification chooses (``dspark_adaptive``)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import Trained
from draftheads.drafters.dflash.recipe import DFLASH, DFlash
from draftheads.drafters.dspark.adaptive import AdaptiveDSparkDrafter
from draftheads.drafters.dspark.config import DSparkConfig, DSparkRunConfig
from draftheads.drafters.dspark.export import export_dspark, load_dspark
from draftheads.drafters.dspark.model import DSparkDrafter, DSparkDraftModel
from draftheads.drafters.dspark.serving import OTHER_HEADS, SERVING
from draftheads.drafters.dspark.training import DSparkTraining, reads_target
from draftheads.drafters.spec import DrafterSpec
from draftheads.models.speculative import Sampling, speculative_decode
from draftheads.training.objectives import loss_mix

DEEPSPEC_DECAY = math.exp(-1 / 4)
"""DeepSpec's ``loss_decay_gamma=4`` (position k weighs ``exp(-k/4)``) as ``position_decay``."""


class DSpark(DFlash):
    """The DSpark recipe: DFlash's (:class:`~draftheads.drafters.dflash.recipe.DFlash`: which rows it can train
    on, how it trains, saves and reloads), its own settings (``dspark``), drafter, export and decoding."""
    spec = DrafterSpec("dspark", DSparkRunConfig, ("dspark", "dspark_adaptive"), serving=SERVING,
                       llamacpp_spec="draft-dspark", fresh=("markov_head.*", "confidence_head.*"))
    """``fresh``: the heads DFlash has not, fresh when the source lacks them (a DFlash drafter, or a DSpark one
    without a confidence head)."""
    bases = (DFLASH,)
    """A DFlash run or export warm-starts its DFlash part (``dspark.init_from=runs/dflash``)."""

    def check_settings(self, conf: DSparkRunConfig, target) -> None:
        """A block of at least two positions (the DFlash backbone's), a Markov rank of at least 1, a confidence
        weight and a verification cost >= 0 (without building the drafter, so the global RNG is drawn from where it
        always was)."""
        d = conf.dspark
        if d.block_size < 2:
            raise ValueError(f"dspark.block_size={d.block_size} must be >= 2 (the anchor plus noise tokens)")
        if d.markov_rank < 1:
            raise ValueError(f"dspark.markov_rank={d.markov_rank} must be >= 1")
        if d.confidence_weight < 0:
            raise ValueError(f"dspark.confidence_weight={d.confidence_weight} must be >= 0 (0: no confidence head)")
        if d.verify_token_cost < 0:
            raise ValueError(f"dspark.verify_token_cost={d.verify_token_cost} must be >= 0 (0: every draft verified)")

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
        return self.with_attention(conf, DSparkDraftModel.for_target(
            target, d.num_layers, d.block_size, list(self.drafter_layers(conf, target)),
            self.mask_token(conf, tokenizer, target), d.markov_rank, d.confidence_weight > 0, d.confidence_with_markov,
            d.markov_head.head_type))

    def describe(self, conf: DSparkRunConfig, drafter: DSparkDraftModel) -> str:
        confidence = "a confidence head" if drafter.confidence_head is not None else "no confidence head"
        return (f"{len(drafter.layers)} layers, block {drafter.block_size}, target layers "
                f"{list(drafter.target_layer_ids)}, noise token {drafter.mask_token_id}, "
                f"{drafter.config.markov_head_type} Markov head of rank {drafter.config.markov_rank}, {confidence}")

    def training(self, conf: DSparkRunConfig, drafter: DSparkDraftModel, target, online: bool) -> DSparkTraining:
        d = conf.dspark
        return DSparkTraining(drafter, target, d.max_anchors, self.objective(conf), d.confidence_weight, online)

    write_export, read_export = staticmethod(export_dspark), staticmethod(load_dspark)

    def drafter_config(self, conf: DSparkRunConfig, drafter: DSparkDraftModel) -> dict:
        return super().drafter_config(conf, drafter) | {
            "markov_rank": drafter.config.markov_rank, "markov_head_type": drafter.config.markov_head_type,
            "confidence_head": drafter.confidence_head is not None,
            "loss": loss_mix(self.objective(conf).loss, "dspark.loss"),
            "confidence_weight": conf.dspark.confidence_weight}

    def chain(self, conf, trained: Trained, target) -> DSparkDrafter:
        return DSparkDrafter(trained.model)

    def peers(self, conf: DSparkRunConfig, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """Adaptive verification (``dspark_adaptive``: vLLM's ``enable_adaptive_verification`` rule,
        :class:`~draftheads.drafters.dspark.adaptive.AdaptiveDSparkDrafter`) at every temperature, with
        ``dspark.adaptive_verification`` and a confidence head; DFlash's iterative denoising does not apply (every
        position drafts the next token)."""
        d = conf.dspark
        if not d.adaptive_verification or trained.model.confidence_head is None:
            return {}
        drafter = AdaptiveDSparkDrafter(trained.model, d.verify_token_cost, d.adaptive_budget_from)
        stop, n = stop_token_ids(tokenizer, target.generation_config), conf.eval.max_new_tokens
        return {drafter.name: lambda ids, gen: speculative_decode(target, drafter, ids, n, stop, sampling, gen,
                                                                  verify=drafter.verify)}

    def vllm_config(self, run_dir: Path, conf, trained: Trained) -> dict:
        """DFlash's, for a vanilla Markov head; ``ValueError`` for a gated or recurrent one, which vLLM does not
        serve (``qwen3_dspark.py:209-217`` builds the vanilla head whatever ``markov_head_type`` says; its loader
        refuses the other heads' tensors, ``model_executor/models/utils.py:443-448``), before any engine starts."""
        kind = trained.model.config.markov_head_type
        if kind != "vanilla":
            raise ValueError(f"{Path(run_dir) / self.spec.vllm_weights}: markov_head_type {kind!r} "
                             f"(dspark.markov_head) is not served by vLLM: its Qwen3DSparkModel builds only the "
                             f"vanilla Markov head (qwen3_dspark.py:209-217) and refuses the {kind} head's tensors; "
                             f"measure it with draftheads' own evaluator (train/evaluate.py), or train "
                             f"dspark.markov_head=vanilla to serve it")
        return super().vllm_config(run_dir, conf, trained)

    def untrained(self, job, run_dir: Path) -> Trained | None:
        """The serving preflight's untrained export (DFlash's) for a vanilla Markov head; None (no preflight) for a
        gated or recurrent one, which vLLM does not serve (:meth:`vllm_config`)."""
        if job.conf.dspark.markov_head != "vanilla":
            return None
        return super().untrained(job, run_dir)

    def serving_variant(self, conf, trained: Trained) -> str:
        """The row of a gated or recurrent Markov head (no server loads it) when the drafter has one."""
        return OTHER_HEADS if trained.model.config.markov_head_type != "vanilla" else ""

    layer_key = "config.json target_layer_ids (vLLM adds 1)"
    mask_key = "config.json mask_token_id"

    def draft_length(self, conf, trained: Trained) -> int:
        """A block's drafts: one per position, the anchor's included."""
        return trained.model.block_size


DSPARK = DSpark()
