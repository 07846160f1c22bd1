"""Warm start (``<drafter>.init_from``): training begins from a drafter saved before instead of random weights.

The source is a finished run's folder (its saved drafter, read as the run's own drafter reads it back) or an
export folder in a format draftheads writes (``export/`` of a run: vLLM/SGLang EAGLE-3, z-lab-style DFlash,
DSpark's, Medusa's vLLM and TGI layouts, or draftheads' ``medusa_heads``), read by the drafter's strict loader.

- Checked when the job opens (:meth:`~draftheads.drafters.contract.Training.check`), before any row is regenerated
  or any target state computed: a source made for a target of other sizes (hidden size, vocabulary, decoder
  layers), reading other target layers, or of another depth, head count or draft vocabulary is refused with a
  ``ValueError`` naming the key, the file and both values (:func:`check_source`).
- Training builds its drafter as it always does (the global RNG is drawn as in a run from scratch, so the data
  order is the same) and copies the source's tensors into it (:func:`load_source`). A drafter may start from a
  drafter it extends (DSpark from DFlash: ``Recipe.bases``); tensors the source lacks under the prefixes the
  drafter lets start fresh (``DrafterSpec.fresh``: DSpark's Markov and confidence heads) keep their fresh
  initialisation, and the source's tensors under them that the drafter does not hold are dropped (Medusa's
  per-head LM heads of a vLLM export into heads that share the target's). Every other tensor must be there,
  of the same shape.
- What was loaded is logged and recorded as ``init_from`` in ``report.json`` and in the run's checkpoints
  (:func:`record`).
- ``resume=true`` with a checkpoint in the output_dir ignores the source: the checkpoint holds the weights
  (and the record of where they began), so a resumed run ends as the whole run would.

The source's target is compared by its sizes only: a target fine-tuned since (same architecture, other
weights) is what a warm start is for (docs/refresh.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftheads.run_folder import CONFIG, check_saved, is_run, recorded
from draftheads.training.checkpoint import complete_checkpoints


@dataclass
class Source:
    """A warm start's source, read and checked."""
    path: Path
    """As ``<drafter>.init_from`` names it."""
    drafter: str
    """The drafter that saved it (the registry name)."""
    kind: str
    """``run`` (a finished run's folder) or ``export`` (an export folder)."""
    model: nn.Module
    """The saved drafter, read by its drafter's strict loader for this run's target."""
    key: str = "init_from"
    """The key that named it (``<drafter>.init_from``), which errors about it begin with."""


def init_path(recipe, conf) -> Path | None:
    """``<name>.init_from`` as a path, or None: start from random weights (the default)."""
    value = getattr(conf, recipe.spec.name).init_from
    return None if value in (None, "") else Path(value)


def applies(recipe, conf) -> bool:
    """Whether ``conf`` warm-starts: ``init_from`` set, and no checkpoint to resume from (``resume=true`` with one
    takes precedence)."""
    return init_path(recipe, conf) is not None and not (conf.resume and complete_checkpoints(conf.output_dir))


def check_init_path(recipe, conf) -> None:
    """The checks of ``<name>.init_from`` that need no target, when the job opens (before the accelerator,
    the target or any deletion): the folder is there, and it is not inside ``output_dir``, which this run claims
    (``overwrite=true`` would delete the source before it is read; a warm start writes a new run). Raises
    ``FileNotFoundError`` / ``ValueError`` naming the key and the next command."""
    if not applies(recipe, conf):
        return
    key, path = f"{recipe.spec.name}.init_from", init_path(recipe, conf)
    if not path.exists():
        raise FileNotFoundError(_missing(recipe, key, path))
    out = Path(conf.output_dir)
    if out.exists() and (path.resolve() == out.resolve() or path.resolve().is_relative_to(out.resolve())):
        raise ValueError(f"{key}={path} is inside output_dir={out}, which this run claims (overwrite=true would "
                         f"delete the drafter before it is read): a warm start writes a new run, e.g. "
                         f"output_dir={out.parent / (out.name + '_refreshed')}")


def _missing(recipe, key: str, path: Path) -> str:
    """What to say of an ``init_from`` that is not there: the job that writes it (a base drafter's, by its
    default output_dir), or how to start from random weights."""
    makers = " or ".join(f"train/{r.spec.name}.py" for r in (recipe, *recipe.bases) if Path(path).name == r.spec.name)
    first = (f"run {makers} first (it writes {path}), or " if makers
             else "give a finished run's or an export folder, or ")
    return f"{key}={path}: no such folder: {first}set {key}=null to train from random weights"


def read_source(recipe, conf, target) -> Source:
    """The drafter ``<name>.init_from`` names, read for ``target`` by the loader of the drafter that saved
    it: the recipe's own or one of its ``bases``. A run folder says its drafter (its ``config.yaml``) and must have
    finished its save (its ledger, ``progress.json``); an export folder is read by each candidate's loader in
    turn. Reading draws nothing from the global RNG (a loader builds its module before loading into it), so a
    warm-started run draws its data order and fresh weights as a run from scratch does.

    Raises ``FileNotFoundError`` for a path that is not there, a run that has not finished its save, a folder
    holding no drafter; ``ValueError`` for a run of a drafter this one cannot start from, or a drafter the loader
    refuses (made for another target: its message names the file and the sizes). Messages begin with the key.
    """
    with torch.random.fork_rng(devices=[]):
        return _read_source(recipe, conf, target)


