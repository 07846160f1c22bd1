"""DFlash 2 as a drafter: DFlash's recipe (a block drafter on the target's multi-layer features, validated
teacher-forced, saved as its export) with DFlash 2's convolutions, candidate selector and objective; saved as
``export/dflash2`` (what vLLM loads with ``method: dflash`` and ``architectures: ["DFlash2DraftModel"]``) and
measured drafting one block per pass with the selector's walk, as vLLM drafts (``dflash2``)."""

from __future__ import annotations


from draftheads.drafters.contract import Trained
from draftheads.drafters.dflash.recipe import DFLASH, DFlash
from draftheads.drafters.dflash2.config import DFlash2RunConfig
from draftheads.drafters.dflash2.export import export_dflash2, load_dflash2
from draftheads.drafters.dflash2.model import DFlash2Drafter, DFlash2DraftModel
from draftheads.drafters.dflash2.serving import SERVING
from draftheads.drafters.dflash2.training import DFlash2Training
from draftheads.drafters.spec import DrafterSpec
from draftheads.models.speculative import Sampling
from draftheads.training.objectives import loss_mix


class DFlash2(DFlash):
    """The DFlash 2 recipe: DFlash's (:class:`~draftheads.drafters.dflash.recipe.DFlash`: which rows it can train
    on, how it trains, saves and reloads), its own settings (``dflash2``), drafter, export and decoding."""
    spec = DrafterSpec("dflash2", DFlash2RunConfig, ("dflash2",), serving=SERVING, llamacpp_spec="draft-dflash",
                       vllm_method="dflash",
                       fresh=("layers.*.attention_conv.*", "layers.*.mlp_conv.*", "candidate_selector.*"))
    """``vllm_method``: DFlash's runtime, the export's architecture (``DFlash2DraftModel``) choosing the speculator
    (``v1/worker/gpu/spec_decode/__init__.py:34``; speculators' ``update_dflash2``). ``fresh``: what DFlash has not,
    the convolutions (at the identity, so the warm start drafts as its DFlash) and the selector."""
    bases = (DFLASH,)
    """A DFlash run or export warm-starts its DFlash part (``dflash2.init_from=runs/dflash``), as speculators
    starts DFlash 2."""

    def llamacpp_unread(self, conf: DFlash2RunConfig, trained: Trained, target) -> list[str]:
        """DFlash's (:meth:`~draftheads.drafters.contract.FeatureRecipe.llamacpp_unread`), and a selector whose top-k
        lattice does not fit the hidden size as llama.cpp lays it out (``src/models/dflash.cpp:149-150``: it refuses a
        hidden size under top-k * (top-k + 1))."""
        k, width = trained.model.config.dflash_config["selector_top_k"], trained.model.config.hidden_size
        lattice = [] if width >= k * (k + 1) else [
            f"dflash2.selector_top_k={k}: llama.cpp lays the selector's lattice out in the hidden state and refuses a "
            f"hidden size under top-k * (top-k + 1) = {k * (k + 1)} (this drafter's: {width}; "
            f"src/models/dflash.cpp:149-150)"]
        return super().llamacpp_unread(conf, trained, target) + lattice

    def check_settings(self, conf: DFlash2RunConfig, target) -> None:
        """DFlash's block, the convolution's taps within it and its groups dividing the width, a selector of rank
        >= 1 with top-k within the vocabulary, a selector weight >= 0 (without building the drafter, so the global
        RNG is drawn from where it always was)."""
        d, width, vocab = conf.dflash2, target.config.hidden_size, target.config.vocab_size
        bad = {"block_size": d.block_size >= 2, "conv_kernel_size": 1 <= d.conv_kernel_size <= d.block_size,
               "conv_group_size": d.conv_group_size >= 1 and width % d.conv_group_size == 0,
               "selector_rank": d.selector_rank >= 1, "selector_top_k": 1 <= d.selector_top_k <= vocab,
               "selector_weight": d.selector_weight >= 0}
        for key, fine in bad.items():
            if not fine:
                raise ValueError(f"dflash2.{key}={getattr(d, key)}: a block of >= 2, taps in 1..block_size, a group "
                                 f"size dividing the target's width {width}, rank >= 1, top-k in 1..{vocab}, a "
                                 f"selector weight >= 0")

    def build(self, conf: DFlash2RunConfig, target, tokenizer, rows: list[dict]) -> DFlash2DraftModel:
        """A fresh drafter for ``target`` from ``conf.dflash2`` (layer ids and mask token resolved)."""
        d = conf.dflash2
        return self.with_attention(conf, DFlash2DraftModel.for_target(
            target, d.num_layers, d.block_size, list(self.drafter_layers(conf, target)),
            self.mask_token(conf, tokenizer, target), d.conv_kernel_size, d.conv_group_size, d.selector_rank,
            d.selector_top_k))

    def describe(self, conf: DFlash2RunConfig, drafter: DFlash2DraftModel) -> str:
        d = drafter.config.dflash_config
        return (f"{len(drafter.layers)} layers, block {drafter.block_size}, target layers "
                f"{list(drafter.target_layer_ids)}, mask token {drafter.mask_token_id}, {d['conv_kernel_size']}-tap "
                f"convolutions in groups of {d['conv_group_size']}, a selector of rank {d['selector_rank']} over the "
                f"top {d['selector_top_k']}")

    def training(self, conf: DFlash2RunConfig, drafter: DFlash2DraftModel, target, online: bool) -> DFlash2Training:
        return DFlash2Training(drafter, target, conf.dflash2.max_anchors, self.objective(conf),
                               conf.dflash2.selector_weight, online=online)

    write_export, read_export = staticmethod(export_dflash2), staticmethod(load_dflash2)

    def drafter_config(self, conf: DFlash2RunConfig, drafter: DFlash2DraftModel) -> dict:
        return super().drafter_config(conf, drafter) | {
            key: drafter.config.dflash_config[key]
            for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} | {
            "loss": loss_mix(self.objective(conf).loss, "dflash2.loss"),
            "selector_weight": conf.dflash2.selector_weight}

    def chain(self, conf, trained: Trained, target) -> DFlash2Drafter:
        return DFlash2Drafter(trained.model)

    def peers(self, conf: DFlash2RunConfig, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """None: DFlash's iterative denoising does not apply (the selector walks the block in one pass)."""
        return {}


DFLASH2 = DFlash2()
