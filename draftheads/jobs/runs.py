"""Finished runs read back: a run's drafter, config and target (for re-evaluation, export and parity), and
other runs measured beside it (``eval.peer_runs``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from omegaconf import OmegaConf

from draftheads import drafters
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.methods import evaluate_methods, prompt_lookup_peer
from draftheads.models.speculative import Sampling, plain_decode, speculative_decode
from draftheads.models.target import load_target, resolve_target_path
from draftheads.training.config import apply_generation_defaults
from draftheads.training.job import TARGET_FILE
from draftheads.training.recipe import Recipe, Trained


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


def run_config(folder: Path, recipe: Recipe, overrides: list[str] = ()):
    """``folder``'s saved ``config.yaml`` as ``recipe.schema``, with ``key=value`` overrides. Raises
    ``ValueError`` for an undeclared key or a value outside a choice."""
    cfg = OmegaConf.merge(OmegaConf.structured(recipe.schema), OmegaConf.load(folder / "config.yaml"),
                          OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(cfg)


def open_run(run_dir: str | Path, overrides: list[str] = (), weights: str | None = None,
             partial: bool = False) -> SavedRun:
    """A finished run of any registered drafter: its config (with overrides), target and drafter, read by the
    drafter's strict loader from its save or from ``weights`` (an export folder, relative to the run or
    absolute); with ``partial`` the target's ends only (:mod:`draftheads.models.partial`: enough to read any
    drafter, not to decode). Raises ``FileNotFoundError`` for a folder holding no finished run, ``ValueError``
    for weights that do not fit the target."""
    folder = Path(run_dir)
    recipe = drafters.of_run(folder)
    conf = run_config(folder, recipe, overrides)
    target, tokenizer, path = load_target(replace(recipe.target_of(folder, conf), partial=partial), conf.cache_dir)
    apply_generation_defaults(conf, target.generation_config)
    return SavedRun(folder, recipe, conf, target, tokenizer, path, recipe.load(folder, conf, target, weights))


@dataclass
class PeerRun:
    """Another run's drafter, measured beside this run's on the same prompts, verified by its own target (the
    one it is served with: a Medusa run's stage-2 target, say)."""
    folder: Path
    recipe: Recipe
    conf: object
    trained: Trained
    target: object


def load_peer_runs(folders: list[str], record: dict, host_path: str, host_target) -> tuple[list[PeerRun], list[str]]:
    """The runs of ``eval.peer_runs`` that fit: finished, of a registered drafter, trained against the target
    whose ``target.json`` record is ``record``. Each is verified by the target it is served with: ``host_target``
    when that is the same folder as ``host_path`` (what this run is evaluated on), else its own, loaded. Returns
    them and one note per run (measured, or why it was skipped: a peer that does not fit is never a failure).
    Loading draws nothing from the global RNG."""
    peers, notes = [], []
    with torch.random.fork_rng(devices=[]):
        for name in folders:
            folder = Path(name)
            try:
                if not (folder / TARGET_FILE).exists():
                    raise FileNotFoundError(f"no {TARGET_FILE}: not a finished run of this version")
                theirs = json.loads((folder / TARGET_FILE).read_text())
                if record.keys() - theirs.keys():
                    raise FileNotFoundError(f"its {TARGET_FILE} lacks {sorted(record.keys() - theirs.keys())}: made by "
                                            f"an older draftheads, train it again to measure it here")
                if theirs != record:
                    raise ValueError(f"made for another target: (peer, this run) differ in "
                                     f"{ {k: (theirs.get(k), v) for k, v in record.items() if theirs.get(k) != v} }")
                recipe = drafters.of_run(folder)
                conf = run_config(folder, recipe)
                spec = recipe.target_of(folder, conf)
                path = resolve_target_path(spec, conf.cache_dir)
                target = host_target if path == host_path else load_target(spec, conf.cache_dir)[0].to(host_target.device)
                peers.append(PeerRun(folder, recipe, conf, recipe.load(folder, conf, target), target))
                notes.append(f"{folder}: {recipe.name}, measured" + ("" if target is host_target else f" on its own "
                                                                      f"target {path}, the one it is served with"))
            except (FileNotFoundError, ValueError, KeyError) as e:  # KeyError: a key this version no longer has
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


def evaluate_drafter(conf, recipe: Recipe, trained: Trained, target, tokenizer, eval_sets: dict,
                     peers: list[PeerRun] = ()) -> dict:
    """Speculative evaluation of ``trained`` (its chain) beside its own methods, the peer runs' and prompt
    lookup, on every eval set and temperature (:func:`draftheads.evaluation.methods.evaluate_methods`)."""
    drafter = recipe.chain(conf, trained, target)

    def peers_at(sampling: Sampling) -> dict:
        own = recipe.peers(conf, trained, target, tokenizer, sampling)
        own |= peer_methods(conf, list(peers), tokenizer, sampling, {drafter.name, *own}, target)
        return own | prompt_lookup_peer(conf.eval, target, tokenizer, sampling)

    return evaluate_methods(conf.eval, eval_sets, target, tokenizer, drafter, peers_at, conf.model.generation_defaults)
