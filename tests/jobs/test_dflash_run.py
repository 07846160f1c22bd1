"""The whole DFlash job on the tiny random target: training, validation, export, evaluation beside a Medusa
run, exact resume, 2-process DDP."""

import json
import math
import shutil

import pytest
import torch
from draftheads.data.regenerate import prompt_ids
from draftheads.data.templates import stop_token_ids
from draftheads.models.speculative import Sampling, plain_decode
from draftheads.models.target import TINY, TargetSpec, load_target
from safetensors.torch import load_file

from draftheads.drafters.dflash.export import load_dflash
from draftheads.jobs.evaluate import cli as evaluate_main
from draftheads.jobs.export import cli as export_main
from draftheads.run_folder import finished_steps
from draftheads.runs.saved import load_peer_runs, peer_methods
from tests.helpers import cut_back, greedy_lossless, launch, run_dflash, run_medusa
from tests.helpers import smoke as cfg

pytestmark = pytest.mark.slow  # whole DFlash (and Medusa peer) jobs and a 2-process launch


@pytest.fixture(scope="module")
def medusa_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("medusa")
    run_medusa(cfg("medusa", out, cache_dir, "stage2.enabled=false", "eval.enabled=false", "export=false"))
    return out


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory, cache_dir, medusa_run):
    out = tmp_path_factory.mktemp("dflash")
    report = run_dflash(cfg("dflash", out, cache_dir, "train.epochs=6", "trainer.keep_last=100",
                            f"eval.peer_runs=[{medusa_run}]", "dflash.block_size=8",
                            "eval.peers=null"))  # every method (the job keeps prompt lookup only)
    return out, report


def test_dflash_job_trains_exports_and_evaluates_beside_medusa(dflash_run, cache_dir, medusa_run):
    out, report = dflash_run
    assert (out / "acceptance.png").stat().st_size > 1000 and (out / "report.json").exists()
    curve = [h["dflash/loss"] for h in report["train_curves"]["dflash"]]
    assert sum(curve[-3:]) < 0.9 * sum(curve[:3])  # the loss falls
    logged = report["train_curves"]["dflash"][-1].keys()
    assert {"dflash/acc_pos1", "dflash/alpha_pos7", "dflash/tau_estimate"} <= logged
    assert report["validation"]["val/dflash_loss"] < math.log(512)  # held-out rows: better than a uniform guess
    assert 1.0 <= report["validation"]["val/tau_estimate"] <= 8.0
    for name, m in report["eval"].items():
        assert m["method"] == "dflash" and m["gamma"] == 7 and greedy_lossless(m), (name, m["mismatches"])
        assert 1.0 <= m["acceptance_length"] <= 8.0
        assert set(m["peers"]) == {"dflash_denoise4", "medusa_chain", "medusa_tree", "prompt_lookup"}
        assert all(greedy_lossless(p) for p in m["peers"].values())
        assert len(m["peers"]["dflash_denoise4"]["acceptance_rate_per_position"]) == 7
        assert len(m["peers"]["medusa_chain"]["acceptance_rate_per_position"]) == 4  # the peer's own gamma
        assert m["peers"]["dflash_denoise4"]["time_split_s"]["draft"] > 0
    assert report["peer_runs"] == [f"{medusa_run}: medusa, measured"]
    assert report["drafter"] == "dflash"
    assert finished_steps(out) == ["training", "validation", "save", "export", "evaluation"]
    # the export reloads strictly and is the trained drafter, the run's saved model: nothing else to export
    target, _, _ = load_target(TargetSpec(name_or_path=TINY), cache_dir)
    drafter = load_dflash(out / "export" / "dflash", target)
    assert drafter.block_size == 8 and list(drafter.target_layer_ids) == report["drafter_config"]["target_layer_ids"]
    assert report["exports"] == {"dflash": str(out / "export" / "dflash")} and export_main([str(out)]) == {}