def _read_source(recipe, conf, target) -> Source:
    key, path = f"{recipe.spec.name}.init_from", init_path(recipe, conf)
    candidates = {r.spec.name: r for r in (recipe, *recipe.bases)}
    if not path.exists():
        raise FileNotFoundError(_missing(recipe, key, path))
    if is_run(path):
        name = recorded(path, "drafter")
        if name not in candidates:
            raise ValueError(f"{key}={path}: a run of drafter {name!r}; {recipe.spec.name} starts from runs or "
                             f"exports of {sorted(candidates)}")
        check_saved(path, f"{key}={path}", "resume the source run first")
        try:
            return Source(path, name, "run", candidates[name].read_saved(path, target), key)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{key}={path}: {e}") from None
    errors, kinds = [], set()
    for name, candidate in candidates.items():  # an export says its drafter only in its own loader's terms
        try:
            return Source(path, name, "export", candidate.read_saved(path, target), key)
        except (FileNotFoundError, ValueError) as e:
            errors.append(f"read as {name}: {e}")
            kinds.add(type(e))
    error = FileNotFoundError if kinds == {FileNotFoundError} else ValueError
    raise error(f"{key}={path}: not a run folder (no {CONFIG}) nor an export {recipe.spec.name} starts from "
                f"({'; '.join(errors)})")


def check_source(recipe, conf, target, source: Source) -> None:
    """``ValueError`` when ``source`` was made with other settings than this run builds its drafter with:
    for each key of ``recipe.init_fields`` whose values differ, the key, the file and both values."""
    wrong = {k: v for k, v in recipe.init_fields(conf, target, source.model).items() if v[0] != v[1]}
    if wrong:
        said = "; ".join(f"{k}: {source.path} has {a}, this run {b}" for k, (a, b) in wrong.items())
        raise ValueError(f"{source.key}={source.path}: made with other settings than this run's drafter "
                         f"({said}): set them as the source has them, or start from another run")


def load_source(drafter: nn.Module, source: Source, fresh: tuple[str, ...]) -> dict:
    """Copy ``source``'s tensors into ``drafter`` (in ``drafter``'s dtypes, in place) and return the
    :func:`record`. Tensors of ``drafter`` matching a ``fresh`` pattern (``fnmatch``: ``candidate_selector.*``,
    ``layers.*.mlp_conv.*``) that the source lacks keep their values; the source's matching one that ``drafter``
    lacks are dropped. Raises ``ValueError`` naming the file and the tensors for any other tensor missing on either
    side, or a shape that differs (before anything is copied)."""
    mine, theirs = drafter.state_dict(), source.model.state_dict()
    may = lambda name: any(fnmatch.fnmatchcase(name, pattern) for pattern in fresh)  # noqa: E731
    missing = sorted(k for k in mine.keys() - theirs.keys() if not may(k))
    unexpected = sorted(k for k in theirs.keys() - mine.keys() if not may(k))
    shapes = {k: (tuple(theirs[k].shape), tuple(mine[k].shape)) for k in sorted(mine.keys() & theirs.keys())
              if theirs[k].shape != mine[k].shape}
    if missing or unexpected or shapes:
        raise ValueError(f"{source.key}={source.path}: its {source.drafter} drafter does not fit this one: "
                         f"missing {missing}, unexpected {unexpected}, (source, this) shapes differ in {shapes}")
    loaded = sorted(mine.keys() & theirs.keys())
    with torch.no_grad():
        for k in loaded:
            mine[k].copy_(theirs[k].to(device=mine[k].device, dtype=mine[k].dtype))
    return record(source, loaded, sorted(mine.keys() - theirs.keys()), sorted(theirs.keys() - mine.keys()))


def record(source: Source, loaded: list[str], fresh: list[str], dropped: list[str]) -> dict:
    """What a warm start did, as ``report.json`` and the checkpoints record it: ``path``, the source's
    ``drafter`` and ``kind``, the number of tensors ``loaded``, and the names of those left ``fresh`` (this
    drafter's, randomly initialised as in a run from scratch) and ``dropped`` (the source's, not used)."""
    return {"path": str(source.path), "drafter": source.drafter, "kind": source.kind, "loaded": len(loaded),
            "fresh": fresh, "dropped": dropped}


def describe(init: dict) -> str:
    """One log line for a :func:`record`."""
    line = (f"init_from: {init['path']} ({init['drafter']} {init['kind']}): {init['loaded']} tensors loaded, "
            f"{len(init['fresh'])} fresh")
    line += f" {init['fresh']}" if init["fresh"] else ""
    return line + (f", {len(init['dropped'])} dropped {init['dropped']}" if init["dropped"] else "")
