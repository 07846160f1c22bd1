"""What one drafter contributes to draftheads: its :class:`~draftheads.drafters.spec.DrafterSpec` (what it is) and
a :class:`Recipe` (what it does), split into the three behaviours callers use: :class:`Training` (the training
job), :class:`Artifacts` (its save, exports and reading them back), :class:`Serving` (decoding and what servers
read); :class:`FeatureRecipe` for drafters on target layers.

Opening a job, the rows and target states, the training spine, the end of a run (validate, save, export,
evaluate, report), peer runs, the evaluator and the state cache are the same for every drafter; a recipe says
only what differs. Each drafter's folder (``draftheads/drafters/<name>/``) holds one recipe, registered by name
in ``draftheads/drafters/__init__.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn

from draftheads.drafters.spec import DrafterSpec
from draftheads.models.speculative import ChainDrafter, Sampling
from draftheads.models.target import TargetSpec
from draftheads.run_folder import is_run
from draftheads.serving.llamacpp import LLAMACPP_LAYER_INPUTS
from draftheads.serving.matrix import served_target, serving_record, write_serving
from draftheads.serving.preflight import Expect
from draftheads.training.config import TargetStates
from draftheads.training.held_out import held_out_metrics
from draftheads.training.objectives import Objective, check_objective, with_last_layer
from draftheads.training.runtime import print0
from draftheads.training.spine import fit
from draftheads.training.warm_start import applies, check_source, describe, load_source, read_source

Decode = Callable
"""``decode(prompt_ids [T] int64, generator) -> DecodeResult``: one method the evaluator measures."""


@dataclass
class Trained:
    """A trained (or reloaded) drafter and what travels with it."""
    model: nn.Module
    """The drafter (Medusa heads, a DFlash or EAGLE-3 drafter), in the target's dtype once training is over."""
    saved: dict = field(default_factory=dict)
    """JSON fields saved with the weights and read back with them (e.g. Medusa's ``head_rank_accuracy``, from
    which the default tree grows, and ``base_model``); never read from ``report.json``."""
    curves: dict = field(default_factory=dict)
    """Logged training metrics per stage (training only)."""
    step: int = 0
    """The last optimizer step on the tracker's axis (stages follow each other)."""
    init_from: dict | None = None
    """Where training started (``<drafter>.init_from``: :func:`~draftheads.training.warm_start.record`), None
    from random weights; in ``report.json`` as ``init_from``."""


class Training(Protocol):
    """What the training job asks of a drafter (``draftheads/runs/life.py``, the state cache): refuse bad settings,
    name the target states and rows it trains on, train, validate. ``job`` arguments are
    :class:`draftheads.runs.life.Job`; ``conf`` is the drafter's ``spec.schema`` instance."""
    spec: DrafterSpec

    def check(self, conf, target) -> None:
        """Refuse settings that would fail later, before the data is built (``ValueError``). Default: the
        objective's keys (:func:`~draftheads.training.objectives.check_objective`) and the warm start's source
        (:meth:`check_init_from`)."""
        check_objective(self.objective(conf), self.spec.name)
        self.check_init_from(conf, target)

    def check_init_from(self, conf, target) -> None:
        """Read ``<name>.init_from`` (when it applies: :func:`~draftheads.training.warm_start.applies`) and
        refuse it before any work: ``FileNotFoundError``/``ValueError`` naming the key, the file and, for a
        source made for another target or with other settings (:meth:`Artifacts.init_fields`), the field and both
        values."""
        if applies(self, conf):
            check_source(self, conf, target, read_source(self, conf, target))

    def objective(self, conf) -> Objective:
        """The drafter's objective settings (its config section, an
        :class:`~draftheads.training.objectives.Objective`) with ``position_decay`` resolved (default: the
        section's own)."""
        return getattr(conf, self.spec.name)

    def state_layers(self, conf, target) -> tuple[int, ...] | None:
        """Target layers whose outputs training reads (layer id i = output of decoder layer i); None (default):
        the last hidden state."""
        return None

    def unusable(self, row: dict) -> str | None:
        """Why this drafter cannot train on ``row`` (it is then skipped and counted before training), or None
        (default: every row)."""
        return None

    def warm_start(self, job, model: nn.Module) -> dict | None:
        """Load ``<name>.init_from`` into the freshly built ``model`` (in place) and log what was loaded;
        returns the record (:func:`~draftheads.training.warm_start.record`), None without ``init_from``. A resumed
        run loads nothing (its checkpoint holds the weights) and returns the record its checkpoint carries."""
        if job.resume:
            return job.resume[1].get("init_from")
        if not applies(self, job.conf):
            return None
        source = read_source(self, job.conf, job.target)
        check_source(self, job.conf, job.target, source)
        init = load_source(model, source, self.spec.fresh)
        print0(job.accelerator, describe(init))
        return init

    @abstractmethod
    def train(self, job, rows: list[dict]) -> Trained:
        """Every stage on ``rows`` (this process's share is taken by the spine), resuming from ``job.resume``;
        returns the plain trained drafter on every rank."""

    @abstractmethod
    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        """Held-out metrics (main process); may add to ``trained.saved`` what evaluation needs."""


