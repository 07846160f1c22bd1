"""The drafters, one folder each, and the registry that names them.

A drafter's folder holds its module, its training strategies, its validation, its exporters, its decoding
methods and what it saves, behind one :class:`~draftheads.drafters.contract.Recipe` (``recipe.py``). Adding a
drafter is its folder and one line in :data:`DRAFTERS`; the training job, the end of a run, evaluation, peer
runs, export, vLLM parity and the state cache ask this registry, never a folder on disk.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable
from pathlib import Path

from hydra.core.config_store import ConfigStore

from draftheads.drafters.contract import Recipe
from draftheads.evaluation.methods import PROMPT_LOOKUP
from draftheads.run_folder import CONFIG, is_run, recorded
from draftheads.training.config import RegenerateConfig

DRAFTERS = {
    "medusa": "draftheads.drafters.medusa.recipe:MEDUSA",
    "dflash": "draftheads.drafters.dflash.recipe:DFLASH",
    "eagle3": "draftheads.drafters.eagle3.recipe:EAGLE3",
    "dspark": "draftheads.drafters.dspark.recipe:DSPARK",
    "dflash2": "draftheads.drafters.dflash2.recipe:DFLASH2",
}
"""Drafter name -> ``module:object`` of its recipe (imported on first use)."""


def get(name: str) -> Recipe:
    """The recipe registered as ``name``. Raises ``ValueError`` listing the registered names."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; registered drafters: {sorted(DRAFTERS)}")
    module, _, attr = DRAFTERS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def of_run(run_dir: str | Path) -> Recipe:
    """The recipe of a run directory, read from the ``drafter`` its ``config.yaml`` records. Raises
    ``FileNotFoundError`` for a folder without one (no run), ``ValueError`` for a config naming no drafter or
    an unregistered one."""
    if not is_run(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a run directory (no {CONFIG})")
    name = recorded(run_dir, "drafter")
    if name is None:
        raise ValueError(f"{Path(run_dir) / CONFIG} names no drafter (a run made before runs recorded theirs): add "
                         f"'drafter: <name>' with one of {sorted(DRAFTERS)}")
    return get(name)


def check_method_names(names: Iterable[str]) -> None:
    """``eval.peers`` names, checked before any work: each must be a method some registered drafter's runs offer
    (its ``DrafterSpec.methods``) or prompt lookup, optionally with the ``@<run folder>`` a peer run's method takes when
    its name is already taken. Raises ``ValueError`` naming the unknown ones and every method's name."""
    patterns = [PROMPT_LOOKUP] + [p for name in DRAFTERS for p in get(name).spec.methods]
    unknown = [n for n in names if not any(re.fullmatch(p, n.split("@")[0]) for p in patterns)]
    if unknown:
        raise ValueError(f"eval.peers: {unknown} name no method; methods: {patterns} (a peer run's, when its name "
                         "is taken, with @<run folder>)")


def register_configs() -> None:
    """Register every drafter's schema as ``<name>_schema`` (``conf/<name>.yaml`` extends it) and the
    regeneration job's, so Hydra composes them."""
    store = ConfigStore.instance()
    for name in DRAFTERS:
        store.store(name=f"{name}_schema", node=get(name).spec.schema)
    store.store(name="regenerate_schema", node=RegenerateConfig)
