"""Tau by context length: verification steps land in the bucket of the context they verify at, the buckets
add up to the set's totals, decoders record each step's context, long-prompt eval sets reach their length, and
the report carries it all (table, plot, ``report.json``)."""

import json
from dataclasses import replace

import pytest
import torch
from draftheads.data.conversations import long_prompts, prompt_pieces
from draftheads.data.regenerate import prompt_ids, prompt_messages
from draftheads.data.sources import Prompt
from draftheads.models.speculative import DecodeResult, plain_decode, speculative_decode
from draftheads.models.tree import Tree, tree_decode
from omegaconf import OmegaConf

from draftheads.evaluation.context import by_context_length
from draftheads.evaluation.evaluator import format_table, summarize, write_report_and_plot
from draftheads.evaluation.methods import load_eval_sets
from draftheads.training.config import EvalConfig, EvalSetConfig, to_schema
from tests.helpers import StubDrafter, run_medusa, smoke

EDGES = (0, 256, 512, 1024)


def decoded(contexts, accepted, emitted=None):
    """A decoding whose steps are known: one step per context."""
    emitted = emitted or [n + 1 for n in accepted]
    return DecodeResult(tokens=[1] * sum(emitted), target_forwards=len(accepted) + 1, gamma=4,
                        accepted_per_step=list(accepted), emitted_per_step=list(emitted),
                        context_per_step=list(contexts))


def test_a_step_lands_in_the_bucket_of_its_context_length():
    """Buckets are [lo, hi): 255 is in the first, 256 opens the second; past the last edge is the open bucket."""
    results = [decoded([10, 255, 256], [4, 3, 2]), decoded([511, 512, 1023, 1024, 9000], [1, 0, 4, 2, 2])]
    buckets = by_context_length(results, 4, EDGES)
    assert [(b["context_tokens"], b["steps"], b["accepted"]) for b in buckets] == [
        ([0, 256], 2, 7), ([256, 512], 2, 3), ([512, 1024], 2, 4), ([1024, None], 2, 4)]
    first = buckets[0]
    assert first["acceptance_length"] == 1 + 7 / 2
    assert first["acceptance_rate_per_position"] == [1.0, 1.0, 1.0, 0.5]
    assert first["cumulative_acceptance_per_position"] == [1.0, 1.0, 1.0, 0.5]
    (everything,) = by_context_length(results, 4, (0,))  # one open bucket: the whole set
    assert everything["context_tokens"] == [0, None] and (everything["steps"], everything["accepted"]) == (8, 18)
    assert by_context_length([decoded([3, 4], [1, 1]), DecodeResult(tokens=[1], accepted_per_step=[2],
                                                                     emitted_per_step=[3])], 4) is None


def test_the_buckets_add_up_to_the_sets_totals():
    """Steps, accepted drafts and emitted tokens summed over the buckets are the set's; tau per bucket is the
    set's definition on its steps, so the steps-weighted buckets give the set's tau back."""
    g = torch.Generator().manual_seed(0)
    results = [decoded(sorted(torch.randint(0, 3000, (n,), generator=g).tolist()),
                       torch.randint(0, 5, (n,), generator=g).tolist()) for n in (7, 30, 1, 12)]
    m = summarize([DecodeResult(tokens=[1] * 9, target_forwards=9, seconds=1.0)] * 4,
                  [replace(r, seconds=1.0) for r in results], 4, 64, [], EDGES)
    buckets = m["by_context_length"]
    steps = sum(len(r.accepted_per_step) for r in results)
    assert len(buckets) > 1 and sum(b["steps"] for b in buckets) == steps
    assert sum(b["accepted"] for b in buckets) == sum(sum(r.accepted_per_step) for r in results)
    assert sum(b["emitted"] for b in buckets) == sum(sum(r.emitted_per_step) for r in results)
    assert sum(b["steps"] * b["acceptance_length"] for b in buckets) / steps == pytest.approx(m["acceptance_length"])
    for b in buckets:
        assert b["acceptance_length"] == pytest.approx(1 + sum(b["cumulative_acceptance_per_position"]))


@pytest.fixture(scope="module")
def greedy(tiny):
    model, tok = tiny
    ids = torch.tensor(prompt_ids(tok, "Tell me about your weekend plans please"))
    return model, tok, ids, plain_decode(model, ids, 40, ()).tokens


def test_decoders_record_the_context_of_every_step(greedy):
    """Step s of an oracle that gets every draft accepted starts with 1 + 5 s tokens generated: its context is
    the prompt plus those, in the chain and in the tree alike."""
    model, tok, ids, truth = greedy

    class Oracle(StubDrafter):
        gamma, calls = 4, 0

        def start(self):
            self.calls = 0

        def draft_logits(self, hidden_state, last_token, features, tokens):
            start = 1 + 5 * self.calls
            self.calls += 1
            return torch.nn.functional.one_hot(torch.tensor(truth[start:start + 4]), len(tok)).float() * 10

    expected = [len(ids) + 1 + 5 * s for s in range(6)]
    chain = speculative_decode(model, Oracle(), ids, 31, ())
    assert chain.accepted_per_step == [4] * 6 and chain.context_per_step == expected
    tree = tree_decode(model, Oracle(), Tree.from_choices([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], 4), ids, 31, ())
    assert tree.accepted_per_step == [4] * 6 and tree.context_per_step == expected
    edges = (0, expected[3])  # the first three steps below, the last three at or above
    assert [b["steps"] for b in by_context_length([chain], 4, edges)] == [3, 3]


