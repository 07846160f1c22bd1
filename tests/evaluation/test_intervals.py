"""Intervals over prompts on every reported number, checked against direct computations on crafted per-prompt
counts: the statistics of one draw, the exact bootstrap distribution of three prompts, paired differences."""

import itertools

import numpy as np
import pytest

from draftheads.evaluation import intervals as iv
from draftheads.evaluation.evaluator import acceptance, format_table
from draftheads.models.speculative import DecodeResult


def result(accepted: list[int], gamma: int = 3, seconds: float = 1.0) -> DecodeResult:
    """A chain decoding whose steps accepted ``accepted`` drafts each (and emitted one more)."""
    return DecodeResult(tokens=[0] * sum(a + 1 for a in accepted), target_forwards=len(accepted) + 1,
                        seconds=seconds, gamma=gamma, accepted_per_step=list(accepted),
                        emitted_per_step=[a + 1 for a in accepted])


PROMPTS = [result([3, 3, 1]), result([0, 0, 0, 0, 2]), result([1, 2])]
"""Three prompts: an easy one, a hard one, a middling one (steps 3, 5, 2)."""


def test_the_full_sample_gives_the_point_estimates_the_report_sums():
    counts = iv.prompt_counts(PROMPTS, 3, [True, True, False])
    first = iv.statistics(counts, np.ones((1, 3)), iv.prompt_counts([result([0] * 4, seconds=2.0)] * 3, 0))
    direct = acceptance(PROMPTS, 3)
    assert first["acceptance_length"][0] == pytest.approx(direct["acceptance_length"]) == 1 + 12 / 10
    assert first["tokens_per_step"][0] == pytest.approx(direct["tokens_per_step"])
    assert first["acceptance_rate_per_position"][0] == pytest.approx(direct["acceptance_rate_per_position"])
    assert first["cumulative_acceptance_per_position"][0] == pytest.approx(
        direct["cumulative_acceptance_per_position"])
    assert first["greedy_match"][0] == pytest.approx(2 / 3)
    assert first["speedup"][0] == pytest.approx((22 / 3) / (12 / 6))


def test_a_draw_weighs_each_prompt_by_how_often_it_was_drawn():
    """Draw (2, 0, 1): the easy prompt twice, the middling once: tau = 1 + (2*7 + 3) / (2*3 + 2)."""
    draw = iv.statistics(iv.prompt_counts(PROMPTS, 3), np.array([[2.0, 0.0, 1.0]]))
    assert draw["acceptance_length"][0] == pytest.approx(1 + (2 * 7 + 3) / (2 * 3 + 2))
    alpha2 = (2 * 2 + 1) / (2 * 3 + 2)  # position 2: passed where a >= 2, attempted where a >= 1
    assert draw["acceptance_rate_per_position"][0][1] == pytest.approx(alpha2)


def test_the_interval_is_the_exact_bootstrap_distribution_of_three_prompts():
    """Every one of the 27 ordered draws of 3 prompts is equally likely: the resampled 2.5% and 97.5% points fall
    within one atom of that exact distribution's."""
    counts = iv.prompt_counts(PROMPTS, 3)
    exact = []
    for draw in itertools.product(range(3), repeat=3):
        w = np.bincount(draw, minlength=3)[None].astype(float)
        exact.append(iv.statistics(counts, w)["acceptance_length"][0])
    exact = np.sort(exact)
    lo, hi = iv.intervals(iv.statistics(counts, iv.resample_weights(3, seed=0, resamples=20000)))["acceptance_length"]
    atoms = np.unique(exact)
    assert np.percentile(exact, 2.5) == pytest.approx(lo, abs=np.diff(atoms).max())
    assert np.percentile(exact, 97.5) == pytest.approx(hi, abs=np.diff(atoms).max())
    assert atoms[0] <= lo < hi <= atoms[-1]


def test_paired_differences_cancel_what_both_methods_share():
    """A method one draft better on every step of every prompt: its paired difference is exactly 1 on every draw,
    while the two methods' own intervals overlap (the prompts' difficulty, which both share, dominates them)."""
    better = [result([a + 1 for a in r.accepted_per_step], gamma=4) for r in PROMPTS]
    w = iv.resample_weights(3, seed=1)
    a, b = iv.statistics(iv.prompt_counts(better, 4), w), iv.statistics(iv.prompt_counts(PROMPTS, 4), w)
    d = iv.paired(a, b)
    assert d["difference"] == pytest.approx(1.0) and d["interval"] == pytest.approx([1.0, 1.0])
    ia, ib = iv.intervals(a)["acceptance_length"], iv.intervals(b)["acceptance_length"]
    assert ia[0] < ib[1]  # overlapping own intervals
    assert iv.paired(a, a) == {"difference": 0.0, "interval": [0.0, 0.0]}
    worse_on_one = [PROMPTS[0], result([0, 0, 0, 0, 0]), PROMPTS[2]]  # level on two prompts, worse on one
    d = iv.paired(iv.statistics(iv.prompt_counts(worse_on_one, 4), w), b)
    assert d["difference"] < 0 and d["interval"][0] < d["interval"][1] <= 0


def test_the_table_prints_each_tau_with_its_interval_and_the_paired_differences():
    sets = {"chitchat": {"method": "chain", "acceptance_length": 2.2, "intervals": {"acceptance_length": [1.9, 2.5]},
                         "acceptance_rate_per_position": [0.5], "tokens_per_second": {"speculative": 1.0,
                                                                                       "baseline": 1.0},
                         "speedup": 1.0, "greedy_match": 1.0,
                         "paired": {"chain - lookup": {"difference": 0.4, "interval": [0.1, 0.7]}}}}
    table = format_table(sets)
    assert "2.20 [1.90,2.50]" in table and "+0.40 [0.10,0.70]" in table


def test_every_method_of_an_evaluated_set_carries_intervals_and_paired_differences(tiny):
    """evaluate_set on two prompts: the drafter, each peer and each context bucket carry intervals that hold their
    point estimates, and every pair of methods its paired difference."""
    import torch

    from draftheads.data.sources import Prompt
    from draftheads.evaluation.evaluator import evaluate_set
    from draftheads.models.speculative import plain_decode
    from tests.helpers import StubDrafter

    model, tok = tiny

    class Zeros(StubDrafter):  # drafts token 0 at every position: accepted only where the target agrees
        gamma = 3

        def draft_logits(self, hidden_state, last_token, features, tokens):
            return torch.nn.functional.one_hot(torch.zeros(3, dtype=torch.long), len(tok)).float()

    prompts = [Prompt("test", 0, "Tell me about your weekend"), Prompt("test", 1, "What is your favourite food?")]
    m = evaluate_set(model, tok, Zeros(), prompts, 12, 1e-4,
                     peers={"plain_again": lambda ids, gen: plain_decode(model, ids, 12, ())})
    for entry in (m, m["peers"]["plain_again"]):
        lo, hi = entry["intervals"]["acceptance_length"]
        assert lo <= entry["acceptance_length"] <= hi
        assert entry["intervals"]["greedy_match"] == [1.0, 1.0]
    assert len(m["intervals"]["acceptance_rate_per_position"]) == 3
    assert all(b["interval"][0] <= b["acceptance_length"] <= b["interval"][1] for b in m["by_context_length"])
    assert set(m["paired"]) == {"test - plain_again"}
    assert m["paired"]["test - plain_again"]["difference"] == pytest.approx(
        m["acceptance_length"] - m["peers"]["plain_again"]["acceptance_length"])
