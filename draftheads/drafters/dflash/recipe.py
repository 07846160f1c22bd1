"""DFlash as a drafter (Chen et al., arXiv 2602.06036): a block-diffusion drafter trained on the target's
multi-layer features, validated teacher-forced, saved as its export (``export/dflash``, what vLLM and SGLang
load), and measured drafting one block per pass (``dflash``) beside iterative denoising (``dflash_denoise<n>``,
greedy only)."""

from __future__ import annotations

from dataclasses import replace

from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import FeatureRecipe, Trained
from draftheads.drafters.dflash.config import DFlashConfig, DFlashRunConfig
from draftheads.drafters.dflash.export import export_dflash, load_dflash
from draftheads.drafters.dflash.model import (
    DFlashDrafter,
    DFlashDraftModel,
    choose_mask_token,
    default_target_layer_ids,
    paper_decay,
)
from draftheads.drafters.dflash.serving import SERVING
from draftheads.drafters.dflash.training import DFlashTraining
from draftheads.drafters.spec import DrafterSpec
from draftheads.models.speculative import Sampling, speculative_decode
from draftheads.serving.preflight import Expect


class DFlash(FeatureRecipe):
    """The DFlash recipe (see :class:`draftheads.drafters.contract.FeatureRecipe`)."""
    spec = DrafterSpec("dflash", DFlashRunConfig, ("dflash", r"dflash_denoise\d+"), serving=SERVING,
                       llamacpp_spec="draft-dflash")

    def default_layers(self, conf: DFlashRunConfig, target) -> list[int]:
        """K = ``<name>.num_target_features`` layers spaced from 1 to L-3, as the paper's (every drafter on DFlash's
        backbone)."""
        return default_target_layer_ids(target.config.num_hidden_layers, self.settings(conf).num_target_features)

    def check_settings(self, conf: DFlashRunConfig, target) -> None:
        """A block of at least two positions (without building the drafter, so the global RNG is drawn from
        where it always was)."""
        if conf.dflash.block_size < 2:
            raise ValueError(f"dflash.block_size={conf.dflash.block_size} must be >= 2 (the anchor plus drafts)")

    def objective(self, conf: DFlashRunConfig) -> DFlashConfig:
        """``<name>``'s objective; ``position_decay`` by default the DFlash paper's for the block size
        (:func:`~draftheads.drafters.dflash.model.paper_decay`: a size without one needs it set)."""
        d = self.settings(conf)
        return d if d.position_decay is not None else replace(d, position_decay=paper_decay(d.block_size))

    def unusable(self, row: dict) -> str | None:
        """A block's anchor is a trainable token followed by one: a row without two in a row has no target."""
        mask = row["loss_mask"]
        if not bool((mask[:-1] & mask[1:]).any()):
            return "no two consecutive trainable tokens, so no DFlash block has a target"
        return None

    def build(self, conf: DFlashRunConfig, target, tokenizer, rows: list[dict]) -> DFlashDraftModel:
        """A fresh drafter for ``target`` from ``conf.dflash`` (layer ids and mask token resolved)."""
        d = conf.dflash
        return self.with_attention(conf, DFlashDraftModel.for_target(
            target, d.num_layers, d.block_size, list(self.drafter_layers(conf, target)),
            self.mask_token(conf, tokenizer, target)))

    def mask_token(self, conf, tokenizer, target) -> int:
        """The token of a block's draft positions: ``<name>.mask_token_id``, else the tokenizer's
        (:func:`~draftheads.drafters.dflash.model.choose_mask_token`; its ``ValueError`` names this drafter's key)."""
        try:
            return choose_mask_token(tokenizer, target.config.vocab_size, self.settings(conf).mask_token_id)
        except ValueError as error:  # DFlash's rule, this drafter's key
            raise ValueError(str(error).replace("dflash.mask_token_id", f"{self.spec.name}.mask_token_id")) from None

    def with_attention(self, conf, drafter):
        """``drafter`` with ``<name>.attention`` set unless it is ``auto`` (the module's own choice)."""
        if self.settings(conf).attention != "auto":
            drafter.attention = self.settings(conf).attention.value
        return drafter

    def describe(self, conf: DFlashRunConfig, drafter: DFlashDraftModel) -> str:
        return (f"{len(drafter.layers)} layers, block {drafter.block_size}, target layers "
                f"{list(drafter.target_layer_ids)}, mask token {drafter.mask_token_id}")

    def training(self, conf: DFlashRunConfig, drafter: DFlashDraftModel, target, online: bool) -> DFlashTraining:
        return DFlashTraining(drafter, target, conf.dflash.max_anchors, self.objective(conf), online=online)

    write_export, read_export = staticmethod(export_dflash), staticmethod(load_dflash)

    def init_fields(self, conf: DFlashRunConfig, target, model: DFlashDraftModel) -> dict[str, tuple]:
        """The target layers and the draft depth (``<name>.num_layers``); the block size shapes no tensor."""
        return super().init_fields(conf, target, model) | {
            f"{self.spec.name}.num_layers": (len(model.layers), self.settings(conf).num_layers)}

    def drafter_config(self, conf: DFlashRunConfig, drafter: DFlashDraftModel) -> dict:
        return {"block_size": drafter.block_size, "num_layers": len(drafter.layers),
                "target_layer_ids": list(drafter.target_layer_ids), "mask_token_id": drafter.mask_token_id,
                "position_decay": self.objective(conf).position_decay}

    def chain(self, conf, trained: Trained, target) -> DFlashDrafter:
        return DFlashDrafter(trained.model)

    def peers(self, conf: DFlashRunConfig, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """Iterative denoising with ``dflash.denoise_steps`` passes per block (greedy only)."""
        d = conf.dflash
        if d.denoise_steps <= 1 or not sampling.greedy:
            return {}
        denoiser = DFlashDrafter(trained.model, d.denoise_steps, d.denoise_confidence)
        stop, n = stop_token_ids(tokenizer, target.generation_config), conf.eval.max_new_tokens
        return {denoiser.name: lambda ids, gen: speculative_decode(target, denoiser, ids, n, stop, sampling, gen)}

    def draft_length(self, conf, trained: Trained) -> int:
        """A block's drafts: its size less the anchor."""
        return trained.model.block_size - 1

    layer_key = "config.json dflash_config.target_layer_ids (vLLM adds 1)"
    mask_key = "config.json dflash_config.mask_token_id"

    def served_reads(self, conf, trained: Trained, target) -> dict[str, Expect]:
        """The layers and draft length (:meth:`FeatureRecipe.served_reads`) and the mask token of the block's
        draft positions."""
        return super().served_reads(conf, trained, target) | {
            "mask_token_id": Expect(trained.model.mask_token_id, self.mask_key)}


DFLASH = DFlash()
