"""Medusa as a drafter (Cai et al., arXiv 2401.10774): two training stages, held-out validation and drift,
the model-only save (with the rank accuracies the default tree grows from), vLLM and TGI exports, and its
decoding methods: the heads as a chain (``medusa_chain``, what vLLM serves) and as a tree (``medusa_tree``;
``medusa_tree_typical`` with typical acceptance)."""

from __future__ import annotations

import posixpath
from pathlib import Path

from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import Recipe, Trained
from draftheads.drafters.medusa.config import MedusaRunConfig
from draftheads.drafters.medusa.export import (
    HEADS_CONFIG,
    export_tgi_medusa,
    export_vllm_medusa,
    load_any_heads,
    load_heads,
    save_heads,
    saved_fields,
)
from draftheads.drafters.medusa.heads import MedusaDrafter, MedusaHeads
from draftheads.drafters.medusa.serving import SERVING
from draftheads.drafters.medusa.training import MedusaStage1, MedusaStage2, check_unfreeze, split_states, stage2_layers
from draftheads.drafters.medusa.validation import validate
from draftheads.drafters.spec import DrafterSpec
from draftheads.models.partial import hold_layers, is_partial, save_partial
from draftheads.models.speculative import Sampling
from draftheads.models.target import TargetSpec
from draftheads.models.tree import Tree, TypicalAcceptance, default_choices, tree_decode
from draftheads.run_folder import is_run
from draftheads.training.config import TargetStates
from draftheads.training.spine import fit

TRAINED_TARGET = "export/target"
"""Where a run with stage 2 saves the target it trained (relative to the run): its heads are served with it."""
TGI_EXPORT = "export/tgi"


