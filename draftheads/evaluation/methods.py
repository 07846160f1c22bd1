"""Which methods an evaluation measures and on which prompts: the eval sets, every temperature, the drafter
under test beside its peers, and transformers' prompt lookup (the model-free peer)."""

from __future__ import annotations

from typing import Callable

from draftheads.data.regenerate import target_prompt_ids
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.evaluator import eval_modes, eval_prompts, evaluate_set
from draftheads.models.decoding import GenerationDefaults
from draftheads.models.speculative import Sampling, prompt_lookup_decode

PROMPT_LOOKUP = "prompt_lookup"
"""The model-free peer's report name (:func:`prompt_lookup_peer`)."""


def load_eval_sets(eval_cfg, tokenizer=None, context_window: int | None = None,
                   make: Callable | None = None) -> dict[str, list]:
    """Each eval set's held-out prompts by report name; a set with ``min_prompt_tokens`` counts them with the
    target's ``tokenizer`` (:func:`~draftheads.evaluation.evaluator.eval_prompts`). A set with ``thinking:
    both`` gives two entries, ``<name>[thinking]`` and ``<name>[no_thinking]``, the same prompts read in each
    mode (:func:`~draftheads.evaluation.evaluator.eval_modes`). Raises ``ValueError`` for no set (evaluation
    enabled), an empty set, two sets of one name, ``max_new_tokens`` < 1, a long set or a thinking mode without
    a tokenizer, a thinking mode for a template with no thinking switch, a prompt that with ``max_new_tokens`` does
    not fit the target's ``context_window`` (tokens; None: not checked), and the source's own error (file, line,
    field) for a malformed file. ``make(set, count)``: the set with its prompts made where the target writes them
    (a ``self_made`` set: :func:`~draftheads.data.pipeline.made_source`); without it such a set is refused."""
    if eval_cfg.max_new_tokens < 1:
        raise ValueError(f"eval.max_new_tokens={eval_cfg.max_new_tokens} must be >= 1")
    if eval_cfg.enabled and not eval_cfg.sets:
        raise ValueError("eval.sets=[]: no eval set to measure; name one (eval.sets=[{name: chitchat, source: "
                         "chitchat, num_prompts: 16}]) or set eval.enabled=false")
    modes = [(s, name, mode) for s in (eval_cfg.sets if eval_cfg.enabled else [])
             for name, mode in eval_modes(s, tokenizer)]
    names = [name for _, name, _ in modes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"eval.sets: two sets report under one name {twice}: give each its own name")
    made = {id(s): make(s, s.num_prompts) if make is not None else s for s in {id(s): s for s, _, _ in modes}.values()}
    sets = {name: eval_prompts(made[id(s)], tokenizer, mode) for s, name, mode in modes}
    for name, prompts in sets.items():
        if not prompts:
            raise ValueError(f"eval set {name!r} has no prompts (num_prompts >= 1 and a non-empty source needed)")
        if context_window is not None and tokenizer is not None:
            check_context(name, prompts, tokenizer, eval_cfg.max_new_tokens, context_window)
    return sets


def check_context(name: str, prompts: list, tokenizer, max_new_tokens: int, window: int) -> None:
    """``ValueError`` naming the set, its longest prompt and the target's context ``window`` when a prompt and
    ``max_new_tokens`` do not fit it: past its window a target's positions are ones it never trained on, and its
    acceptance there measures nothing a server would serve."""
    lengths = [(len(target_prompt_ids(tokenizer, p)), p) for p in prompts]
    longest, prompt = max(lengths, key=lambda x: x[0])
    if longest + max_new_tokens > window:
        over = sum(n + max_new_tokens > window for n, _ in lengths)
        raise ValueError(f"eval set {name!r}: {over} of {len(prompts)} prompts do not fit the target's context window "
                         f"of {window} tokens with eval.max_new_tokens={max_new_tokens} (the longest, {prompt.source} "
                         f"row {prompt.row}, has {longest} tokens): lower the set's min_prompt_tokens or "
                         f"eval.max_new_tokens, or drop the set")


def evaluate_methods(eval_cfg, eval_sets: dict[str, list], target, tokenizer, drafter,
                     peers_at: Callable[[Sampling], dict],
                     defaults: GenerationDefaults = GenerationDefaults.ignore) -> dict:
    """Speculative evaluation of ``drafter`` on every eval set at every temperature in ``eval.temperatures``:
    ``{set name: metrics}``, the set named ``<set>@T<t>`` for t > 0. ``peers_at(sampling)`` gives the methods
    measured beside it on the same prompts (``name -> decode(prompt_ids, generator)``), kept to ``eval.peers``
    when that is set (a name nothing offers, such as a skipped peer run's method, is left out:
    :func:`unmeasured_peers` says which); ``defaults`` says whether the sampling is the target's own (recorded)."""
    samplings = eval_cfg.samplings()
    offered = [peers_at(sampling) for sampling in samplings]
    if eval_cfg.peers is not None:
        offered = [{k: v for k, v in peers.items() if k in eval_cfg.peers} for peers in offered]
    results = {}
    for sampling, peers in zip(samplings, offered):
        for name, prompts in eval_sets.items():
            key = name if sampling.greedy else f"{name}@T{sampling.temperature:g}"
            results[key] = evaluate_set(target, tokenizer, drafter, prompts, eval_cfg.max_new_tokens,
                                        eval_cfg.tie_tolerance, sampling, eval_cfg.seed, peers, desc=f"eval {key}",
                                        defaults=defaults, context_buckets=tuple(eval_cfg.context_buckets))
    return results


def unmeasured_peers(eval_cfg, sets: dict[str, dict]) -> list[str]:
    """A note for each name in ``eval.peers`` that no evaluated set measured (its peer run skipped or not named, a
    method the run does not offer, such as a tree with ``tree.enabled=false``); ``sets`` as
    :func:`evaluate_methods` returns them."""
    measured = {name for metrics in sets.values() for name in metrics.get("peers", {})}
    return [f"eval.peers: {name} not measured: no method of this run or of its measured peer runs is named so"
            for name in eval_cfg.peers or () if name not in measured]


def prompt_lookup_peer(eval_cfg, target, tokenizer, sampling: Sampling) -> dict:
    """transformers' prompt-lookup decoding, the model-free peer, at this temperature (lossless)."""
    if eval_cfg.prompt_lookup_tokens <= 0:
        return {}
    stop, n = stop_token_ids(tokenizer, target.generation_config), eval_cfg.max_new_tokens
    return {PROMPT_LOOKUP: lambda ids, gen: prompt_lookup_decode(target, ids, n, stop, eval_cfg.prompt_lookup_tokens,
                                                                   sampling, gen)}
