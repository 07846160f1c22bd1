"""The speculative evaluator: plain greedy vs draft-then-verify decoding of the same held-out prompts,
measured side by side in one run, and the report (``report.json``, a terminal table, a PNG plot).

Definitions (as in the Medusa/EAGLE papers and vLLM/SGLang metrics):
- ``acceptance_length`` (tau): 1 + drafts accepted per verification step, counted by the verification itself at
  every step, before the token budget or a stop token cuts what is emitted (vLLM's mean acceptance length
  1 + accepted / drafts, EAGLE's accepted + 1 per step); it equals 1 + the sum of the cumulative acceptances;
- ``tokens_per_step``: tokens emitted per verification step after those cuts (what the speedup follows; z-lab's
  reference ``dflash`` package reports this as its acceptance length);
- ``acceptance_rate_per_position[i]``: P(draft i accepted | drafts < i accepted) (EAGLE's n-alpha);
- ``cumulative_acceptance_per_position[i]``: P(drafts 0..i all accepted), unconditional (vLLM's per-position
  acceptance: accepted at position i / drafts);
- ``verified_drafts_per_step``: draft positions the target verified per step (gamma, or fewer where a method
  chooses: DSpark's adaptive verification); ``accepted_per_verified_draft``: accepted / verified drafts;
- ``speedup``: speculative tokens/s over plain decoding's tokens/s, same prompts, same process, interleaved,
  every method warmed up first; tokens/s include the prefill, ``decode_ms_per_token`` leaves it out;
- ``by_context_length``: tau and acceptance per position over the steps in each context-length bucket
  (:mod:`draftheads.evaluation.context`).
"""

from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from draftheads.data.conversations import first_user_prompts, long_prompts, prompt_pieces
from draftheads.data.regenerate import prompt_ids, target_prompt_ids
from draftheads.data.templates import THINKING_LABELS, check_thinking_switch, stop_token_ids
from draftheads.evaluation.context import (
    WHOLE,
    acceptance_rates,
    bucket_label,
    by_context_length,
    format_context_table,
    plot_by_context,
)
from draftheads.evaluation.intervals import intervals, paired, prompt_counts, resample_weights, statistics
from draftheads.models.decoding import GenerationDefaults, generation_defaults
from draftheads.models.speculative import ChainDrafter, DecodeResult, Sampling, plain_decode, speculative_decode
from draftheads.run_folder import PLOT, write_report

NOTES = ("acceptance_length (tau) = 1 + drafts accepted per verification step, counted before the token budget and "
         "stop tokens cut the output (as vLLM and EAGLE count; = 1 + sum of cumulative_acceptance_per_position); "
         "tokens_per_step counts after those cuts; alpha is conditional on earlier positions; tokens_per_second and "
         "speedup include the prefill, decode_ms_per_token does not; every method is warmed up before timing")
""":data:`NOTES` go into every report beside the numbers they define."""


def eval_modes(set_cfg, tokenizer=None) -> list[tuple[str, bool | None]]:
    """``(report name, thinking mode)`` per measurement of one eval set (its ``thinking``): ``[(name, None)]``
    for the template's default rendering, ``[(name, True)]`` / ``[(name, False)]`` for one mode, and
    ``[(name[thinking], True), (name[no_thinking], False)]`` for both. Raises ``ValueError`` for a mode asked
    without a tokenizer or of a chat template with no thinking switch."""
    if set_cfg.thinking is None:
        return [(set_cfg.name, None)]
    key = f"eval set {set_cfg.name!r}: thinking={set_cfg.thinking}"
    if tokenizer is None:
        raise ValueError(f"{key} renders the target's chat template, and no tokenizer was given")
    check_thinking_switch(tokenizer, key)
    if set_cfg.thinking == "both":
        return [(f"{set_cfg.name}[{THINKING_LABELS[mode]}]", mode) for mode in (True, False)]
    return [(set_cfg.name, bool(set_cfg.thinking))]


