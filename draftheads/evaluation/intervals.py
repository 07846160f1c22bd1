"""95% intervals on every acceptance number the evaluator reports, resampled over prompts, and paired differences
between methods measured on the same prompts.

The unit that varies between two evaluations is the prompt: a drafter accepts long runs on some prompts and
almost nothing on others, and the steps of one prompt are not independent draws. So each number is recomputed on
prompts drawn with replacement (the nonparametric bootstrap, Efron & Tibshirani 1993, ch. 13: the percentile
interval), :data:`RESAMPLES` times, from one seeded generator; every number is a ratio of sums over the drawn
prompts, as the point estimate is over all of them (tau = 1 + accepted / steps: a prompt weighs by its steps).
A paired difference (method a minus method b) is computed on the same draws for both, so the prompts' own
difficulty, which both methods share, cancels: its interval excludes zero only where one method is better on
these prompts beyond what resampling them explains.

Per-prompt counts come from :class:`~draftheads.models.speculative.DecodeResult` (:func:`prompt_counts`), the
same counters the point estimates in :mod:`draftheads.evaluation.evaluator` and
:mod:`draftheads.evaluation.context` sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

RESAMPLES = 2000
"""Bootstrap draws per eval set (the percentile interval's 2.5% and 97.5% points move by about 0.005 in tau
between seeds at this many)."""
LEVEL = 0.95
"""The intervals' coverage."""


@dataclass
class Counts:
    """One method's counters per prompt, each an array over the prompts in order (``[n]``; ``passed`` and
    ``attempted`` ``[n, gamma]``)."""
    steps: np.ndarray
    """Verification steps (0 for a method that reports none: prompt lookup)."""
    accepted: np.ndarray
    """Drafts accepted, summed over the prompt's steps."""
    emitted: np.ndarray
    """Tokens emitted by the steps (after the budget and stop cuts)."""
    tokens: np.ndarray
    """New tokens."""
    forwards: np.ndarray
    """Target forwards (prefill included)."""
    seconds: np.ndarray
    """Wall time of the decoding."""
    passed: np.ndarray
    """Steps whose draft at position i (0-based column) was accepted."""
    attempted: np.ndarray
    """Steps that verified position i after accepting every earlier one (alpha's denominator)."""
    match: np.ndarray | None = None
    """1 where the greedy output equals the plain decoding's, else 0 (None: not compared, T > 0)."""


def prompt_counts(results: Sequence, gamma: int, matches: Sequence[bool] | None = None,
                  context: tuple[int, int | None] | None = None) -> Counts:
    """The per-prompt :class:`Counts` of one method's ``results`` (one
    :class:`~draftheads.models.speculative.DecodeResult` per prompt) over draft positions ``0..gamma-1``;
    ``context`` ``(lo, hi)`` keeps only the steps whose context length is in ``[lo, hi)`` (``hi`` None: open),
    as :func:`~draftheads.evaluation.context.by_context_length` buckets them."""
    n = len(results)
    c = Counts(*(np.zeros(n) for _ in range(6)), np.zeros((n, gamma)), np.zeros((n, gamma)),
               None if matches is None else np.asarray(matches, dtype=float))
    for j, r in enumerate(results):
        c.tokens[j], c.forwards[j], c.seconds[j] = len(r.tokens), r.target_forwards, r.seconds
        verified = r.verified_per_step or [gamma] * len(r.accepted_per_step)
        contexts = r.context_per_step or [0] * len(r.accepted_per_step)
        for ctx, a, e, v in zip(contexts, r.accepted_per_step, r.emitted_per_step, verified):
            if context is not None and not (ctx >= context[0] and (context[1] is None or ctx < context[1])):
                continue
            c.steps[j] += 1
            c.accepted[j] += a
            c.emitted[j] += e
            for i in range(gamma):
                c.passed[j, i] += a >= i + 1
                c.attempted[j, i] += a >= i and v > i
    return c


def resample_weights(n: int, seed: int, resamples: int = RESAMPLES) -> np.ndarray:
    """``[resamples + 1, n]``: how many times each of ``n`` prompts is drawn in each bootstrap sample (a row of
    a multinomial over the prompts), after a first row of ones (the sample itself: the point estimate)."""
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples) if n else np.zeros((resamples, 0))
    return np.vstack([np.ones((1, n)), draws])


def statistics(c: Counts, w: np.ndarray, baseline: Counts | None = None) -> dict[str, np.ndarray]:
    """Every reported number of one method for each row of weights ``w`` (``[R, n]``, :func:`resample_weights`):
    ``acceptance_length`` and ``tokens_per_step`` ``[R]`` (tokens per target forward for a method without steps,
    as :func:`~draftheads.evaluation.evaluator.acceptance` reports it), ``acceptance_rate_per_position`` and
    ``cumulative_acceptance_per_position`` ``[R, gamma]`` (with steps), ``speedup`` ``[R]`` (with ``baseline``:
    tokens/s over the baseline's on the same draw), ``greedy_match`` ``[R]`` (where compared). A ratio whose
    denominator is 0 on a draw is NaN there."""
    steps = w @ c.steps
    out = {}
    if c.steps.any():
        out["acceptance_length"] = 1 + _ratio(w @ c.accepted, steps)
        out["tokens_per_step"] = _ratio(w @ c.emitted, steps)
        out["acceptance_rate_per_position"] = _ratio(w @ c.passed, w @ c.attempted)
        out["cumulative_acceptance_per_position"] = _ratio(w @ c.passed, steps[:, None])
    else:
        out["acceptance_length"] = out["tokens_per_step"] = _ratio(w @ c.tokens, w @ c.forwards)
    if baseline is not None:
        out["speedup"] = _ratio(_ratio(w @ c.tokens, w @ c.seconds), _ratio(w @ baseline.tokens, w @ baseline.seconds))
    if c.match is not None:
        out["greedy_match"] = _ratio(w @ c.match, w.sum(1))
    return out


def intervals(draws: dict[str, np.ndarray]) -> dict[str, list]:
    """The :data:`LEVEL` percentile interval ``[lo, hi]`` of each statistic from :func:`statistics` (its first row,
    the point estimate, left out); ``[[lo, hi], ...]`` per position for the per-position ones; None where every
    draw is NaN."""
    return {name: _interval(d[1:]) for name, d in draws.items()}


def paired(a: dict[str, np.ndarray], b: dict[str, np.ndarray], name: str = "acceptance_length") -> dict | None:
    """``a - b`` for statistic ``name`` of two methods on the same draws (:func:`statistics` with the same
    weights): ``{"difference", "interval"}``, None where either lacks it."""
    if name not in a or name not in b:
        return None
    diff = a[name] - b[name]
    return {"difference": float(diff[0]), "interval": _interval(diff[1:])}


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num, den = np.broadcast_arrays(np.asarray(num, dtype=float), np.asarray(den, dtype=float))
    return np.divide(num, den, out=np.full(num.shape, np.nan), where=den != 0)


def _interval(d: np.ndarray):
    lo, hi = 100 * (1 - LEVEL) / 2, 100 * (1 + LEVEL) / 2
    if d.ndim == 2:
        return [_interval(d[:, i]) for i in range(d.shape[1])]
    d = d[~np.isnan(d)]
    return None if d.size == 0 else [float(np.percentile(d, lo)), float(np.percentile(d, hi))]