@pytest.mark.parametrize("source, min_tokens", [("chitchat", 300), ("humaneval", 400)])
def test_a_long_prompt_set_reaches_the_asked_length(tiny, source, min_tokens):
    """Each prompt the target reads holds at least ``min_prompt_tokens`` tokens, and joins no more pieces than
    it needs: without its last piece it would be too short."""
    _, tok = tiny
    count = lambda p: len(prompt_ids(tok, prompt_messages(tok, p)))  # noqa: E731
    cfg = EvalConfig(sets=[EvalSetConfig(name="long", source=source, num_prompts=3, min_prompt_tokens=min_tokens)])
    prompts = load_eval_sets(cfg, tok)["long"]
    assert len(prompts) == 3 and all(count(p) >= min_tokens for p in prompts)
    pieces = iter(prompt_pieces(cfg.sets[0], "eval"))
    for p in prompts:  # consecutive pieces, joined by blank lines, the first one's provenance kept
        used = [next(pieces)]
        while len("\n\n".join(u.text for u in used)) < len(p.text):
            used.append(next(pieces))
        assert "\n\n".join(u.text for u in used) == p.text and p.row == used[0].row
        if len(used) > 1:
            assert count(replace(p, text="\n\n".join(u.text for u in used[:-1]))) < min_tokens
    with pytest.raises(ValueError, match="min_prompt_tokens counts the target's tokens"):
        load_eval_sets(cfg)


def test_long_prompts_drop_a_short_remainder_and_count_each_piece_once():
    pieces = [Prompt("s", i, "w " * n) for i, n in enumerate([3, 4, 9, 2, 2, 1])]
    counted = []

    def words(p):
        counted.append(p.text)
        return 2 + len(p.text.split())  # a template of 2 around the text

    got = long_prompts(pieces, 10, 8, words)
    assert [len(p.text.split()) for p in got] == [7, 9]  # 3 + 4; 9; then 2 + 2 + 1 runs out short
    assert len(counted) <= 2 * len(pieces) + 1


def test_context_buckets_are_checked_when_the_config_is_made():
    for bad in ([], [256, 512], [0, 512, 512]):
        with pytest.raises(ValueError, match="eval.context_buckets"):
            EvalConfig(context_buckets=bad)
    with pytest.raises(ValueError, match="min_prompt_tokens=-1"):
        EvalSetConfig(name="x", source="chitchat", min_prompt_tokens=-1)


def test_the_report_prints_and_plots_tau_by_context(tmp_path):
    results = [decoded([10, 300, 600], [4, 2, 0])]
    plain = [DecodeResult(tokens=[1] * 9, target_forwards=9, seconds=1.0)]
    m = {**summarize(plain, [replace(r, seconds=1.0) for r in results], 4, 64, [], EDGES), "method": "medusa_chain",
         "peers": {"prompt_lookup": {"acceptance_length": 1.5, "tokens_per_second": 2.0, "speedup": 1.0,
                                     "greedy_match": 1.0}}}
    table = format_table({"long": m})
    assert "tau by context (steps)" in table and "512-1024" in table and "3.00 (1)" in table
    assert "all sets" not in table  # one set: nothing to pool
    short = {**summarize(plain, [replace(decoded([20, 30], [1, 3]), seconds=1.0)], 4, 64, [], EDGES),
             "method": "medusa_chain"}
    sets = {"long": m, "short": short, "short@T0.7": short}
    pooled = [line.split()[2:] for line in format_table(sets).splitlines() if line.startswith("all sets ")]
    assert pooled == [["medusa_chain", "3.67", "(3)", "3.00", "(1)", "1.00", "(1)"]]  # 1 + (4 + 1 + 3) / 3
    write_report_and_plot({"eval": sets}, tmp_path)
    assert (tmp_path / "acceptance.png").exists()
    assert json.loads((tmp_path / "report.json").read_text())["eval"]["long"]["by_context_length"][1]["steps"] == 1


@pytest.mark.slow
def test_a_run_reports_tau_by_context_on_a_long_set(tmp_path, cache_dir):
    """A smoke Medusa run with a long chitchat set: the chain and the tree report by_context_length (steps
    summing to theirs, none shorter than the prompts), prompt lookup, which records no steps, does not."""
    report = run_medusa(smoke("medusa", tmp_path / "run", cache_dir, "stage1.epochs=1", "stage2.enabled=false",
                              "eval.sets=[{name: long, source: chitchat, num_prompts: 2, min_prompt_tokens: 300}]",
                              "eval.context_buckets=[0,128,320,512]", "eval.max_new_tokens=40"))
    m = report["eval"]["long"]
    assert OmegaConf.select(OmegaConf.create(report["config"]), "eval.context_buckets") == [0, 128, 320, 512]
    for r in (m, m["peers"]["medusa_tree"]):
        buckets = r["by_context_length"]
        assert buckets[0]["context_tokens"][0] >= 128 and sum(b["steps"] for b in buckets) > 0  # prompts >= 300
        assert 1 + sum(b["accepted"] for b in buckets) / sum(b["steps"] for b in buckets) == pytest.approx(
            r["acceptance_length"])
    assert sum(m["accepted_histogram"]) == sum(b["steps"] for b in m["by_context_length"])
    assert "by_context_length" not in m["peers"]["prompt_lookup"]
    assert to_schema(smoke("medusa", "x", "y")).eval.context_buckets == [0, 256, 512, 1024, 2048, 4096, 8192]
