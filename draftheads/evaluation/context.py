"""Tau by context length: a method's verification steps bucketed by the context they verify at (the prompt plus
the tokens generated before the step), with tau and acceptance per position in each bucket counted exactly as
over the whole set (:func:`~draftheads.evaluation.evaluator.acceptance`), so the decay with context is measured
on long prompts (an eval set's ``min_prompt_tokens``) rather than guessed from short ones."""

from __future__ import annotations

from collections.abc import Sequence

WHOLE = (0,)
"""One open bucket: every step (what a caller that names no edges gets; a job passes ``eval.context_buckets``)."""


def acceptance_rates(accepted: Sequence[int], gamma: int,
                     verified: Sequence[int] | None = None) -> tuple[list[float], list[float]]:
    """Conditional and cumulative acceptance per draft position, from drafts accepted per step:
    alpha_i = P(draft i accepted | drafts < i accepted and draft i verified), and P(drafts 1..i all accepted) over
    all steps. ``verified``: draft positions verified per step (default gamma each: fixed-length verification); a
    step that verified fewer than i drafts does not count toward alpha_i (it never tried draft i)."""
    steps = max(len(accepted), 1)
    verified = [gamma] * len(accepted) if verified is None else verified
    attempted = [sum(n >= i and v > i for n, v in zip(accepted, verified)) for i in range(gamma)]
    passed = [sum(n >= i + 1 for n in accepted) for i in range(gamma)]
    return [p / a if a else 0.0 for p, a in zip(passed, attempted)], [p / steps for p in passed]


def bucket_label(bucket: dict) -> str:
    """``"256-512"``, or ``"8192+"`` for the open last bucket."""
    lo, hi = bucket["context_tokens"]
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def by_context_length(results: list, gamma: int, edges: Sequence[int] = WHOLE) -> list[dict] | None:
    """Every non-empty bucket of ``edges`` with the steps of ``results`` (:class:`DecodeResult`) whose context
    falls in it: ``context_tokens`` ``[lo, hi)`` (``hi`` None: open), ``steps``, ``accepted`` (drafts) and
    ``emitted`` (tokens), ``acceptance_length`` (tau = 1 + accepted / steps, as the servers count it),
    ``tokens_per_step``, ``acceptance_rate_per_position``, ``cumulative_acceptance_per_position``. The buckets'
    steps, accepted and emitted sum to the set's. None for a method that records no step contexts (prompt
    lookup: transformers' ``generate`` reports no steps)."""
    steps = [(c, n, e, v) for r in results
             for c, n, e, v in zip(r.context_per_step, r.accepted_per_step, r.emitted_per_step,
                                   r.verified_per_step or [gamma] * len(r.accepted_per_step))]
    if not steps or any(len(r.context_per_step) != len(r.accepted_per_step) for r in results):
        return None
    buckets = []
    for lo, hi in zip(edges, [*edges[1:], None]):
        inside = [(n, e, v) for c, n, e, v in steps if c >= lo and (hi is None or c < hi)]
        if not inside:
            continue
        accepted = [n for n, _, _ in inside]
        alpha, cumulative = acceptance_rates(accepted, gamma, [v for _, _, v in inside])
        buckets.append({"context_tokens": [lo, hi], "steps": len(inside), "accepted": sum(accepted),
                        "emitted": sum(e for _, e, _ in inside), "acceptance_length": 1 + sum(accepted) / len(inside),
                        "tokens_per_step": sum(e for _, e, _ in inside) / len(inside),
                        "acceptance_rate_per_position": alpha, "cumulative_acceptance_per_position": cumulative})
    return buckets


def pooled(rows: list[tuple[str, str, list[dict]]]) -> list[tuple[str, str, list[dict]]]:
    """Each method's buckets over every set at one temperature (sets named ``<set>@T<t>`` apart from greedy
    ones), ``("all sets[@T<t>]", method, buckets)`` (``steps``, ``accepted``, ``acceptance_length`` = 1 +
    accepted / steps over them): the decay across sets of different prompt lengths (a short set beside long
    ones) on one line. Only where two sets or more have buckets."""
    out = []
    for temperature in dict.fromkeys(name.partition("@")[2] for name, _, _ in rows):
        group = [row for row in rows if row[2] and row[0].partition("@")[2] == temperature]
        if len({name for name, _, _ in group}) < 2:
            continue
        for method in dict.fromkeys(m for _, m, _ in group):
            sums: dict[tuple, list[int]] = {}
            for b in (b for _, m, buckets in group if m == method for b in buckets):
                total = sums.setdefault((b["context_tokens"][0], b["context_tokens"][1]), [0, 0])
                total[0], total[1] = total[0] + b["steps"], total[1] + b["accepted"]
            buckets = [{"context_tokens": [lo, hi], "steps": n, "accepted": a, "acceptance_length": 1 + a / n}
                       for (lo, hi), (n, a) in sums.items()]
            out.append((f"all sets{'@' + temperature if temperature else ''}", method,
                        sorted(buckets, key=lambda b: (b["context_tokens"][0], bucket_label(b)))))
    return out


def format_context_table(rows: list[tuple[str, str, list[dict]]]) -> str:
    """``tau (steps)`` per context bucket for each ``(set, method, buckets)``, then each method over every set
    (:func:`pooled`), one column per bucket any row has; empty when no row has one."""
    rows = [r for r in rows if r[2]]
    if not rows:
        return ""
    rows += pooled(rows)
    labels = sorted({(b["context_tokens"][0], bucket_label(b)) for _, _, bs in rows for b in bs})
    columns = [label for _, label in labels]
    w = max([16, *(len(name) + 2 for name, _, _ in rows)])  # per-mode sets are long: chitchat[no_thinking]
    head = f"{'tau by context (steps)':<{w + 21}}" + "".join(f"{c:>14}" for c in columns)
    lines = [head, "-" * len(head)]
    for name, method, buckets in rows:
        cells = {bucket_label(b): f"{b['acceptance_length']:.2f} ({b['steps']})" for b in buckets}
        lines.append(f"{name:<{w}}{method:<21}" + "".join(f"{cells.get(c, '-'):>14}" for c in columns))
    return "\n".join(lines)


def plot_by_context(ax, rows: list[tuple[str, str, list[dict]]]) -> None:
    """tau per context bucket on ``ax``: a line per ``(set, method, buckets)`` and, dashed, each method over
    every set (:func:`pooled`); the buckets any row has, in order, evenly spaced."""
    labels = sorted({(b["context_tokens"][0], bucket_label(b)) for _, _, bs in rows for b in bs or []})
    where = {label: i for i, (_, label) in enumerate(labels)}
    for name, method, buckets in [*rows, *pooled(rows)]:
        if buckets:
            ax.plot([where[bucket_label(b)] for b in buckets], [b["acceptance_length"] for b in buckets],
                    marker="o", label=f"{name} {method}", linestyle="--" if name.startswith("all sets") else "-")
    ax.set(xlabel="context length (tokens)", ylabel="tau", xticks=range(len(labels)),
           xticklabels=[label for _, label in labels])