def eval_prompts(set_cfg, tokenizer=None, thinking: bool | None = None) -> list:
    """Held-out prompts of one eval set (chitchat's eval split never overlaps training), each to be read in the
    ``thinking`` mode (``Prompt.thinking``; None: the template's default); with ``min_prompt_tokens``, long
    ones joined from the source's pieces until ``tokenizer`` counts that many tokens in the prompt the target
    reads. Raises ``ValueError`` for such a set without a tokenizer."""
    if not set_cfg.min_prompt_tokens:
        return [replace(p, thinking=thinking) for p in first_user_prompts(set_cfg, "eval", set_cfg.num_prompts)]
    if tokenizer is None:
        raise ValueError(f"eval set {set_cfg.name!r}: min_prompt_tokens counts the target's tokens, and no tokenizer "
                         f"was given")
    prompts = long_prompts(prompt_pieces(set_cfg, "eval"), set_cfg.num_prompts, set_cfg.min_prompt_tokens,
                           lambda p: len(target_prompt_ids(tokenizer, replace(p, thinking=thinking))))
    return [replace(p, thinking=thinking) for p in prompts]


def evaluate_set(target, tokenizer, drafter: ChainDrafter, prompts: list, max_new_tokens: int,
                 tie_tolerance: float, sampling: Sampling = Sampling(), seed: int = 0,
                 peers: dict[str, Callable[[torch.Tensor], DecodeResult]] | None = None, desc: str = "eval",
                 defaults: GenerationDefaults = GenerationDefaults.ignore,
                 context_buckets: tuple[int, ...] = WHOLE) -> dict:
    """Decode every prompt with the baseline, the chain drafter and each peer; return the set's metrics.

    Args:
        peers: other methods measured on the same prompts, ``name -> decode(prompt_ids, generator) ->
            DecodeResult`` (tree verification, prompt lookup...); reported under ``peers``.
        defaults: whether ``sampling`` came from the target's ``generation_config`` (recorded under
            ``decoding`` beside those defaults and the stop set).
        context_buckets: edges of the ``by_context_length`` buckets (``eval.context_buckets``).
    With sampling, every method draws from seeded generators; ``greedy_match`` then only says how often two
    independent samples coincide and is reported as None.
    """
    device = next(target.parameters()).device
    stop = stop_token_ids(tokenizer, target.generation_config)
    peers = peers or {}
    generator = torch.Generator().manual_seed(seed)
    warm = torch.tensor(prompt_ids(tokenizer, "Hello"), device=device)
    plain_decode(target, warm, 4, stop), speculative_decode(target, drafter, warm, 4, stop)  # one-time costs
    for decode in peers.values():  # every method pays its own one-time costs before timing
        decode(warm, torch.Generator().manual_seed(seed))
    plain, spec, mismatches = [], [], []
    others: dict[str, list[DecodeResult]] = {name: [] for name in peers}
    for p in tqdm(prompts, desc=desc, unit="prompt"):
        ids = torch.tensor(target_prompt_ids(tokenizer, p), device=device)
        plain.append(plain_decode(target, ids, max_new_tokens, stop, sampling, generator))
        spec.append(speculative_decode(target, drafter, ids, max_new_tokens, stop, sampling, generator))
        for name, decode in peers.items():
            others[name].append(decode(ids, generator))
        if sampling.greedy and plain[-1].tokens != spec[-1].tokens:
            mismatches.append(_mismatch(p, plain[-1], spec[-1], tie_tolerance))
    metrics = summarize(plain, spec, drafter.gamma, max_new_tokens, mismatches, context_buckets)
    if peers:
        metrics["peers"] = {name: _peer_summary(plain, results, prompts, tie_tolerance, sampling.greedy,
                                                context_buckets)
                            for name, results in others.items()}
    if not sampling.greedy:  # two samples need not coincide: no match to claim
        for m in [metrics, *metrics.get("peers", {}).values()]:
            m["greedy_match"] = None
    with_intervals(metrics, plain, {drafter.name: spec, **others}, seed)
    metrics["method"] = drafter.name
    modes = {p.thinking for p in prompts}
    metrics["thinking"] = modes.pop() if len(modes) == 1 else None  # the rendering measured (None: the default)
    metrics["sampling"] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                           "proposal": sampling.proposal}
    metrics["decoding"] = {"stop_token_ids": sorted(stop), "generation_defaults": str(defaults),
                           "target_generation_defaults": generation_defaults(target.generation_config)}
    return metrics


