"""EAGLE-3 as a drafter (Li et al., arXiv 2503.01840): one decoder layer on the target's fused low, middle and
high features, trained with training-time test, validated teacher-forced per step, saved as its export
(``export/eagle3``, what vLLM and SGLang load), and measured as vLLM runs it: a chain of ``gamma`` drafts from
its argmax (``eagle3``; no other method: EAGLE-2's dynamic tree is not built)."""

from __future__ import annotations

from pathlib import Path

from draftheads.drafters.contract import FeatureRecipe, Trained
from draftheads.drafters.eagle3.config import Eagle3RunConfig
from draftheads.drafters.eagle3.export import export_eagle3, load_eagle3
from draftheads.drafters.eagle3.model import (
    NORM_FLAGS,
    Eagle3Drafter,
    Eagle3DraftModel,
    default_layer_ids,
    draft_vocabulary,
    norm_flags,
    servers_default,
)
from draftheads.drafters.eagle3.serving import FLAGS, LLAMACPP_UNREAD, RESIDUAL, SERVING
from draftheads.drafters.eagle3.training import Eagle3Training
from draftheads.drafters.spec import DrafterSpec
from draftheads.serving.preflight import Expect


class Eagle3(FeatureRecipe):
    """The EAGLE-3 recipe (see :class:`draftheads.drafters.contract.FeatureRecipe`)."""
    spec = DrafterSpec("eagle3", Eagle3RunConfig, ("eagle3",), serving=SERVING, llamacpp_spec="draft-eagle3")

    def default_layers(self, conf: Eagle3RunConfig, target) -> list[int]:
        """:func:`default_layer_ids`: low, middle and high, as the servers default to."""
        return default_layer_ids(target.config.num_hidden_layers)

    def check_settings(self, conf: Eagle3RunConfig, target) -> None:
        """At least one unrolled step and draft, a draft vocabulary the target holds."""
        e = conf.eagle3
        if e.ttt_steps < 1 or e.gamma < 1:
            raise ValueError(f"eagle3.ttt_steps={e.ttt_steps} and eagle3.gamma={e.gamma} must be >= 1")
        if e.draft_vocab_size < 1:
            raise ValueError(f"eagle3.draft_vocab_size={e.draft_vocab_size} must be >= 1")

    def unusable(self, row: dict) -> str | None:
        """Step 1 of row s predicts token s+2: a row needs a trainable token at position 2 or later."""
        if not bool(row["loss_mask"][2:].any()):
            return "no trainable token two positions after another, so no EAGLE-3 step has a target"
        return None

    def build(self, conf: Eagle3RunConfig, target, tokenizer, rows: list[dict]) -> Eagle3DraftModel:
        """A fresh drafter whose draft vocabulary is the rows' most frequent trained tokens, with the norm flags
        ``eagle3.{fc_norm,norm_before_fc,norm_output,norm_before_residual}``."""
        vocab_size = target.config.vocab_size
        vocabulary = draft_vocabulary(rows, vocab_size, min(conf.eagle3.draft_vocab_size, vocab_size))
        flags = {name: getattr(conf.eagle3, name) for name in NORM_FLAGS}
        return Eagle3DraftModel.for_target(target, list(self.drafter_layers(conf, target)), vocabulary, **flags)

    def describe(self, conf: Eagle3RunConfig, drafter: Eagle3DraftModel) -> str:
        on = [name for name, value in norm_flags(drafter.config).items() if value]
        return (f"EAGLE-3, target layers {list(drafter.target_layer_ids)}, draft vocabulary {len(drafter.d2t)} of "
                f"{drafter.config.vocab_size}, {conf.eagle3.ttt_steps} training-time-test steps"
                + (f", norms {' '.join(on)}" if on else ""))

    def training(self, conf: Eagle3RunConfig, drafter: Eagle3DraftModel, target, online: bool) -> Eagle3Training:
        return Eagle3Training(drafter, target, conf.eagle3.ttt_steps, self.objective(conf), online=online)

    def write_export(self, drafter: Eagle3DraftModel, folder: Path) -> Path:
        path = export_eagle3(drafter, folder)
        if "eagle_aux_hidden_state_layer_ids" in drafter.config.eagle_config:
            print(f"{path}: target layers {list(drafter.target_layer_ids)} are not the servers' default, so the "
                  f"export names them as vLLM reads them; SGLang reads those ids one layer later", flush=True)
        return path

    read_export = staticmethod(load_eagle3)

    def init_fields(self, conf: Eagle3RunConfig, target, model: Eagle3DraftModel) -> dict[str, tuple]:
        """The target layers, the draft vocabulary's size (the source's vocabulary is loaded with its LM head) and
        EAGLE-3.1's norm flags."""
        flags = norm_flags(model.config)
        size = min(conf.eagle3.draft_vocab_size, target.config.vocab_size)
        return super().init_fields(conf, target, model) | {"eagle3.draft_vocab_size": (len(model.d2t), size)} | {
            f"eagle3.{name}": (flags[name], getattr(conf.eagle3, name)) for name in NORM_FLAGS}

    def drafter_config(self, conf: Eagle3RunConfig, drafter: Eagle3DraftModel) -> dict:
        return {"target_layer_ids": list(drafter.target_layer_ids), "draft_vocab_size": len(drafter.d2t),
                "ttt_steps": conf.eagle3.ttt_steps, "gamma": conf.eagle3.gamma, **norm_flags(drafter.config)}

    def chain(self, conf: Eagle3RunConfig, trained: Trained, target) -> Eagle3Drafter:
        return Eagle3Drafter(trained.model, conf.eagle3.gamma)

    def serving_variant(self, conf: Eagle3RunConfig, trained: Trained) -> str:
        """``norm_before_residual``'s rows when it is on (SGLang does not read it), else EAGLE-3.1's when
        ``fc_norm`` or ``norm_output`` is (llama.cpp reads neither; ``serving.json`` then names the lines that
        read them); ``norm_before_fc``, which every server reads, is the plain export's row."""
        flags = norm_flags(trained.model.config)
        return RESIDUAL if flags["norm_before_residual"] else \
            FLAGS if flags["fc_norm"] or flags["norm_output"] else ""

    def llamacpp_unread(self, conf: Eagle3RunConfig, trained: Trained, target) -> list[str]:
        """The last layer's output among the features (:meth:`FeatureRecipe.llamacpp_unread`), layers other than
        the servers' default (llama.cpp's converter reads them where the export does not write them), EAGLE-3.1's
        ``fc_norm`` and ``norm_output`` where on (:data:`~draftheads.drafters.eagle3.serving.LLAMACPP_UNREAD`)."""
        flags, model = norm_flags(trained.model.config), trained.model
        layers = [] if list(model.target_layer_ids) == servers_default(model.config.num_target_layers) else [
            f"eagle3.target_layer_ids {list(model.target_layer_ids)} (not the servers' default): llama.cpp's converter "
            f"reads the ids at config.json's top level (conversion/llama.py:77), where the export writes them as vLLM "
            f"reads them, in eagle_config, so it would extract its default layers"]
        return super().llamacpp_unread(conf, trained, target) + layers + \
            [why for name, why in LLAMACPP_UNREAD.items() if flags[name]]

    def draft_length(self, conf: Eagle3RunConfig, trained: Trained) -> int:
        """``eagle3.gamma``: the drafter decodes autoregressively, as many steps as asked."""
        return conf.eagle3.gamma

    layer_key = "config.json eagle_config.eagle_aux_hidden_state_layer_ids (none: the target's default layers)"

    def served_reads(self, conf: Eagle3RunConfig, trained: Trained, target) -> dict[str, Expect]:
        """The layers (:meth:`FeatureRecipe.served_reads`) and their count, the norm flags as
        ``eagle3.*`` sets them, and the draft vocabulary (target id of each draft token; None: the target's own,
        no ``d2t`` written)."""
        model, e = trained.model, conf.eagle3
        vocabulary = model.draft_ids().tolist() if len(model.d2t) < len(model.t2d) else None
        return super().served_reads(conf, trained, target) | {
            "num_aux_hidden_states": Expect(len(model.target_layer_ids), self.layer_key + ", counted (none: 3)"),
            "norm_before_fc": Expect(e.norm_before_fc, "config.json norm_before_fc (eagle_config.norm_before_fc "
                                                       "first)"),
            "fc_norm": Expect(e.fc_norm, "config.json fc_norm"),
            "norm_output": Expect(e.norm_output, "config.json norm_output"),
            "norm_before_residual": Expect(e.norm_before_residual, "config.json norm_before_residual"),
            "draft_vocabulary": Expect(vocabulary, "model.safetensors d2t", "arange + d2t")}


EAGLE3 = Eagle3()
