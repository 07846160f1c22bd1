"""The drafters, one folder each, and the registry that names them.

A drafter's folder holds its module, its training strategies, its validation, its exporters, its decoding
methods and what it saves, behind one :class:`~draftheads.training.recipe.Recipe` (``recipe.py``). Adding a
drafter is its folder and one line in :data:`DRAFTERS`; the training job, the end of a run, evaluation, peer
runs, export, vLLM parity and the state cache ask this registry, never a folder on disk.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from draftheads.training.config import RegenerateConfig
from draftheads.training.recipe import Recipe

DRAFTERS = {
    "medusa": "draftheads.drafters.medusa.recipe:MEDUSA",
    "dflash": "draftheads.drafters.dflash.recipe:DFLASH",
    "eagle3": "draftheads.drafters.eagle3.recipe:EAGLE3",
    "dspark": "draftheads.drafters.dspark.recipe:DSPARK",
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
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    name = OmegaConf.load(path).get("drafter")
    if name is None:
        raise ValueError(f"{path} names no drafter (a run made before runs recorded theirs): add "
                         f"'drafter: <name>' with one of {sorted(DRAFTERS)}")
    return get(name)


def register_configs() -> None:
    """Register every drafter's schema as ``<name>_schema`` (``conf/<name>.yaml`` extends it) and the
    regeneration job's, so Hydra composes them."""
    store = ConfigStore.instance()
    for name in DRAFTERS:
        store.store(name=f"{name}_schema", node=get(name).schema)
    store.store(name="regenerate_schema", node=RegenerateConfig)