def with_intervals(metrics: dict, plain: list[DecodeResult], methods: dict[str, list[DecodeResult]],
                   seed: int) -> None:
    """Add 95% intervals over prompts (:mod:`draftheads.evaluation.intervals`) to a set's entry, in place: each
    method's ``intervals`` (tau, tokens per step, alpha and cumulative acceptance per position, speedup over the
    plain decoding, greedy_match where compared), an ``interval`` on each ``by_context_length`` bucket's tau, and
    the set's ``paired`` tau differences, every method against every other (``"a - b"``), on the same draws.
    ``methods``: the drafter's results first, then each peer's (their entries in ``metrics["peers"]``), one per
    prompt in the order of ``plain``."""
    weights = resample_weights(len(plain), seed)
    baseline = prompt_counts(plain, 0)
    draws = {}
    for i, (name, results) in enumerate(methods.items()):
        entry = metrics if i == 0 else metrics["peers"][name]
        gamma = max([r.gamma for r in results] + [len(entry.get("acceptance_rate_per_position", []))])
        own = [p.tokens if r.reference is None else r.reference for p, r in zip(plain, results)]
        matches = None if entry["greedy_match"] is None else [a == r.tokens for a, r in zip(own, results)]
        draws[name] = statistics(prompt_counts(results, gamma, matches), weights, baseline)
        entry["intervals"] = intervals(draws[name])
        for bucket in entry.get("by_context_length") or []:
            counts = prompt_counts(results, gamma, context=tuple(bucket["context_tokens"]))
            bucket["interval"] = intervals(statistics(counts, weights))["acceptance_length"]
    names = list(draws)
    metrics["paired"] = {f"{a} - {b}": paired(draws[a], draws[b]) for i, a in enumerate(names) for b in names[i + 1:]}


def acceptance(results: list[DecodeResult], gamma: int, context_buckets: tuple[int, ...] = WHOLE) -> dict:
    """tau, tokens per step and per-position acceptance of a method that reports its verification steps (see
    the module's definitions), and the same per context-length bucket (``by_context_length``: the buckets of
    ``context_buckets`` that hold steps); a method that does not (transformers' prompt lookup) gets tokens per
    target forward for both, every forward of its ``generate`` verifying drafts, the prefill's included. A
    method that records the drafts it verified per step (chain decoding) also gets ``verified_drafts_per_step``
    (gamma under fixed-length verification, fewer under adaptive verification) and ``accepted_per_verified_draft``
    (accepted / verified drafts: the share of verification work that was kept)."""
    if not any(r.accepted_per_step for r in results):
        per_forward = sum(len(r.tokens) for r in results) / max(sum(r.target_forwards for r in results), 1)
        return {"acceptance_length": per_forward, "tokens_per_step": per_forward}
    accepted = [n for r in results for n in r.accepted_per_step]
    verified = [v for r in results for v in r.verified_per_step] if all(
        len(r.verified_per_step) == len(r.accepted_per_step) for r in results) else None
    alpha, cumulative = acceptance_rates(accepted, gamma, verified)
    out = {"acceptance_length": 1 + sum(accepted) / len(accepted),
           "tokens_per_step": sum(n for r in results for n in r.emitted_per_step) / len(accepted),
           "acceptance_rate_per_position": alpha, "cumulative_acceptance_per_position": cumulative}
    if verified is not None:  # what the target's verification forwards cost beside what they gave
        out |= {"verified_drafts_per_step": sum(verified) / len(verified),
                "accepted_per_verified_draft": sum(accepted) / max(sum(verified), 1)}
    buckets = by_context_length(results, gamma, context_buckets)
    return out if buckets is None else {**out, "by_context_length": buckets}


def _tokens_per_second(results: list[DecodeResult]) -> float:
    return sum(len(r.tokens) for r in results) / sum(r.seconds for r in results)


def _decode_ms_per_token(results: list[DecodeResult]) -> float | None:
    """Milliseconds per token after the first (the prefill's), None when the method does not time its prefill."""
    if any(r.prefill_seconds is None for r in results):
        return None
    decoded = sum(len(r.tokens) - 1 for r in results)
    return 1000 * sum(r.seconds - r.prefill_seconds for r in results) / max(decoded, 1)


