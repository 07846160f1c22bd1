"""DFlash as a drafter (Chen et al., arXiv 2602.06036): a block-diffusion drafter trained on the target's
multi-layer features, validated teacher-forced, saved as its export (``export/dflash``, what vLLM and SGLang
load), and measured drafting one block per pass (``dflash``) beside iterative denoising (``dflash_denoise<n>``,
greedy only)."""

from __future__ import annotations

from pathlib import Path

from draftheads.data.templates import stop_token_ids
from draftheads.drafters.dflash.config import DFlashRunConfig
from draftheads.drafters.dflash.export import export_dflash, load_dflash
from draftheads.drafters.dflash.model import (DFlashDraftModel, DFlashDrafter, choose_mask_token, default_decay,
                                              default_target_layer_ids)
from draftheads.drafters.dflash.training import DFlashTraining
from draftheads.models.speculative import Sampling, speculative_decode
from draftheads.models.target import TargetSpec
from draftheads.training.config import Features
from draftheads.training.held_out import held_out_metrics
from draftheads.training.recipe import Trained
from draftheads.training.runtime import print0
from draftheads.training.spine import fit

EXPORT = "export/dflash"


class DFlash:
    """The DFlash recipe (see :class:`draftheads.training.recipe.Recipe`)."""
    name = "dflash"
    schema = DFlashRunConfig
    stages = ("dflash",)
    vllm_weights = EXPORT

    def check(self, conf: DFlashRunConfig, target) -> None:
        """Layer ids inside the target, a block of at least two positions and its loss decay (without building
        the drafter, so the global RNG is drawn from where it always was)."""
        layers, n = self.state_layers(conf, target), target.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"dflash.target_layer_ids: {bad} are outside 0..{n - 1} (the target's decoder layers)")
        if conf.dflash.block_size < 2:
            raise ValueError(f"dflash.block_size={conf.dflash.block_size} must be >= 2 (the anchor plus drafts)")
        _decay(conf)  # a block size without a paper decay needs dflash.loss_decay: say so now

    def state_layers(self, conf: DFlashRunConfig, target) -> tuple[int, ...]:
        """``dflash.target_layer_ids``, else K spaced from 1 to L-3."""
        d = conf.dflash
        return tuple(d.target_layer_ids or default_target_layer_ids(target.config.num_hidden_layers,
                                                                     d.num_target_features))

    def unusable(self, row: dict) -> str | None:
        """A block's anchor is a trainable token followed by one: a row without two in a row has no target."""
        mask = row["loss_mask"]
        if not bool((mask[:-1] & mask[1:]).any()):
            return "no two consecutive trainable tokens, so no DFlash block has a target"
        return None

    def attach_states(self, conf: DFlashRunConfig) -> bool:
        return conf.dflash.features == Features.precomputed

    def build(self, conf: DFlashRunConfig, target, tokenizer) -> DFlashDraftModel:
        """A fresh drafter for ``target`` from ``conf.dflash`` (layer ids and mask token resolved)."""
        d = conf.dflash
        mask = choose_mask_token(tokenizer, target.config.vocab_size, d.mask_token_id)
        drafter = DFlashDraftModel.for_target(target, d.num_layers, d.block_size, list(self.state_layers(conf, target)),
                                              mask)
        if d.attention != "auto":
            drafter.attention = d.attention.value
        return drafter

    def train(self, job, rows: list[dict]) -> Trained:
        conf: DFlashRunConfig = job.conf
        d, target = conf.dflash, job.target
        drafter = self.build(conf, target, job.tokenizer)
        print0(job.accelerator, f"drafter: {d.num_layers} layers, block {d.block_size}, target layers "
                                f"{list(drafter.target_layer_ids)}, mask token {drafter.mask_token_id}")
        strategy = DFlashTraining(drafter, target, d.max_anchors, _decay(conf), online=not self.attach_states(conf))
        state = fit(job.accelerator, strategy, rows, conf.trainer, conf.train, str(job.out),
                    job.tokenizer.pad_token_id, {"model": job.identity, "step_offset": 0},
                    resume_from=str(job.resume[0]) if job.resume else None)
        # the trained drafter (a plain copy after FSDP/DeepSpeed), in the target's dtype as a server runs it
        return Trained(strategy.module.drafter.to(target.dtype).eval(), curves={"dflash": state.history},
                       step=state.step)

    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        conf: DFlashRunConfig = job.conf
        module = DFlashTraining(trained.model, job.target, conf.dflash.max_anchors, _decay(conf), online=False).module
        return held_out_metrics(module, rows, conf.trainer.hidden_states_batch_size, job.tokenizer.pad_token_id,
                                "dflash_loss", conf.trainer.seed)

    def save(self, job, trained: Trained) -> dict:
        """``export/dflash`` (what vLLM and SGLang load) is the run's saved model, reloaded strictly by
        evaluation: always written."""
        path = export_dflash(trained.model, job.out / EXPORT)
        m = trained.model
        return {"exports": {"dflash": str(path)}, "drafter_config": {"block_size": m.block_size, "num_layers": len(m.layers),
                                   "target_layer_ids": list(m.target_layer_ids), "mask_token_id": m.mask_token_id,
                                   "loss_decay": _decay(job.conf)}}

    def export(self, run_dir: Path, target, trained: Trained) -> dict[str, str]:
        """Nothing beyond ``export/dflash``, which :meth:`save` writes."""
        return {}

    def target_of(self, run_dir: Path, conf: DFlashRunConfig) -> TargetSpec:
        return conf.model

    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        folder = Path(run_dir) / (weights or EXPORT)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} holds no DFlash export (a finished DFlash run writes {EXPORT})")
        return Trained(load_dflash(folder, target).to(target.dtype))

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

    def vllm_config(self, run_dir: Path, conf, trained: Trained) -> dict:
        return {"method": "dflash", "model": str((Path(run_dir) / self.vllm_weights).resolve()),
                "num_speculative_tokens": trained.model.block_size - 1}


def _decay(conf: DFlashRunConfig) -> float:
    """The loss's position decay: ``dflash.loss_decay``, else the paper's for the block size."""
    return conf.dflash.loss_decay or default_decay(conf.dflash.block_size)


DFLASH = DFlash()