class Artifacts(Protocol):
    """What writes a drafter into its run and reads it back (the end of a run, ``train/evaluate.py``,
    ``train/export.py``, peer runs, warm starts)."""
    spec: DrafterSpec
    bases: tuple[Artifacts, ...] = ()
    """Drafters this one extends, whose runs and exports it can also start from (``<name>.init_from``: DSpark
    from DFlash); their tensors load into its part of the same names."""

    @abstractmethod
    def save(self, job, trained: Trained) -> dict:
        """The model-only save in the run directory (with ``trained.saved``); returns report fields (an
        ``exports`` entry when the save is itself a server format). What it names inside the run is named
        relative to the run (a moved or copied run reads its own); what lies outside, as the user named it."""

    def export(self, run_dir: Path, target, trained: Trained) -> dict[str, str]:
        """Server formats under ``<run_dir>/export`` beyond what ``save`` wrote; returns ``{format: folder}``
        (default: none, the save being the export)."""
        return {}

    @abstractmethod
    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        """A finished run's drafter read back strictly, from its own save or from ``weights`` (an export folder
        relative to the run, or absolute). ``FileNotFoundError`` for an unfinished run, ``ValueError`` for one
        made for another target."""

    @abstractmethod
    def read_saved(self, folder: Path, target) -> nn.Module:
        """The drafter saved in ``folder``: a finished run of this drafter (its save) or an export folder of it,
        read by its strict loader for ``target`` (``ValueError`` naming the file for one made for another
        target)."""

    def init_fields(self, conf, target, model: nn.Module) -> dict[str, tuple]:
        """``{config key: (the saved drafter's value, this run's)}`` for the settings that shape the drafter this
        run builds, read from ``model`` (read by :meth:`read_saved`, of this drafter or a base); a warm start
        from it is refused where they differ. Default none."""
        return {}

    def target_of(self, run_dir: Path, conf) -> TargetSpec:
        """The target a finished run is evaluated on: ``conf.model`` (default), or one the run trained (Medusa
        after stage 2: the modified target it saved in ``export/target``), read from the run wherever it lies.
        ``FileNotFoundError`` naming the folder when a target the run trained is missing (never ``conf.model``
        instead)."""
        return conf.model