def _peer_summary(plain: list[DecodeResult], peer: list[DecodeResult], prompts: list, tie_tolerance: float,
                  greedy: bool, context_buckets: tuple[int, ...] = WHOLE) -> dict:
    """A peer's acceptance (over its own gamma), tokens/s and speedup over the same baseline, decode time per
    token, greedy agreement (with the plain decoding of the target that verifies it: ``DecodeResult.reference``)
    and, greedy, where it first differs and whether that was a tie (:func:`_mismatch`; a reference's logits are
    not kept, so a difference from it is never called a tie), and draft cost when the method reports steps."""
    own = [a if b.reference is None else DecodeResult(tokens=b.reference) for a, b in zip(plain, peer)]
    mismatches = [_mismatch(p, a, b, tie_tolerance) for p, a, b in zip(prompts, own, peer)
                  if greedy and a.tokens != b.tokens]
    tps = _tokens_per_second(peer)
    summary = {**acceptance(peer, max(r.gamma for r in peer), context_buckets),
               "tokens_per_second": tps, "speedup": tps / _tokens_per_second(plain),
               "decode_ms_per_token": _decode_ms_per_token(peer),
               "target_forwards_per_token": sum(r.target_forwards for r in peer) / sum(len(r.tokens) for r in peer),
               "greedy_match": sum(a.tokens == b.tokens for a, b in zip(own, peer)) / len(plain),
               "greedy_ties": sum(m["tie"] for m in mismatches), "mismatches": mismatches}
    if any(r.accepted_per_step for r in peer):
        summary |= _draft_cost(peer)
    return summary


def _draft_cost(results: list[DecodeResult]) -> dict:
    """Seconds drafting vs verifying, and milliseconds of drafting per verification step."""
    steps = max(sum(len(r.accepted_per_step) for r in results), 1)
    draft = sum(r.draft_seconds for r in results)
    return {"time_split_s": {"draft": draft, "verify": sum(r.verify_seconds for r in results)},
            "draft_ms_per_step": 1000 * draft / steps}


def _mismatch(prompt, plain: DecodeResult, spec: DecodeResult, tie_tolerance: float) -> dict:
    """Where two greedy outputs first differ, and whether the target's top-2 logits were tied there: closer than
    ``tie_tolerance`` or than the logits' own resolution in their dtype (one bf16 step is 0.125 at 20)."""
    i = next((j for j, (a, b) in enumerate(zip(plain.tokens, spec.tokens)) if a != b),
             min(len(plain.tokens), len(spec.tokens)))
    gap = plain.top2_gaps[i] if i < len(plain.top2_gaps) else float("inf")
    resolution = plain.logit_steps[i] if i < len(plain.logit_steps) else 0.0
    return {"source": prompt.source, "row": prompt.row, "first_difference": i, "top2_logit_gap": gap,
            "logit_resolution": resolution, "tie": gap <= max(tie_tolerance, resolution)}


def summarize(plain: list[DecodeResult], spec: list[DecodeResult], gamma: int, max_new_tokens: int,
              mismatches: list[dict], context_buckets: tuple[int, ...] = WHOLE) -> dict:
    """Aggregate per-prompt results into the set's report entry."""
    spec_tokens = sum(len(r.tokens) for r in spec)
    return {
        **acceptance(spec, gamma, context_buckets),
        "tokens_per_second": {"speculative": _tokens_per_second(spec), "baseline": _tokens_per_second(plain)},
        "speedup": _tokens_per_second(spec) / _tokens_per_second(plain),
        "decode_ms_per_token": {"speculative": _decode_ms_per_token(spec), "baseline": _decode_ms_per_token(plain)},
        "target_forwards_per_token": {"speculative": sum(r.target_forwards for r in spec) / spec_tokens,
                                      "baseline": sum(r.target_forwards for r in plain)
                                                  / sum(len(r.tokens) for r in plain)},
        **_draft_cost(spec),
        "greedy_match": sum(a.tokens == b.tokens for a, b in zip(plain, spec)) / len(plain),
        "greedy_ties": sum(m["tie"] for m in mismatches),
        "accepted_histogram": torch.bincount(torch.tensor([n for r in spec for n in r.accepted_per_step],
                                                          dtype=torch.long),
                                             minlength=gamma + 1).tolist(),
        "mismatches": mismatches,
        "num_prompts": len(plain),
        "max_new_tokens": max_new_tokens,
        "gamma": gamma,
        "new_tokens": spec_tokens,
    }


