"""EAGLE-3 as a drafter (Li et al., arXiv 2503.01840): one decoder layer on the target's fused low, middle and
high features, trained with training-time test, validated teacher-forced per step, saved as its export
(``export/eagle3``, what vLLM and SGLang load), and measured as vLLM runs it: a chain of ``gamma`` drafts from
its argmax (``eagle3``)."""

from __future__ import annotations

from pathlib import Path

from draftheads.drafters.eagle3.config import Eagle3RunConfig
from draftheads.drafters.eagle3.export import export_eagle3, load_eagle3
from draftheads.drafters.eagle3.model import Eagle3DraftModel, Eagle3Drafter, default_layer_ids, draft_vocabulary
from draftheads.drafters.eagle3.training import Eagle3Training
from draftheads.models.speculative import Sampling
from draftheads.models.target import TargetSpec
from draftheads.training.config import Features
from draftheads.training.held_out import held_out_metrics
from draftheads.training.recipe import Trained
from draftheads.training.runtime import print0
from draftheads.training.spine import fit

EXPORT = "export/eagle3"


class Eagle3:
    """The EAGLE-3 recipe (see :class:`draftheads.training.recipe.Recipe`)."""
    name = "eagle3"
    schema = Eagle3RunConfig
    stages = ("eagle3",)
    vllm_weights = EXPORT

    def check(self, conf: Eagle3RunConfig, target) -> None:
        """Layer ids inside the target, at least one unrolled step and draft, a draft vocabulary the target
        holds."""
        e, n = conf.eagle3, target.config.num_hidden_layers
        bad = [i for i in self.state_layers(conf, target) if not 0 <= i < n]
        if bad:
            raise ValueError(f"eagle3.target_layer_ids: {bad} are outside 0..{n - 1} (the target's decoder layers)")
        if e.ttt_steps < 1 or e.gamma < 1:
            raise ValueError(f"eagle3.ttt_steps={e.ttt_steps} and eagle3.gamma={e.gamma} must be >= 1")
        if e.draft_vocab_size < 1:
            raise ValueError(f"eagle3.draft_vocab_size={e.draft_vocab_size} must be >= 1")

    def state_layers(self, conf: Eagle3RunConfig, target) -> tuple[int, ...]:
        """``eagle3.target_layer_ids``, else :func:`default_layer_ids`."""
        return tuple(conf.eagle3.target_layer_ids or default_layer_ids(target.config.num_hidden_layers))

    def unusable(self, row: dict) -> str | None:
        """Step 1 of row s predicts token s+2: a row needs a trainable token at position 2 or later."""
        if not bool(row["loss_mask"][2:].any()):
            return "no trainable token two positions after another, so no EAGLE-3 step has a target"
        return None

    def attach_states(self, conf: Eagle3RunConfig) -> bool:
        return conf.eagle3.features == Features.precomputed

    def train(self, job, rows: list[dict]) -> Trained:
        conf: Eagle3RunConfig = job.conf
        e, target = conf.eagle3, job.target
        vocab_size = target.config.vocab_size
        vocabulary = draft_vocabulary(rows, vocab_size, min(e.draft_vocab_size, vocab_size))
        drafter = Eagle3DraftModel.for_target(target, list(self.state_layers(conf, target)), vocabulary)
        print0(job.accelerator, f"drafter: EAGLE-3, target layers {list(drafter.target_layer_ids)}, draft "
                                f"vocabulary {len(vocabulary)} of {vocab_size}, {e.ttt_steps} training-time-test steps")
        strategy = Eagle3Training(drafter, target, e.ttt_steps, e.step_decay, online=not self.attach_states(conf))
        state = fit(job.accelerator, strategy, rows, conf.trainer, conf.train, str(job.out),
                    job.tokenizer.pad_token_id, {"model": job.identity, "step_offset": 0},
                    resume_from=str(job.resume[0]) if job.resume else None)
        # the trained drafter (a plain copy after FSDP/DeepSpeed), in the target's dtype as a server runs it
        return Trained(strategy.module.drafter.to(target.dtype).eval(), curves={"eagle3": state.history},
                       step=state.step)

    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        conf: Eagle3RunConfig = job.conf
        module = Eagle3Training(trained.model, job.target, conf.eagle3.ttt_steps, conf.eagle3.step_decay,
                                online=False).module
        return held_out_metrics(module, rows, conf.trainer.hidden_states_batch_size, job.tokenizer.pad_token_id,
                                "eagle3_loss", conf.trainer.seed)

    def save(self, job, trained: Trained) -> dict:
        """``export/eagle3`` (what vLLM and SGLang load) is the run's saved model, reloaded strictly by
        evaluation: always written."""
        path = export_eagle3(trained.model, job.out / EXPORT)
        m = trained.model
        if "eagle_aux_hidden_state_layer_ids" in m.config.eagle_config:
            print(f"{path}: target layers {list(m.target_layer_ids)} are not the servers' default, so the export "
                  f"names them as vLLM reads them; SGLang reads those ids one layer later", flush=True)
        return {"exports": {"eagle3": str(path)},
                "drafter_config": {"target_layer_ids": list(m.target_layer_ids), "draft_vocab_size": len(m.d2t),
                                   "ttt_steps": job.conf.eagle3.ttt_steps, "gamma": job.conf.eagle3.gamma}}

    def export(self, run_dir: Path, target, trained: Trained) -> dict[str, str]:
        """Nothing beyond ``export/eagle3``, which :meth:`save` writes."""
        return {}

    def target_of(self, run_dir: Path, conf: Eagle3RunConfig) -> TargetSpec:
        return conf.model

    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        folder = Path(run_dir) / (weights or EXPORT)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} holds no EAGLE-3 export (a finished EAGLE-3 run writes {EXPORT})")
        return Trained(load_eagle3(folder, target).to(target.dtype))

    def chain(self, conf: Eagle3RunConfig, trained: Trained, target) -> Eagle3Drafter:
        return Eagle3Drafter(trained.model, conf.eagle3.gamma)

    def peers(self, conf, trained: Trained, target, tokenizer, sampling: Sampling) -> dict:
        """None: the chain is what vLLM and SGLang serve (EAGLE-2's dynamic tree is not built)."""
        return {}

    def vllm_config(self, run_dir: Path, conf: Eagle3RunConfig, trained: Trained) -> dict:
        return {"method": "eagle3", "model": str((Path(run_dir) / self.vllm_weights).resolve()),
                "num_speculative_tokens": conf.eagle3.gamma}


EAGLE3 = Eagle3()
