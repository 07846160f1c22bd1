"""What one drafter contributes to draftheads: the :class:`Recipe` protocol, and what training hands on.

Opening a job, the rows and target states, the training spine, the end of a run (validate, save, export,
evaluate, report), peer runs, the evaluator and the state cache are the same for every drafter; a recipe says
only what differs. Each drafter's folder (``draftheads/drafters/<name>/``) holds one recipe, registered by name
in ``draftheads/drafters/__init__.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from torch import nn

from draftheads.models.speculative import ChainDrafter, Sampling
from draftheads.models.target import TargetSpec

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


class Recipe(Protocol):
    """One drafter. ``job`` arguments are :class:`draftheads.training.job.Job`; ``conf`` is the drafter's
    ``schema`` instance."""
    name: str
    """Registry name, recorded as ``drafter`` in every run's config."""
    schema: type
    """Its :class:`~draftheads.training.config.RunConfig` subclass (``conf/<name>.yaml`` extends it)."""
    stages: tuple[str, ...]
    """Checkpoint stage names, in training order (resume refuses a checkpoint of any other)."""
    vllm_weights: str
    """The export folder (relative to the run) that vLLM loads, read back for parity."""

    def check(self, conf, target) -> None:
        """Refuse settings that would fail later, before the data is built (``ValueError``)."""

    def state_layers(self, conf, target) -> tuple[int, ...] | None:
        """Target layers whose outputs training reads (layer id i = output of decoder layer i); None: the last
        hidden state."""

    def unusable(self, row: dict) -> str | None:
        """Why this drafter cannot train on ``row`` (it is then skipped and counted before training), or None."""

    def attach_states(self, conf) -> bool:
        """Whether rows carry those states before training (False: the strategy runs the target per batch)."""

    def train(self, job, rows: list[dict]) -> Trained:
        """Every stage on ``rows`` (this process's share is taken by the spine), resuming from ``job.resume``;
        returns the plain trained drafter on every rank."""

    def validate(self, job, trained: Trained, rows: list[dict]) -> dict[str, float]:
        """Held-out metrics (main process); may add to ``trained.saved`` what evaluation needs."""

    def save(self, job, trained: Trained) -> dict:
        """The model-only save in the run directory (with ``trained.saved``); returns report fields (an
        ``exports`` entry when the save is itself a server format). What it names inside the run is named
        relative to the run (a moved or copied run reads its own); what lies outside, as the user named it."""

    def export(self, run_dir: Path, target, trained: Trained) -> dict[str, str]:
        """Server formats under ``<run_dir>/export`` beyond what ``save`` wrote; returns ``{format: folder}``."""

    def target_of(self, run_dir: Path, conf) -> TargetSpec:
        """The target a finished run is evaluated on: ``conf.model``, or one the run trained (Medusa after stage
        2: the modified target it saved in ``export/target``), read from the run wherever it lies.
        ``FileNotFoundError`` naming the folder when a target the run trained is missing (never ``conf.model``
        instead)."""

    def load(self, run_dir: Path, conf, target, weights: str | None = None) -> Trained:
        """A finished run's drafter read back strictly, from its own save or from ``weights`` (an export folder
        relative to the run, or absolute). ``FileNotFoundError`` for an unfinished run, ``ValueError`` for one
        made for another target."""

    def chain(self, conf, trained: Trained, target) -> ChainDrafter:
        """The drafter as the evaluator and servers run it: a chain of ``gamma`` drafts per verification."""

    def peers(self, conf, trained: Trained, target, tokenizer, sampling: Sampling) -> dict[str, Decode]:
        """The drafter's other decoding methods at ``sampling`` (Medusa's tree, DFlash's denoising)."""

    def vllm_config(self, run_dir: Path, conf, trained: Trained) -> dict:
        """vLLM's ``speculative_config`` for the export at ``vllm_weights``, decoding as ``conf`` says (the
        draft length of a drafter that decodes autoregressively, EAGLE-3's ``gamma``)."""