def hardware() -> dict:
    """What the timings were measured on."""
    device = "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"device": device, "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def format_table(sets: dict) -> str:
    """A terminal table: per eval set, the drafter under test and any peer measured beside it."""
    w = max([16, *(len(name) + 2 for name in sets)])  # per-mode sets are long: chitchat[no_thinking]
    head = (f"{'set':<{w}}{'method':<21}{'tau [95% interval]':>20}{'alpha per position':>30}{'tok/s':>8}"
            f"{'AR tok/s':>10}{'speedup':>9}{'greedy_match':>14}")
    lines = [head, "-" * len(head)]
    for name, m in sets.items():
        rows = [(_method(m), m, _alphas(m["acceptance_rate_per_position"]), m["tokens_per_second"]["speculative"])]
        rows += [(peer, p, _alphas(p.get("acceptance_rate_per_position", [])), p["tokens_per_second"])
                 for peer, p in m.get("peers", {}).items()]
        for method, r, alphas, tps in rows:
            match = "n/a (T>0)" if r["greedy_match"] is None else f"{r['greedy_match']:.2f}"
            tau = with_interval(r["acceptance_length"], r.get("intervals", {}).get("acceptance_length"))
            lines.append(f"{name:<{w}}{method:<21}{tau:>20}{alphas:>30}{tps:>8.1f}"
                         f"{m['tokens_per_second']['baseline']:>10.1f}{r['speedup']:>9.2f}{match:>14}")
    pairs = [(name, pair, d) for name, m in sets.items() for pair, d in (m.get("paired") or {}).items() if d]
    if pairs:
        lines += ["", f"{'paired tau difference':<{w + 42}}{'a - b [95% interval]':>22}", "-" * (w + 64)]
        lines += [f"{name:<{w}}{pair:<42}{with_interval(d['difference'], d['interval'], '+.2f'):>22}"
                  for name, pair, d in pairs]
    by_context = format_context_table(_context_rows(sets))
    return "\n".join(lines) + (f"\n\n{by_context}" if by_context else "")


def with_interval(value: float, interval: list | None, spec: str = ".2f") -> str:
    """``1.53 [1.41,1.66]``: a number and its interval (the number alone where it has none: an older report)."""
    return f"{value:{spec}}" if not interval else f"{value:{spec}} [{interval[0]:.2f},{interval[1]:.2f}]"


def _context_rows(sets: dict) -> list[tuple[str, str, list[dict]]]:
    """``(set, method, by_context_length)`` of every method that has it (reports from before it had none)."""
    return [(name, method, r["by_context_length"]) for name, m in sets.items()
            for method, r in _methods(m).items() if r.get("by_context_length")]


def _alphas(rates: list[float], shown: int = 5) -> str:
    """The first ``shown`` per-position rates (a block drafter has up to B-1); the report has them all."""
    text = " ".join(f"{a:.2f}" for a in rates[:shown])
    return text + " .." if len(rates) > shown else text


def _methods(m: dict) -> dict[str, dict]:
    """The drafter's entry and every peer's, by method name."""
    return {_method(m): m, **m.get("peers", {})}


def _method(m: dict) -> str:
    """The drafter's method name (reports written before names were recorded say ``chain``)."""
    return m.get("method", "chain")