class Serving(Protocol):
    """How a trained drafter decodes, and what the servers must read from its exports (the evaluator, the vLLM
    and llama.cpp preflights, ``train/vllm_parity.py``, ``train/llamacpp.py``)."""
    spec: DrafterSpec

    @abstractmethod
    def chain(self, conf, trained: Trained, target) -> ChainDrafter:
        """The drafter as the evaluator and servers run it: a chain of ``gamma`` drafts per verification."""

    def peers(self, conf, trained: Trained, target, tokenizer, sampling: Sampling) -> dict[str, Decode]:
        """The drafter's other decoding methods at ``sampling`` (Medusa's tree, DFlash's denoising); default
        none."""
        return {}

    @abstractmethod
    def draft_length(self, conf, trained: Trained) -> int:
        """Tokens drafted per verification step as a server runs the export (vLLM's
        ``num_speculative_tokens``)."""

    def vllm_config(self, run_dir: Path, conf, trained: Trained) -> dict:
        """vLLM's ``speculative_config`` for the export at ``spec.vllm_weights``: ``method`` is ``spec.vllm_method``,
        ``num_speculative_tokens`` the :meth:`draft_length`."""
        return {"method": self.spec.vllm_method, "model": str((Path(run_dir) / self.spec.vllm_weights).resolve()),
                "num_speculative_tokens": self.draft_length(conf, trained)}

    def untrained(self, job, run_dir: Path) -> Trained | None:
        """For the serving preflight: a fresh, untrained drafter of the job (the shapes, layer ids and keys the
        trained one will have, the global RNG left as it was) written as vLLM loads it at ``run_dir /
        spec.vllm_weights``; None (default): this drafter has no preflight."""
        return None

    def served_reads(self, conf, trained: Trained, target) -> dict[str, Expect]:
        """What vLLM's engine must read from ``trained``'s export, as this job means it: an
        :class:`~draftheads.serving.preflight.Expect` per reading of
        :func:`~draftheads.serving.vllm_runner.engine_reads`. Default: the method and :meth:`draft_length`."""
        return {"method": Expect(self.spec.vllm_method, "speculative_config method"),
                "num_speculative_tokens": Expect(self.draft_length(conf, trained),
                                                 "speculative_config num_speculative_tokens")}

    def llamacpp_unread(self, conf, trained: Trained, target) -> list[str]:
        """Settings of ``trained`` (and of its ``target``, a ``PreTrainedModel``) that llama.cpp b11434 does not
        read, each with the source line that shows it: its GGUF would load and serve another drafter, or
        llama-server stop, so the llama.cpp export refuses it. Default: none."""
        return []

    def serving_variant(self, conf, trained: Trained) -> str:
        """Which variant of its ``spec.serving`` rows ``trained``'s exports are: "" (default) the plain rows."""
        return ""

    def write_serving(self, run_dir: Path, conf, trained: Trained) -> list[Path]:
        """``serving.json`` beside each export folder of the run that its spec declares a row for (the folder
        holding its ``config.json``): per server the versions read, whether it loads it with the source line, and
        the serve command with the run's paths, relative to the run's folder (no export names a path of the machine
        that made it; :func:`~draftheads.serving.matrix.serving_record`). The target is the one
        :meth:`Artifacts.target_of` serves the drafter with. Returns the files written."""
        spec, run = self.spec, Path(run_dir)
        target = served_target(run, self.target_of(run, conf).name_or_path)
        variant, n = self.serving_variant(conf, trained), self.draft_length(conf, trained)
        written, exports = [], dict.fromkeys(row.export for row in spec.serving)
        for export in exports:
            if (run / export / "config.json").is_file():
                written.append(write_serving(run / export, serving_record(spec.served(export, variant), target, n)))
        if spec.vllm_weights not in exports and (run / spec.vllm_weights / "config.json").is_file():
            print(f"{run / spec.vllm_weights}: no serving.json: {spec.name} declares no serving row for it",
                  flush=True)
        return written


class Recipe(Training, Artifacts, Serving):
    """One drafter: its :class:`~draftheads.drafters.spec.DrafterSpec` (``spec``, what it is) and the three
    behaviours callers use (what it does), with the defaults most drafters keep; a recipe overrides what is its
    own and must define the abstract methods (:class:`FeatureRecipe` does most of them for drafters on target
    layers). ``TypeError`` where one is built without a ``spec``."""

    def __init__(self):
        if not isinstance(getattr(self, "spec", None), DrafterSpec):
            raise TypeError(f"{type(self).__name__} declares no spec: set `spec = DrafterSpec(...)` in its class "
                            "(draftheads/drafters/spec.py)")