def test_resumed_dflash_run_ends_with_the_same_drafter(dflash_run, tmp_path, cache_dir, medusa_run):
    out, _ = dflash_run
    cut = cut_back(out, "dflash-step000005", tmp_path / "cut")
    report = run_dflash(cfg("dflash", cut, cache_dir, "train.epochs=6", "resume=true", "eval.enabled=false",
                            f"eval.peer_runs=[{medusa_run}]", "dflash.block_size=8",
                            "eval.peers=null"))  # every method (the job keeps prompt lookup only)
    assert report["resumed_from"] == str(cut / "checkpoints" / "dflash-step000005")
    whole = dflash_run[1]["train_curves"]["dflash"]
    assert [x["step"] for x in report["train_curves"]["dflash"]] == [x["step"] for x in whole]  # the whole curve
    a, b = (load_file(str(d / "export" / "dflash" / "model.safetensors")) for d in (out, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("target_states", ["memory", "online"])
def test_padded_dflash_runs_train_and_resume_to_the_same_drafter(target_states, dflash_run, tmp_path, cache_dir):
    """``trainer.tokens_per_batch=null``: batches of 8 rows, padded, features cached or from a padded target
    forward; the loss falls, held-out accuracy is about the default packed run's, decoding stays lossless, and a
    run cut at a checkpoint and resumed ends with the same drafter."""
    own = ("train.epochs=6", "dflash.block_size=8", "eval.peer_runs=[]", "trainer.tokens_per_batch=null",
           f"data.target_states={target_states}", "trainer.keep_last=100")
    out = tmp_path / "padded"
    report = run_dflash(cfg("dflash", out, cache_dir, *own))
    curve = [h["dflash/loss"] for h in report["train_curves"]["dflash"]]
    assert sum(curve[-3:]) < 0.9 * sum(curve[:3]) and report["data"]["padding_fraction"] > 0
    assert report["validation"]["val/acc_pos1"] > dflash_run[1]["validation"]["val/acc_pos1"] - 0.05
    assert all(greedy_lossless(m) for m in report["eval"].values())
    cut = cut_back(out, "dflash-step000005", tmp_path / "cut")
    run_dflash(cfg("dflash", cut, cache_dir, *own, "resume=true", "eval.enabled=false"))
    a, b = (load_file(str(d / "export" / "dflash" / "model.safetensors")) for d in (out, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_peer_runs_that_do_not_fit_fail_the_evaluation_or_are_skipped_when_asked(medusa_run, tiny, cache_dir):
    """Any finished run is measured beside another for the same target; a missing run or one made for another
    target (other sizes, or the same sizes with other weights) fails, naming it and why (issue 53: it became a
    quiet note), or under eval.unusable_peers=skip is skipped with a note saying why."""
    model, _ = tiny
    record, host = json.loads((medusa_run / "target.json").read_text()), load_target(TargetSpec(TINY), cache_dir)[2]
    peers, notes = load_peer_runs([str(medusa_run)], record, host, model)
    assert [p.recipe.spec.name for p in peers] == ["medusa"] and notes == [f"{medusa_run}: medusa, measured"]
    assert peers[0].trained.saved["head_rank_accuracy"] and peers[0].target is model  # its tree's accuracies
    other_weights = {**record, "weights_sample_sha256": "0" * 64}
    for other in ({**record, "hidden_size": 32}, other_weights):
        with pytest.raises(ValueError, match=rf"eval.peer_runs: {medusa_run} cannot be measured .*made for another "
                                             rf"target.*eval.unusable_peers=skip"):
            load_peer_runs([str(medusa_run)], other, host, model)
        peers, notes = load_peer_runs([str(medusa_run), str(medusa_run / "nothing")], other, host, model, "skip")
        assert peers == [] and len(notes) == 2 and "skipped (made for another target" in notes[0]
        assert "skipped" in notes[1] and "target.json" in notes[1]
    (medusa_run / "target.json").write_text(json.dumps({k: v for k, v in record.items()
                                                        if k != "weights_sample_sha256"}))
    try:
        peers, (note,) = load_peer_runs([str(medusa_run)], record, host, model, "skip")
        assert peers == [] and "lacks ['weights_sample_sha256']: made by an older draftheads" in note
    finally:
        (medusa_run / "target.json").write_text(json.dumps(record))


def test_a_stage_2_medusa_peer_is_verified_by_its_own_target(tmp_path, cache_dir, tiny):
    """Heads trained with stage 2 are served with their own modified target: as a peer they are measured so."""
    model, _ = tiny
    out = tmp_path / "stage2"
    run_medusa(cfg("medusa", out, cache_dir, "stage1.epochs=1", "stage2.epochs=0.5", "stage2.unfreeze_last_n_layers=1",
                   "eval.enabled=false", "export=false"))
    record, host = json.loads((out / "target.json").read_text()), load_target(TargetSpec(TINY), cache_dir)[2]
    (peer,), (note,) = load_peer_runs([str(out)], record, host, model)
    assert peer.target is not model and "on its own target" in note and str(out / "export" / "target") in note
    changed = dict(peer.target.named_parameters())["model.layers.3.mlp.up_proj.weight"]
    assert not torch.equal(changed, dict(model.named_parameters())["model.layers.3.mlp.up_proj.weight"])
    # greedy, its methods are held to its own target's plain decoding, not to the evaluated target's
    _, tokenizer = tiny
    chain = peer_methods(peer.conf, [peer], tokenizer, Sampling(), set(), model)["medusa_chain"]
    ids = torch.tensor(prompt_ids(tokenizer, "Tell me about your weekend."))
    result = chain(ids, None)
    stop = stop_token_ids(tokenizer, peer.target.generation_config)
    assert result.reference == plain_decode(peer.target, ids, peer.conf.eval.max_new_tokens, stop).tokens
    assert result.tokens == result.reference
    assert peer_methods(peer.conf, [peer], tokenizer, Sampling(), set(), peer.target)["medusa_chain"](
        ids, None).reference is None  # served by the evaluated target: compared with its plain decoding


def test_two_process_ddp_dflash_run(tmp_path, cache_dir, dflash_run):
    report = launch("dflash", tmp_path / "ddp", cache_dir, "train.epochs=6", "dflash.block_size=8",
                        "eval.peer_runs=[]")
    assert all(greedy_lossless(m) for m in report["eval"].values())
    steps, single = (r["train_curves"]["dflash"][-1]["step"] for r in (report, dflash_run[1]))
    assert single // 2 <= steps <= single // 2 + 6  # each rank packs half the rows: half the micro-batches, or
    # one more per epoch (6) where a share's last batch is partly filled


def test_evaluate_a_saved_dflash_run_with_sampling(dflash_run):
    """train/evaluate.py on the DFlash run at T 0 and 0.7: denoising is greedy-only."""
    out, _ = dflash_run
    report = evaluate_main([str(out), "eval.temperatures=[0,0.7]", "eval.max_new_tokens=10"])
    assert set(report["eval"]) == {"chitchat", "humaneval", "chitchat@T0.7", "humaneval@T0.7"}
    hot = report["eval"]["chitchat@T0.7"]
    assert hot["method"] == "dflash" and hot["greedy_match"] is None
    assert set(hot["peers"]) == {"medusa_chain", "medusa_tree_typical", "prompt_lookup"}
    assert greedy_lossless(report["eval"]["chitchat"])


def test_resuming_in_another_jobs_run_directory_is_refused(medusa_run, cache_dir, tmp_path):
    other = tmp_path / "medusa_copy"
    shutil.copytree(medusa_run / "checkpoints", other / "checkpoints")
    with pytest.raises(ValueError, match="stage 'stage1', not one of this job's \\['dflash'\\]"):
        run_dflash(cfg("dflash", other, cache_dir, "resume=true", "eval.peer_runs=[]"))


def test_a_run_that_regenerates_trains_like_one_that_reads_the_cache(tmp_path):
    """Regeneration draws from its own seeded RNG: DFlash's anchor sampling afterwards (global RNG) is the same
    whether the run answered the prompts itself or read them from the cache (it differed before)."""
    cache = tmp_path / "cache"
    args = ["train.epochs=2", "dflash.block_size=8", "eval.peer_runs=[]", "eval.enabled=false", "export=false"]
    fresh = run_dflash(cfg("dflash", tmp_path / "fresh", cache, *args))
    cached = run_dflash(cfg("dflash", tmp_path / "cached", cache, *args))
    curve = [x["dflash/loss"] for x in fresh["train_curves"]["dflash"]]
    assert curve == [x["dflash/loss"] for x in cached["train_curves"]["dflash"]] and curve


def test_an_explicit_evaluation_evaluates_a_run_trained_without_one(medusa_run):
    """train/evaluate.py on a run made with eval.enabled=false measures it (not an empty table)."""
    report = evaluate_main([str(medusa_run), "eval.max_new_tokens=8",
                            "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]"])
    assert greedy_lossless(report["eval"]["chitchat"]) and report["eval"]["chitchat"]["new_tokens"] > 0


def test_float32_runs_are_evaluated_in_bfloat16_on_request(medusa_run, dflash_run):
    """model.dtype=bfloat16 on a float32 run: the drafter is cast with the target (it kept the file's dtype)."""
    for run in (medusa_run, dflash_run[0]):
        report = evaluate_main([str(run), "model.dtype=bfloat16", "eval.max_new_tokens=8", "eval.peers=[]",
                                "eval.sets=[{name: bf16, source: chitchat, num_prompts: 2}]"])
        m = report["eval"]["bf16"]
        assert m["new_tokens"] > 0 and report["evaluations"][-1]["dtype"] == "bfloat16"
        assert greedy_lossless(m), m["mismatches"]