def plot_acceptance(sets: dict, path: str | Path) -> None:
    """PNG with three panels: conditional acceptance per draft position (chain and tree, per set; shaded: the 95%
    interval over prompts), histogram of accepted drafts per verification step (chain), and tau per set and method
    (error bars: the 95% interval); and a fourth, tau
    per context-length bucket per set and method, when the report has ``by_context_length``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = _context_rows(sets)
    fig, axes = plt.subplots(1, 4 if contexts else 3, figsize=(19 if contexts else 14, 3.6), dpi=110)
    pos, hist, bars = axes[:3]
    if contexts:
        plot_by_context(axes[3], contexts)
    for name, m in sets.items():
        for method, r in _methods(m).items():
            rates = r.get("acceptance_rate_per_position")
            if rates:
                line, = pos.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} {method}")
                bands = r.get("intervals", {}).get("acceptance_rate_per_position")
                if bands and all(bands):  # the 95% interval over prompts, shaded
                    pos.fill_between(range(1, len(rates) + 1), [b[0] for b in bands], [b[1] for b in bands],
                                     color=line.get_color(), alpha=0.15)
        counts = m["accepted_histogram"]
        hist.bar([i + 0.8 * list(sets).index(name) / len(sets) for i in range(len(counts))],
                 [c / max(sum(counts), 1) for c in counts], width=0.8 / len(sets), label=name)
    pos.set(xlabel="draft position", ylabel="acceptance | previous accepted", ylim=(0, 1),
            xticks=range(1, max(m["gamma"] for m in sets.values()) + 1))
    centre = 0.4 * (len(sets) - 1) / len(sets)
    gamma = max(m["gamma"] for m in sets.values())
    hist.set(xlabel="drafts accepted per step (chain)", ylabel="fraction of steps",
             xticks=[i + centre for i in range(gamma + 1)], xticklabels=range(gamma + 1))
    methods = sorted({method for m in sets.values() for method in _methods(m)})
    for j, method in enumerate(methods):
        entries = [_methods(m).get(method, {}) for m in sets.values()]
        taus = [e.get("acceptance_length", 0.0) for e in entries]
        spans = [e.get("intervals", {}).get("acceptance_length") or [t, t] for e, t in zip(entries, taus)]
        bars.bar([i + 0.8 * j / len(methods) for i in range(len(sets))], taus, width=0.8 / len(methods), label=method,
                 yerr=[[t - lo for t, (lo, _) in zip(taus, spans)], [hi - t for t, (_, hi) in zip(taus, spans)]],
                 capsize=2)
    bars.set(xticks=[i + 0.4 * (len(methods) - 1) / len(methods) for i in range(len(sets))], xticklabels=list(sets),
             ylabel="tau (tokens per target forward), 95% interval")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report_and_plot(report: dict, output_dir: str | Path) -> Path:
    """The run's report (:func:`~draftheads.run_folder.write_report`: atomic) and, when it has an evaluation,
    its plot (:data:`~draftheads.run_folder.PLOT`: per-position acceptance, accepted-per-step histogram, tau per
    set and method) in the run directory; returns the report's path."""
    out = Path(output_dir)
    path = write_report(out, report)
    if report.get("eval"):
        plot_acceptance(report["eval"], out / PLOT)
    return path


def log_eval(accelerator, sets: dict, plot: str | Path, step: int) -> None:
    """Every method's scalars (:func:`flat_metrics`) and the acceptance plot, as an image, in the run's
    trackers (W&B and TensorBoard take images)."""
    accelerator.log(flat_metrics(sets), step=step)
    if not Path(plot).exists():
        return
    for tracker in accelerator.trackers:
        if tracker.name == "wandb":
            tracker.log_images({"eval/acceptance": [str(plot)]}, step=step)
        elif tracker.name == "tensorboard":
            import matplotlib.image
            image = matplotlib.image.imread(plot)[None, ..., :3]  # [1, H, W, RGB] floats in [0, 1]
            tracker.log_images({"eval/acceptance": image}, step=step, dataformats="NHWC")


def flat_metrics(sets: dict) -> dict[str, float]:
    """Tracker-friendly ``eval/<set>/<method>/<metric>`` scalars for every method measured."""
    out = {}
    for name, m in sets.items():
        for method, r in _methods(m).items():
            key = f"eval/{name}/{method}"
            out[f"{key}/acceptance_length"] = r["acceptance_length"]
            span = r.get("intervals", {}).get("acceptance_length")
            if span:
                out[f"{key}/acceptance_length_lo"], out[f"{key}/acceptance_length_hi"] = span
            out[f"{key}/speedup"] = r["speedup"]
            tps = r["tokens_per_second"]
            out[f"{key}/tokens_per_s"] = tps["speculative"] if isinstance(tps, dict) else tps
            if r["greedy_match"] is not None:
                out[f"{key}/greedy_match"] = r["greedy_match"]
            for i, a in enumerate(r.get("acceptance_rate_per_position", [])):
                out[f"{key}/alpha_pos{i + 1}"] = a
            for b in r.get("by_context_length") or []:
                out[f"{key}/tau_context_{bucket_label(b)}"] = b["acceptance_length"]
    return out
