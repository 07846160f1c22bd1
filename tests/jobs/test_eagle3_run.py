"""The whole EAGLE-3 job on the tiny random target: training, validation, export, evaluation beside Medusa
and DFlash runs, exact resume, 2-process DDP, sampling."""

import math

import pytest
import torch
from draftheads.models.target import TINY, TargetSpec, load_target
from safetensors.torch import load_file

from draftheads.drafters.eagle3.export import load_eagle3
from draftheads.jobs.evaluate import cli as evaluate_main
from draftheads.jobs.export import cli as export_main
from draftheads.run_folder import finished_steps
from tests.helpers import cut_back, greedy_lossless, launch, run_dflash, run_eagle3, run_medusa
from tests.helpers import smoke as cfg

pytestmark = pytest.mark.slow  # whole EAGLE-3 (and peer) jobs and a 2-process launch

OWN = ["train.epochs=6", "eagle3.draft_vocab_size=256", "eagle3.ttt_steps=4", "eagle3.gamma=4"]
"""A draft vocabulary half the tiny target's, so d2t maps it."""


@pytest.fixture(scope="module")
def peers(tmp_path_factory, cache_dir):
    medusa, dflash = tmp_path_factory.mktemp("medusa"), tmp_path_factory.mktemp("dflash")
    run_medusa(cfg("medusa", medusa, cache_dir, "stage2.enabled=false", "eval.enabled=false", "export=false"))
    run_dflash(cfg("dflash", dflash, cache_dir, "train.epochs=2", "dflash.block_size=8", "eval.enabled=false",
                   "eval.peer_runs=[]"))
    return [medusa, dflash]


@pytest.fixture(scope="module")
def eagle3_run(tmp_path_factory, cache_dir, peers):
    out = tmp_path_factory.mktemp("eagle3")
    report = run_eagle3(cfg("eagle3", out, cache_dir, *OWN, "trainer.keep_last=100",
                            f"eval.peer_runs=[{peers[0]},{peers[1]}]", "eval.peers=null"))  # every method
    return out, report


def test_eagle3_job_trains_exports_and_evaluates_beside_medusa_and_dflash(eagle3_run, cache_dir, peers):
    out, report = eagle3_run
    curve = [h["eagle3/loss"] for h in report["train_curves"]["eagle3"]]
    assert sum(curve[-3:]) < 0.8 * sum(curve[:3])  # the loss falls
    assert {"eagle3/acc_pos1", "eagle3/acc_pos4", "eagle3/tau_estimate"} <= report["train_curves"]["eagle3"][-1].keys()
    val = report["validation"]
    assert val["val/eagle3_loss"] < math.log(256) and val["val/acc_pos1"] > 5 / 256  # far better than chance
    assert 0.5 < val["val/vocab_coverage"] < 1.0  # 256 of 512 tokens hold most trained ones, not all
    for name, m in report["eval"].items():
        assert m["method"] == "eagle3" and m["gamma"] == 4 and greedy_lossless(m), (name, m["mismatches"])
        assert 1.0 <= m["acceptance_length"] <= 5.0 and len(m["acceptance_rate_per_position"]) == 4
        assert set(m["peers"]) == {"medusa_chain", "medusa_tree", "dflash", "dflash_denoise4", "prompt_lookup"}
        assert all(greedy_lossless(p) for p in m["peers"].values())
    assert report["peer_runs"] == [f"{peers[0]}: medusa, measured", f"{peers[1]}: dflash, measured"]
    assert report["drafter"] == "eagle3"
    assert finished_steps(out) == ["training", "validation", "save", "export", "evaluation"]
    target, _, _ = load_target(TargetSpec(name_or_path=TINY), cache_dir)
    drafter = load_eagle3(out / "export" / "eagle3", target)
    assert len(drafter.d2t) == 256 and list(drafter.target_layer_ids) == report["drafter_config"]["target_layer_ids"]
    assert report["exports"] == {"eagle3": str(out / "export" / "eagle3")} and export_main([str(out)]) == {}


def test_resumed_eagle3_run_ends_with_the_same_drafter(eagle3_run, tmp_path, cache_dir):
    out, report = eagle3_run
    cut = cut_back(out, "eagle3-step000005", tmp_path / "cut")
    resumed = run_eagle3(cfg("eagle3", cut, cache_dir, *OWN, "resume=true", "eval.enabled=false"))
    assert resumed["resumed_from"] == str(cut / "checkpoints" / "eagle3-step000005")
    ours, theirs = resumed["train_curves"]["eagle3"], report["train_curves"]["eagle3"]
    assert [x["step"] for x in ours] == [x["step"] for x in theirs]  # the same curve, the part before the cut
    assert [x["eagle3/loss"] for x in ours if x["step"] != 6] == \
        [x["eagle3/loss"] for x in theirs if x["step"] != 6]  # included; step 6 averages fewer batches
    a, b = (load_file(str(d / "export" / "eagle3" / "model.safetensors")) for d in (out, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_padded_eagle3_run_trains_and_resumes_to_the_same_drafter(eagle3_run, tmp_path, cache_dir):
    """``trainer.tokens_per_batch=null``: batches of 8 rows, padded; the loss falls, held-out accuracy is about
    the default packed run's, decoding stays lossless, and a cut and resumed run ends with the same drafter."""
    own = [*OWN, "trainer.tokens_per_batch=null", "trainer.keep_last=100", "eval.peer_runs=[]"]
    out = tmp_path / "padded"
    report = run_eagle3(cfg("eagle3", out, cache_dir, *own))
    curve = [h["eagle3/loss"] for h in report["train_curves"]["eagle3"]]
    assert sum(curve[-3:]) < 0.8 * sum(curve[:3]) and report["data"]["padding_fraction"] > 0
    assert report["validation"]["val/acc_pos1"] > eagle3_run[1]["validation"]["val/acc_pos1"] - 0.05
    assert all(greedy_lossless(m) for m in report["eval"].values())
    cut = cut_back(out, "eagle3-step000005", tmp_path / "cut")
    run_eagle3(cfg("eagle3", cut, cache_dir, *own, "resume=true", "eval.enabled=false"))
    a, b = (load_file(str(d / "export" / "eagle3" / "model.safetensors")) for d in (out, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_process_ddp_eagle3_run(tmp_path, cache_dir, eagle3_run):
    report = launch("eagle3", tmp_path / "ddp", cache_dir, *OWN, "eval.peer_runs=[]")
    assert all(greedy_lossless(m) for m in report["eval"].values())
    steps, single = (r["train_curves"]["eagle3"][-1]["step"] for r in (report, eagle3_run[1]))
    assert single // 2 <= steps <= single // 2 + 6  # each rank packs half the rows: half the micro-batches, or
    # one more per epoch (6) where a share's last batch is partly filled


def test_evaluate_a_saved_eagle3_run_with_sampling(eagle3_run):
    out, _ = eagle3_run
    report = evaluate_main([str(out), "eval.temperatures=[0,0.7]", "eval.max_new_tokens=10", "eval.peer_runs=[]",
                            "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]"])
    assert {"chitchat", "chitchat@T0.7"} <= set(report["eval"])  # beside the sets measured before
    hot = report["eval"]["chitchat@T0.7"]
    assert hot["method"] == "eagle3" and hot["greedy_match"] is None and hot["new_tokens"] > 0
    assert greedy_lossless(report["eval"]["chitchat"])
