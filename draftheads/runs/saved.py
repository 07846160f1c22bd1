"""Finished runs read back: a run's drafter, config and target (for re-evaluation, export and parity), whether it
finished its save (its ledger), and other runs measured beside it (``eval.peer_runs``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from omegaconf import OmegaConf

from draftheads import drafters
from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import Recipe, Trained
from draftheads.drafters.spec import DrafterSpec
from draftheads.models.speculative import Sampling, plain_decode, speculative_decode
from draftheads.models.target import Dtype, TargetSpec, load_target, model_identity, resolve_target_path
from draftheads.run_folder import CONFIG, EXPORT, LEDGER, TARGET, check_saved
from draftheads.runs.output_dir import target_record
from draftheads.training.config import apply_generation_defaults


@dataclass
class SavedRun:
    """A finished run as evaluation, export and parity see it."""
    folder: Path
    recipe: Recipe
    conf: object
    """The run's config (its own schema) with the caller's overrides."""
    target: object
    tokenizer: object
    target_path: str
    """The folder or hub id of the target it is evaluated on (Medusa after stage 2: its exported target)."""
    trained: Trained


def run_config(folder: Path, spec: DrafterSpec, overrides: list[str] = ()):
    """``folder``'s saved ``config.yaml`` as ``spec.schema``, with ``key=value`` overrides. Raises
    ``ValueError`` for an undeclared key or a value outside a choice."""
    cfg = OmegaConf.merge(OmegaConf.structured(spec.schema), OmegaConf.load(folder / CONFIG),
                          OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(cfg)


def open_run(run_dir: str | Path, overrides: list[str] = (), weights: str | None = None,
             partial: bool = False) -> SavedRun:
    """A finished run of any registered drafter: its config (with overrides), target and drafter, read by the
    drafter's strict loader from its save or from ``weights`` (an export folder, relative to the run or
    absolute); with ``partial`` the target's ends only (:mod:`draftheads.models.partial`: enough to read any
    drafter, not to decode). A run evaluated on a target it trained (Medusa after stage 2) is evaluated on its
    own, wherever the run lies; one evaluated on the base target gets the one it trained against
    (:func:`check_trained_against`).

    Raises ``FileNotFoundError`` for a folder holding no finished run (:func:`check_finished`: ``resume=true``
    finishes it) or missing the target it trained; ``ValueError`` for overrides that choose another target
    than the one it trained (:func:`check_own_target_kept`), a base target other than the one it trained
    against, weights that do not fit the target; ``FileNotFoundError`` naming the run's exports for ``weights``
    that is no folder."""
    folder = Path(run_dir)
    recipe = drafters.of_run(folder)
    check_finished(folder, recipe.spec)
    if weights is not None and not (folder / weights).is_dir():  # an absolute weights path stays itself
        exports = sorted(p.name for p in (folder / EXPORT).iterdir()) if (folder / EXPORT).is_dir() else []
        raise FileNotFoundError(f"weights={weights}: no such folder in {folder} (its exports: "
                                f"{', '.join(f'export/{e}' for e in exports) or 'none, it ran with export=false: '}"
                                f"{'' if exports else f'python train/export.py {folder} writes them'})")
    trained_with, conf = run_config(folder, recipe.spec).model, run_config(folder, recipe.spec, overrides)
    spec = recipe.target_of(folder, conf)
    own = spec != conf.model  # the run names a target of its own, not the configured one
    if own:
        check_own_target_kept(folder, trained_with, conf.model, spec)
    target, tokenizer, path = load_target(replace(spec, partial=partial), conf.cache_dir)
    if not own:
        check_trained_against(folder, target, conf.model, trained_with.dtype, path)
    apply_generation_defaults(conf, target.generation_config)
    return SavedRun(folder, recipe, conf, target, tokenizer, path, recipe.load(folder, conf, target, weights))


def check_finished(folder: Path, spec: DrafterSpec) -> None:
    """``FileNotFoundError`` unless ``folder``'s ledger (``progress.json``) lists the save among the steps the
    run finished (:func:`~draftheads.run_folder.check_saved`; ``report.json`` is not read, but for a run
    folder of an older version, without a ledger)."""
    check_saved(folder, str(folder / LEDGER), f"rerun train/{spec.name}.py as it was started, with resume=true")


TARGET_KEYS = ("name_or_path", "revision", "tiny")
"""The ``model`` keys that choose the target (``dtype`` only says how it is loaded)."""


def check_own_target_kept(folder: Path, trained_with: TargetSpec, model: TargetSpec, own: TargetSpec) -> None:
    """``ValueError`` naming the keys when overrides choose another target (``model`` against the run's
    ``trained_with``) for a run evaluated on the target it trained, ``own``: they would measure its drafter on a
    target it was not trained with."""
    changed = [f"model.{key}" for key in TARGET_KEYS if getattr(model, key) != getattr(trained_with, key)]
    if changed:
        raise ValueError(f"{', '.join(changed)} overridden, but {folder} is evaluated on the target it trained, "
                         f"{own.name_or_path}: another target would measure its drafter on weights it was not "
                         f"trained with; drop the override")


def check_trained_against(folder: Path, target, model: TargetSpec, trained_dtype: Dtype, path: str) -> None:
    """``ValueError`` naming both when ``target`` (``model``, loaded from ``path``) is not the one the run
    trained against (its ``target.json``): other sizes or, loaded in the dtype it trained in, other weights (the
    weights sample hashes the values as loaded, so another dtype is compared by its sizes). Where it lies may
    change (``model.name_or_path`` set to where it is now). A run without ``target.json`` (made by an older
    version) is not checked."""
    record_path = folder / TARGET
    if not record_path.exists():
        return
    record = json.loads(record_path.read_text())
    loaded = target_record(target, model_identity(target, model))
    unchecked = {"name_or_path"} | (set() if model.dtype == trained_dtype else {"weights_sample_sha256"})
    differ = {k: (v, loaded.get(k)) for k, v in record.items() if k not in unchecked and loaded.get(k) != v}
    if differ:
        raise ValueError(f"{record_path}: the run trained against {record.get('name_or_path')!r}, but "
                         f"model.name_or_path={model.name_or_path!r} loads {path}, another target: (trained "
                         f"against, loaded) differ in {differ}; set model.name_or_path to the target it trained "
                         f"against")


@dataclass
class PeerRun:
    """Another run's drafter, measured beside this run's on the same prompts, verified by its own target (the
    one it is served with: a Medusa run's stage-2 target, say)."""
    folder: Path
    recipe: Recipe
    conf: object
    trained: Trained
    target: object


def check_peer_runs(folders: list[str], policy: str) -> None:
    """``FileNotFoundError`` when the job opens, for an ``eval.peer_runs`` folder that is not there (under
    ``eval.unusable_peers=fail``): before training, not at the evaluation that ends it."""
    missing = [name for name in folders if not Path(name).is_dir()]
    if missing and policy == "fail":
        raise FileNotFoundError(f"eval.peer_runs: {', '.join(missing)}: no such run folder; train it first, drop it "
                                f"from eval.peer_runs, or set eval.unusable_peers=skip to measure without it")


def load_peer_runs(folders: list[str], record: dict, host_path: str, host_target,
                   policy: str = "fail") -> tuple[list[PeerRun], list[str]]:
    """The runs of ``eval.peer_runs`` that fit: finished (their save at least: :func:`check_finished`), of a
    registered drafter, trained against the target whose ``target.json`` record is ``record``. Each is verified
    by the target it is served with: ``host_target`` when that is the same folder as ``host_path`` (what this
    run is evaluated on), else its own, loaded. Returns them and one note per run (measured, or why it was
    skipped). A peer that does not fit raises ``ValueError`` naming it and why under ``policy`` fail
    (``eval.unusable_peers``); under skip it is a note and a WARNING line. Loading draws nothing from the global
    RNG."""
    peers, notes = [], []
    with torch.random.fork_rng(devices=[]):
        for name in folders:
            folder = Path(name)
            try:
                if not (folder / TARGET).exists():
                    raise FileNotFoundError(f"no {TARGET}: not a finished run of this version")
                theirs = json.loads((folder / TARGET).read_text())
                if record.keys() - theirs.keys():
                    raise FileNotFoundError(f"its {TARGET} lacks {sorted(record.keys() - theirs.keys())}: made by "
                                            f"an older draftheads, train it again to measure it here")
                if theirs != record:
                    raise ValueError(f"made for another target: (peer, this run) differ in "
                                     f"{ {k: (theirs.get(k), v) for k, v in record.items() if theirs.get(k) != v} }")
                recipe = drafters.of_run(folder)
                check_finished(folder, recipe.spec)
                conf = run_config(folder, recipe.spec)
                spec = recipe.target_of(folder, conf)
                path = resolve_target_path(spec, conf.cache_dir)
                target = (host_target if path == host_path
                          else load_target(spec, conf.cache_dir)[0].to(host_target.device))
                peers.append(PeerRun(folder, recipe, conf, recipe.load(folder, conf, target), target))
                notes.append(f"{folder}: {recipe.spec.name}, measured" + (
                    "" if target is host_target else f" on its own target {path}, the one it is served with"))
            except (FileNotFoundError, ValueError, KeyError) as e:  # KeyError: a key this version no longer has
                if policy == "fail":
                    raise ValueError(f"eval.peer_runs: {folder} cannot be measured beside this run ({e}); fix it, "
                                     f"drop it, or set eval.unusable_peers=skip") from e
                print(f"WARNING: eval.peer_runs: {folder} skipped ({e})", file=sys.stderr, flush=True)
                notes.append(f"{folder}: skipped ({e})")
    return peers, notes


def peer_methods(conf, peers: list[PeerRun], tokenizer, sampling: Sampling, taken: set[str], host) -> dict:
    """Every peer run's methods at ``sampling`` with this run's eval settings: its chain (by its drafter's
    name) and its own peers; a name already ``taken`` gets ``@<run folder name>``. A peer verified by another
    target than ``host`` (the evaluated one) is held, greedy, to that target's own plain decoding."""
    methods = {}
    n = conf.eval.max_new_tokens
    for peer in peers:
        peer_conf, target = replace(peer.conf, eval=conf.eval), peer.target
        chain = peer.recipe.chain(peer_conf, peer.trained, target)
        stop = stop_token_ids(tokenizer, target.generation_config)
        own = {chain.name: lambda ids, gen, d=chain, t=target, s=stop: speculative_decode(t, d, ids, n, s, sampling,
                                                                                            gen)}
        own |= peer.recipe.peers(peer_conf, peer.trained, target, tokenizer, sampling)
        if target is not host and sampling.greedy:
            own = {name: _against(target, decode, n, stop) for name, decode in own.items()}
        for name, decode in own.items():
            key = name if name not in taken | methods.keys() else f"{name}@{peer.folder.name}"
            methods[key] = decode
    return methods


def _against(target, decode, max_new_tokens: int, stop) -> Callable:
    """``decode`` whose result carries ``target``'s plain greedy tokens as its ``reference`` (decoded after the
    method, outside its timing)."""
    def run(ids, gen):
        result = decode(ids, gen)
        result.reference = plain_decode(target, ids, max_new_tokens, stop).tokens
        return result
    return run