class FeatureRecipe(Recipe):
    """A drafter trained on the outputs of chosen target layers (DFlash, EAGLE-3), online or from states
    computed before (``data.target_states``): its settings are the config section named after it
    (``target_layer_ids``), it trains in one stage of its name and its export (``export/<name>``, what the
    servers load: its spec's defaults) is its saved model, and its held-out metrics are its training module's,
    teacher-forced. A subclass says what is its own: the settings it checks, the default layers, how
    the drafter is built, trained, written and read."""

    def settings(self, conf):
        """This drafter's config section (``conf.<name>``)."""
        return getattr(conf, self.spec.name)

    @abstractmethod
    def default_layers(self, conf, target) -> list[int]:
        """Layer ids read when ``<name>.target_layer_ids`` is not set."""

    def check_settings(self, conf, target) -> None:
        """Refuse this drafter's own settings that would fail later (``ValueError``); default none."""

    @abstractmethod
    def build(self, conf, target, tokenizer, rows: list[dict]) -> nn.Module:
        """A fresh drafter for ``target``, sized from ``conf`` (and ``rows``, for what it learns from the data)."""

    @abstractmethod
    def describe(self, conf, drafter: nn.Module) -> str:
        """One line saying what was built, printed before training."""

    layer_key = "config.json target layer ids"
    """Where the export names the target layers (what :meth:`served_reads` says a layer mismatch is in)."""

    @abstractmethod
    def training(self, conf, drafter: nn.Module, target, online: bool):
        """The training strategy (:class:`~draftheads.training.spine.Strategy`) whose ``module.drafter`` is
        ``drafter``, training for :meth:`objective`; ``online``: it computes the target's features per batch."""

    @abstractmethod
    def write_export(self, drafter: nn.Module, folder: Path) -> Path:
        """Write ``drafter`` as the servers load it into ``folder``; returns it."""

    @abstractmethod
    def read_export(self, folder: Path, target) -> nn.Module:
        """The drafter in ``folder``, read back strictly for ``target``."""

    @abstractmethod
    def drafter_config(self, conf, drafter: nn.Module) -> dict:
        """What the report records of the trained drafter's shape."""

    def read_saved(self, folder: Path, target) -> nn.Module:
        """:meth:`read_export` of ``folder``, or of its ``export/<name>`` when it is a run (its saved model)."""
        folder = Path(folder)
        return self.read_export(folder / self.spec.vllm_weights if is_run(folder) else folder, target)

    def init_fields(self, conf, target, model: nn.Module) -> dict[str, tuple]:
        """The target layers read: ``<name>.target_layer_ids`` (or their default)."""
        return {f"{self.spec.name}.target_layer_ids": (list(model.target_layer_ids),
                                                  list(self.drafter_layers(conf, target)))}

    def check(self, conf, target) -> None:
        """The layer ids exist in the target, the objective's keys, then :meth:`check_settings`."""
        n = target.config.num_hidden_layers
        bad = [i for i in self.drafter_layers(conf, target) if not 0 <= i < n]
        if bad:
            raise ValueError(f"{self.spec.name}.target_layer_ids: {bad} are outside 0..{n - 1} (the target's decoder "
                             f"layers)")
        super().check(conf, target)
        self.check_settings(conf, target)

    def drafter_layers(self, conf, target) -> tuple[int, ...]:
        """The layers the drafter reads: ``<name>.target_layer_ids``, else :meth:`default_layers`."""
        return tuple(self.settings(conf).target_layer_ids or self.default_layers(conf, target))

    def untrained(self, job, run_dir: Path) -> Trained:
        """:meth:`build` without rows (a draft vocabulary of the lowest ids), in the target's dtype, written by
        :meth:`write_export`; the RNG streams it draws from are restored, so training initialises as without it."""
        device = job.target.device
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
            drafter = self.build(job.conf, job.target, job.tokenizer, [])
        trained = Trained(drafter.to(device=device, dtype=job.target.dtype).eval())
        self.write_export(trained.model, Path(run_dir) / self.spec.vllm_weights)
        return trained

    def served_reads(self, conf, trained: Trained, target) -> dict[str, Expect]:
        """The method and draft length, and the target layers the drafter concatenates, in its order, as vLLM's
        ids (id i: the input of decoder layer i, draftheads' i - 1: ``data/vllm_states.py``)."""
        layers = list(trained.model.target_layer_ids)
        return super().served_reads(conf, trained, target) | {"aux_hidden_state_layers": Expect(
            [i + 1 for i in layers], self.layer_key, f"draftheads layers {layers}, each + 1, in the drafter's order")}

    def llamacpp_unread(self, conf, trained: Trained, target) -> list[str]:
        """A target whose llama.cpp graph extracts no layer inputs (:data:`LLAMACPP_LAYER_INPUTS`: llama-server
        stops at its first decode, ``src/llama-graph.cpp:1413``), and the last target layer's output among the
        features: llama.cpp b11434 extracts the input of decoder layer i (draftheads' i - 1), and past the last
        layer only from targets whose graph sets it (``src/models/deepseek4.cpp:1329-1332``); a Llama target's
        sets layers 0..L-1 (``src/models/llama.cpp:127``), so EAGLE-3 would read an unfilled state there
        (``common/speculative.cpp:603-604``) and DFlash stop at the first decode."""
        kind = target.config.model_type
        graph = [] if kind in LLAMACPP_LAYER_INPUTS else [
            f"the target ({kind}): llama.cpp's graph for it extracts no layer inputs (only "
            f"{', '.join(sorted(LLAMACPP_LAYER_INPUTS))} here; src/models/<arch>.cpp sets res->t_layer_inp), so "
            f"llama-server stops at its first decode (src/llama-graph.cpp:1413: layer input tensor is null)"]
        last = trained.model.config.num_target_layers - 1
        if last not in trained.model.target_layer_ids:
            return graph
        return graph + [f"{self.spec.name}.target_layer_ids holds {last}, the last layer's output (llama.cpp's id "
                        f"{last + 1}, past its decoder layers): a Llama target's graph does not extract it "
                        f"(src/models/llama.cpp:127)"]

    def state_layers(self, conf, target) -> tuple[int, ...]:
        """:meth:`drafter_layers`, and the last layer when the objective reads the target's distribution
        (:func:`~draftheads.training.objectives.with_last_layer`)."""
        return with_last_layer(self.drafter_layers(conf, target), self.settings(conf),
                               target.config.num_hidden_layers)

    def train(self, job, rows: list[dict]) -> Trained:
        conf, target = job.conf, job.target
        drafter = self.build(conf, target, job.tokenizer, rows)
        print0(job.accelerator, f"drafter: {self.describe(conf, drafter)}")
        init = self.warm_start(job, drafter)
        strategy = self.training(conf, drafter, target, online=conf.data.target_states == TargetStates.online)
        state = fit(job.accelerator, strategy, rows, conf.trainer, conf.train, str(job.out),
                    job.tokenizer.pad_token_id, {"model": job.identity, "step_offset": 0, "init_from": init},
                    resume_from=str(job.resume[0]) if job.resume else None)
        # the trained drafter (a plain copy after FSDP/DeepSpeed), in the target's dtype as a server runs it
        return Trained(strategy.module.drafter.to(target.dtype).eval(), curves={self.spec.name: state.history},
                       step=state.step, init_from=init)

    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        """The training module's metrics on the held-out rows, teacher-forced (``<name>_loss``, per position)."""
        module = self.training(job.conf, trained.model, job.target, online=False).module
        return held_out_metrics(module, rows, job.conf.data.target_batch_size, job.tokenizer.pad_token_id,
                                f"{self.spec.name}_loss", job.conf.trainer.seed)

    def save(self, job, trained: Trained) -> dict:
        """``export/<name>`` (what the servers load) is the run's saved model, reloaded strictly by evaluation:
        always written."""
        path = self.write_export(trained.model, job.out / self.spec.vllm_weights)
        return {"exports": {self.spec.name: str(path)}, "drafter_config": self.drafter_config(job.conf, trained.model)}

    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        folder = Path(run_dir) / (weights or self.spec.vllm_weights)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"{folder} holds no {self.spec.name} export (a finished {self.spec.name} run "
                                    f"writes {self.spec.vllm_weights})")
        return Trained(self.read_export(folder, target).to(target.dtype))