class Medusa(Recipe):
    """The Medusa recipe (see :class:`draftheads.drafters.contract.Recipe`)."""
    spec = DrafterSpec("medusa", MedusaRunConfig, ("medusa_chain", "medusa_tree", "medusa_tree_typical"),
                       stages=("stage1", "stage2"), vllm_weights="export/vllm", saved_entries=("medusa_heads",),
                       serving=SERVING, fresh=("lm_heads.*",))
    """``fresh``: per-head LM heads: a vLLM export always holds them (dropped when the config shares the target's
    LM head); heads saved sharing it leave per-head ones initialised from the target's."""

    def check(self, conf: MedusaRunConfig, target) -> None:
        """The objective's keys, stage 2's unfrozen layers exist; the states are computed once (stage 1 reads them
        every epoch)."""
        super().check(conf, target)
        check_unfreeze(target, conf.stage2)
        if conf.data.target_states == TargetStates.online:
            raise ValueError("data.target_states=online: Medusa's heads read the target's states every epoch, "
                             "computed once: use memory (the default) or disk")

    def state_layers(self, conf: MedusaRunConfig, target) -> tuple[int, ...] | None:
        """The last hidden state; with stage 2, the outputs of the layer before the trained ones and of the last
        layer (:func:`~draftheads.drafters.medusa.training.stage2_layers`)."""
        if not conf.stage2.enabled:
            return None
        return stage2_layers(target.config.num_hidden_layers, conf.stage2.unfreeze_last_n_layers)

    def train(self, job, rows: list[dict]) -> Trained:
        """Stage 1 (heads on the frozen target's cached states), then stage 2 (heads and the last N layers,
        KL to the original); a resumed run continues at its checkpoint's stage."""
        conf: MedusaRunConfig = job.conf
        accelerator, target, out = job.accelerator, job.target, str(job.out)
        resume, resume_stage = job.resume, job.resume[1]["stage"] if job.resume else None
        pad = job.tokenizer.pad_token_id
        split_states(rows, target.get_decoder().norm)
        heads = MedusaHeads(job.identity["hidden_size"], job.identity["vocab_size"], conf.medusa.num_heads,
                            conf.medusa.num_layers, conf.medusa.per_head_lm_head).to(accelerator.device)
        if heads.per_head_lm_head:
            heads.init_lm_heads_from(target.get_output_embeddings())
        init = self.warm_start(job, heads)  # stage 1 starts from them; stage 2 continues from stage 1 as always
        # every checkpoint carries earlier curves and where the weights began
        meta = {"model": job.identity, "step_offset": 0, "curves": {}, "init_from": init}
        if conf.stage1.enabled and resume_stage != "stage2":
            strategy = MedusaStage1(heads, target, conf.medusa)
            state = fit(accelerator, strategy, rows, conf.trainer, conf.stage1, out, pad, meta,
                        resume_from=str(resume[0]) if resume else None)
            heads = strategy.module.heads  # the trained heads (a plain copy after FSDP/DeepSpeed)
            meta["step_offset"], meta["curves"] = state.step, {"stage1": state.history}
        elif resume_stage == "stage2":
            meta["step_offset"], meta["curves"] = resume[1]["step_offset"], resume[1].get("curves", {})
        curves = dict(meta["curves"])
        if conf.stage2.enabled:
            s2 = conf.stage2
            L = target.config.num_hidden_layers
            hold_layers(target, range(L - s2.unfreeze_last_n_layers, L))  # a partial target reads the N it trains
            strategy = MedusaStage2(heads, target, s2.unfreeze_last_n_layers, conf.medusa, s2.kl_weight,
                                    s2.backbone_lr_scale)
            state = fit(accelerator, strategy, rows, conf.trainer, s2, out, pad, meta,
                        resume_from=str(resume[0]) if resume_stage == "stage2" else None)
            curves["stage2"] = state.history
            heads = strategy.module.heads
            meta["step_offset"] += state.step
            target.requires_grad_(False)
        # trained in float32; served in the target's dtype
        return Trained(heads.to(target.dtype).eval(), curves=curves, step=meta["step_offset"], init_from=init)

    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        """Head accuracies and the target's drift; the heads' rank accuracies go into ``trained.saved``."""
        split_states(rows, job.target.get_decoder().norm)
        s2 = job.conf.stage2
        val, rank_accuracy = validate(job.target, trained.model, rows, job.conf.data.target_batch_size,
                                      job.tokenizer.pad_token_id, s2.unfreeze_last_n_layers if s2.enabled else 0,
                                      job.conf.medusa)
        trained.saved["head_rank_accuracy"] = rank_accuracy
        return val

    def save(self, job, trained: Trained) -> dict:
        """``medusa_heads/`` (with the target's identity, rank accuracies and base model); after stage 2 the
        modified target itself in ``export/target`` (it is served with its heads; a partial target's checkpoint
        is rewritten file by file with the trained layers). The base model is named as :meth:`target_of` reads
        it: after stage 2 ``export/target``, relative to the run (a moved or copied run is served with its own);
        else the target as the user named it (``model.name_or_path``, never the cache folder it was converted
        to), whose fingerprint is the run's ``target.json``."""
        in_run = job.conf.stage2.enabled
        if in_run:
            folder = str(job.out / TRAINED_TARGET)
            if is_partial(job.target):
                save_partial(job.target, folder)
            else:
                job.target.save_pretrained(folder)
            job.tokenizer.save_pretrained(folder)
        base = {"base_model": TRAINED_TARGET if in_run else job.conf.model.name_or_path, "base_model_in_run": in_run}
        trained.saved |= {"target": job.identity, **base}
        save_heads(trained.model, job.out / "medusa_heads", trained.saved)
        return {**base, "head_rank_accuracy": trained.saved["head_rank_accuracy"]}

    def export(self, run_dir: Path, target, trained: Trained) -> dict[str, str]:
        """``export/vllm`` and ``export/tgi`` for the run's base model. They name no path of the machine that
        made them: TGI's ``base_model_name_or_path`` is the base model as the user named it, or after stage 2
        ``../target``, the run's ``export/target`` relative to ``export/tgi`` (TGI reads a relative path from its
        working directory: whoever serves it sets it to where that target lies; see
        :func:`~draftheads.drafters.medusa.export.export_tgi_medusa`). Heads saved by earlier versions keep the
        absolute path they name."""
        lm_head = target.get_output_embeddings().weight
        vllm = export_vllm_medusa(trained.model, lm_head, Path(run_dir) / self.spec.vllm_weights)
        tgi = export_tgi_medusa(trained.model, lm_head, Path(run_dir) / TGI_EXPORT, _served_base(trained.saved))
        return {"vllm": str(vllm), "tgi": str(tgi)}

    def target_of(self, run_dir: Path, conf: MedusaRunConfig) -> TargetSpec:
        """After stage 2 the target the run trained, which its heads are served with (``export/target`` in the
        run); else ``conf.model``. Raises ``FileNotFoundError`` naming the folder when the run trained a stage-2
        target that is not there: never the base target instead."""
        folder = _trained_target(Path(run_dir), saved_fields(Path(run_dir) / "medusa_heads"), conf)
        if folder is None:
            return conf.model
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: the stage-2 target the heads of {run_dir} were trained with is "
                                    f"missing (base_model in medusa_heads/{HEADS_CONFIG}): move or copy a run whole, "
                                    f"{TRAINED_TARGET} included; heads saved by earlier versions name it by an "
                                    f"absolute path: set base_model to \"{TRAINED_TARGET}\" and base_model_in_run "
                                    f"to true to read the run's own")
        return TargetSpec(name_or_path=str(folder), dtype=conf.model.dtype)

    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        """The run's ``medusa_heads`` (or the heads of ``weights``: ``export/vllm``, ``export/tgi``, read by
        their strict loaders, so what will be served is measured), checked against ``target``."""
        folder = Path(run_dir) / "medusa_heads"
        if not (folder / "medusa_heads.json").exists():
            raise FileNotFoundError(f"{run_dir} holds no finished Medusa run (medusa_heads/ expected)")
        heads, saved = load_heads(folder)
        if weights is not None:
            heads = load_any_heads(Path(run_dir) / weights, target.config.vocab_size)
        heads.check_target(target.config.hidden_size, target.config.vocab_size, where=str(run_dir))
        return Trained(heads.to(device=target.device, dtype=target.dtype).eval(), saved=saved)

    def read_saved(self, folder: Path, target) -> MedusaHeads:
        """A finished run's ``medusa_heads``, or the heads of an export folder in any layout written here
        (:func:`~draftheads.drafters.medusa.export.load_any_heads`: ``medusa_heads``, vLLM's, TGI's), checked
        against ``target``'s hidden and vocabulary sizes (``ValueError`` naming both)."""
        folder = Path(folder)
        heads = (load_heads(folder / "medusa_heads")[0] if is_run(folder)
                 else load_any_heads(folder, target.config.vocab_size))
        heads.check_target(target.config.hidden_size, target.config.vocab_size, where="this run's target")
        return heads

    def init_fields(self, conf: MedusaRunConfig, target, model: MedusaHeads) -> dict[str, tuple]:
        """The heads' count and depth."""
        return {"medusa.num_heads": (model.num_heads, conf.medusa.num_heads),
                "medusa.num_layers": (model.num_layers, conf.medusa.num_layers)}

    def chain(self, conf, trained: Trained, target) -> MedusaDrafter:
        return MedusaDrafter(trained.model, target.get_output_embeddings())

    def peers(self, conf: MedusaRunConfig, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """The heads as a tree (greedy, or typical acceptance at t > 0 or with ``tree.typical``), when
        ``tree.enabled``; the tree is ``tree.choices`` or grown from the saved rank accuracies."""
        t = conf.tree
        if not t.enabled:
            return {}
        tree = medusa_tree(t, trained.model.num_heads, trained.saved.get("head_rank_accuracy"))
        drafter, n = self.chain(conf, trained, target), conf.eval.max_new_tokens
        stop = stop_token_ids(tokenizer, target.generation_config)
        typical = (TypicalAcceptance(t.typical_epsilon, t.typical_delta, sampling.temperature or 0.7)
                   if t.typical or not sampling.greedy else None)
        return {"medusa_tree_typical" if typical else "medusa_tree":
                lambda ids, gen: tree_decode(target, drafter, tree, ids, n, stop, typical)}

    def draft_length(self, conf, trained: Trained) -> int:
        """One draft per head."""
        return trained.model.num_heads


def _trained_target(run_dir: Path, saved: dict, conf: MedusaRunConfig) -> Path | None:
    """The folder of the stage-2 target the heads were saved with (``saved``: their ``medusa_heads.json`` fields),
    or None when they are served with the base target. Heads saved before runs named it relative to themselves
    name it by an absolute path, read as such."""
    if "base_model_in_run" in saved:
        return (run_dir / saved["base_model"]).resolve() if saved["base_model_in_run"] else None
    return Path(saved["base_model"]) if conf.stage2.enabled else None


def _served_base(saved: dict) -> str:
    """TGI's ``base_model_name_or_path`` for heads saved with ``saved``: their base model, one in the run relative
    to ``export/tgi`` (``../target``)."""
    if saved.get("base_model_in_run"):
        return posixpath.relpath(saved["base_model"], TGI_EXPORT)
    return saved["base_model"]


def medusa_tree(tree_cfg, num_heads: int, rank_accuracy: list[list[float]] | None) -> Tree:
    """``tree.choices`` as a tree, or one grown from rank accuracies ([K][r]) for ``tree.budget`` nodes. Raises
    ``ValueError`` for a tree deeper than ``num_heads`` or neither choices nor accuracies."""
    choices = tree_cfg.choices
    if choices is None:
        if rank_accuracy is None:
            raise ValueError("no tree.choices and no measured head accuracies to grow a tree from")
        choices = default_choices(rank_accuracy, tree_cfg.budget)
    return Tree.from_choices(choices, num_heads)


MEDUSA = Medusa()
