"""The target-state cache on disk: equal to the states computed in memory (batched, padded), resumable,
refusing a cache made for something else or corrupted, written by several ranks, and read by training."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.state_cache import (
    CacheSpec,
    cache_spec,
    estimated_bytes,
    footprint,
    forward_states,
    read_cache,
    source_dtype,
    write_cache,
    write_manifest,
)
from draftheads.models.target import record_layer_outputs
from safetensors.torch import load_file, save_file

from draftheads.jobs.cache import cache_states
from draftheads.runs.life import train
from tests.helpers import (
    SMOKE_STAGES,
    VLLM_TINY,
    VLLM_VENV,
    launch_cmd,
    launch_env,
    run_dflash,
    run_eagle3,
    run_medusa,
    short_settings,
    smoke,
)


def rows_of(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, vocab, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.bool),
             "source": "s", "row": i} for i, n in enumerate(lengths)]


LENGTHS = [5, 17, 9, 30, 2, 12, 9]


def build(tiny, folder, rows, layer_ids=None, dtype="float32", shard_rows=3):
    model, tokenizer = tiny
    spec = cache_spec(model, {"name_or_path": "tiny"}, tokenizer, rows, layer_ids, 64, dtype)
    states = forward_states(model, layer_ids, 2, tokenizer.pad_token_id, source_dtype(dtype, model.dtype))
    written = write_cache(states, rows, folder, spec, shard_rows, show_progress=False)
    write_manifest(folder, spec, len(rows), shard_rows)
    return spec, written


@pytest.mark.parametrize("layer_ids, dtype, atol", [(None, "float32", 1e-5), ([0, 2], "float32", 1e-5),
                                                   (None, "bfloat16", 2e-2)])
def test_cached_states_equal_the_states_computed_in_memory(tiny, tmp_path, layer_ids, dtype, atol):
    model, tokenizer = tiny
    rows = rows_of(LENGTHS, model.config.vocab_size)
    spec, written = build(tiny, tmp_path, rows, layer_ids, dtype)
    assert written == [0, 1, 2]
    cached = [dict(r) for r in rows]
    read_cache(tmp_path, spec, cached, dtype=torch.float32)
    attach_hidden_states(model, rows, batch_size=4, pad_token_id=tokenizer.pad_token_id, show_progress=False,
                         layer_ids=layer_ids)
    key = "hidden_states" if layer_ids is None else "target_features"
    for c, r in zip(cached, rows):
        assert c[key].shape == r[key].shape == (len(r["input_ids"]), 64 * (len(layer_ids) if layer_ids else 1))
        torch.testing.assert_close(c[key], r[key], atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_a_resumed_cache_build_rewrites_only_missing_and_corrupt_shards(tiny, tmp_path, dtype):
    rows = rows_of(LENGTHS, tiny[0].config.vocab_size)
    spec, _ = build(tiny, tmp_path, rows, dtype=dtype)
    reference = {k: {n: t.clone() for n, t in load_file(str(tmp_path / f"shard-0000{k}.safetensors")).items()}
                 for k in range(3)}  # cloned: load_file maps the file, which is overwritten below
    (tmp_path / "shard-00001.safetensors.json").unlink()  # killed before its record was written
    (tmp_path / "shard-00002.safetensors").write_bytes(b"truncated")  # a torn file
    _, written = build(tiny, tmp_path, rows, dtype=dtype)
    assert written == [1, 2]
    for k in range(3):
        got = load_file(str(tmp_path / f"shard-0000{k}.safetensors"))
        assert got.keys() == reference[k].keys()
        assert all(torch.equal(got[n].float(), reference[k][n].float()) for n in got)  # fp8 has no torch.equal
    read_cache(tmp_path, spec, [dict(r) for r in rows])


def test_an_fp8_cache_keeps_each_position_within_fp8_resolution_at_about_half_of_bf16s_bytes(tiny, tmp_path):
    """float8_e4m3fn with a float32 scale per row and position: every position's states come back within 2^-4
    (fp8's 3-bit mantissa) of the float32 ones, relative to that position's norm, whatever its magnitude; the
    shards hold the width's bytes plus 4 per token (bf16: twice the width)."""
    model, tokenizer = tiny
    rows = rows_of([40, 200, 90, 130, 7, 64], model.config.vocab_size)
    for layer_ids in (None, [0, 2]):
        reference = forward_states(model, layer_ids, 4, tokenizer.pad_token_id, torch.float32)(rows)
        reference[1] = reference[1] * torch.logspace(-4, 4, len(reference[1]))[:, None]  # positions 1e8 apart
        states = lambda batch, ref=reference: [ref[r["row"]] for r in batch]  # noqa: E731
        sizes = {}
        for dtype in ("float8_e4m3fn", "bfloat16"):
            folder = tmp_path / f"{dtype}-{layer_ids}"
            spec = cache_spec(model, {}, tokenizer, rows, layer_ids, 256, dtype)
            write_cache(states, rows, folder, spec, 4, show_progress=False)
            write_manifest(folder, spec, len(rows), 4)
            cached = [dict(r) for r in rows]
            read_cache(folder, spec, cached, dtype=torch.float32)
            key = "hidden_states" if layer_ids is None else "target_features"
            for c, x in zip(cached, reference):
                assert c[key].dtype == torch.float32 and c[key].shape == x.shape
                error = (c[key] - x).norm(dim=-1) / x.norm(dim=-1)
                assert error.max() <= (2 ** -4 if dtype == "float8_e4m3fn" else 2 ** -8), (dtype, error.max())
            width = reference[0].shape[-1]
            tensors = [load_file(str(folder / f"shard-0000{k}.safetensors")) for k in range(2)]
            payload = sum(t.nbytes for shard in tensors for t in shard.values())
            assert payload == estimated_bytes(rows, width, dtype)
            sizes[dtype] = footprint(folder, rows, width, torch.bfloat16)
            assert sizes[dtype]["ram_bytes_per_token"] == 2 * width  # read back in the training dtype
        tokens = sum(len(r["input_ids"]) for r in rows)
        assert estimated_bytes(rows, width, "float8_e4m3fn") == tokens * (width + 4)
        assert sizes["float8_e4m3fn"]["disk_bytes"] <= 0.55 * sizes["bfloat16"]["disk_bytes"]  # (W + 4) / 2W + headers


def test_a_cache_of_another_dtype_is_refused(tiny, tmp_path):
    """fp8 and bf16 caches are not interchangeable: the manifest's dtype is checked like every spec field."""
    rows = rows_of(LENGTHS, tiny[0].config.vocab_size)
    spec, _ = build(tiny, tmp_path, rows, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="another dtype: cache 'float8_e4m3fn', this run 'bfloat16'"):
        read_cache(tmp_path, CacheSpec(**{**spec.__dict__, "dtype": "bfloat16"}), rows)


def test_a_corrupt_shard_is_named_when_training_reads_the_cache(tiny, tmp_path):
    rows = rows_of(LENGTHS, tiny[0].config.vocab_size)
    spec, _ = build(tiny, tmp_path, rows)
    shard = tmp_path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    read_cache(tmp_path, spec, [dict(r) for r in rows], indices=[0, 1, 2])  # other shards stay readable
    with pytest.raises(ValueError, match="shard-00001.safetensors: missing or corrupt"):
        read_cache(tmp_path, spec, [dict(r) for r in rows])


@pytest.mark.parametrize("field, change", [
    ("layer_ids", [1]), ("max_length", 128), ("dtype", "bfloat16"), ("data_sha256", "0" * 64),
    ("model", {"name_or_path": "other"}), ("tokenizer", {"name": "other"})])
def test_a_cache_made_for_something_else_is_refused_naming_the_field(tiny, tmp_path, field, change):
    rows = rows_of(LENGTHS, tiny[0].config.vocab_size)
    spec, _ = build(tiny, tmp_path, rows)
    wrong = CacheSpec(**{**spec.__dict__, field: change})
    with pytest.raises(ValueError, match=f"the cache was made for another {field}: cache"):
        read_cache(tmp_path, wrong, rows)
    with pytest.raises(FileNotFoundError, match="no complete hidden-state cache"):
        read_cache(tmp_path / "nothing", spec, rows)


def test_the_weights_fingerprint_tells_targets_apart(tiny, tmp_path):
    model, tokenizer = tiny
    rows = rows_of(LENGTHS[:2], model.config.vocab_size)
    spec = cache_spec(model, {}, tokenizer, rows, None, 64, "float32")
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    try:
        assert cache_spec(model, {}, tokenizer, rows, None, 64, "float32").model != spec.model
    finally:
        with torch.no_grad():
            model.lm_head.weight[0, 0] -= 1.0


def short(job, out, cache_dir, *overrides):
    """A smoke job with one stage and no evaluation."""
    extra = [*SMOKE_STAGES, "stage2.enabled=false"] if job == "medusa" else ["train.epochs=1"]
    return smoke(job, out, cache_dir, *extra, "eval.enabled=false", *overrides)


@pytest.mark.slow
def test_training_on_the_state_cache_follows_the_in_memory_curve(tmp_path, cache_dir):
    hs = tmp_path / "hs"
    folder = cache_states(short("medusa", tmp_path / "a", cache_dir, f"data.target_states_dir={hs}",
                                "data.target_states_dtype=float32", "data.cache_shard_rows=16"))
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    disk = run_medusa(short("medusa", tmp_path / "b", cache_dir, "data.target_states=disk",
                                 f"data.target_states_dir={hs}", "data.target_states_dtype=float32"))
    n = disk["data"]["rows_out"]  # training and validation rows, all cached
    assert manifest["num_rows"] == n and len(manifest["shards"]) == -(-n // 16) > 1
    memory = run_medusa(short("medusa", tmp_path / "c", cache_dir))
    a, b = disk["train_curves"]["stage1"], memory["train_curves"]["stage1"]
    assert [x["step"] for x in a] == [x["step"] for x in b]
    for x, y in zip(a, b):
        assert x["stage1/loss"] == pytest.approx(y["stage1/loss"], rel=1e-4)
    with pytest.raises(ValueError, match="another layer_ids"):  # a DFlash job cannot read Medusa's cache
        run_dflash(short("dflash", tmp_path / "d", cache_dir, "data.target_states=disk",
                           f"data.target_states_dir={hs}", "data.target_states_dtype=float32", "eval.peer_runs=[]"))


@pytest.mark.slow
def test_a_smoke_job_trains_from_an_fp8_cache(tmp_path, cache_dir, capsys):
    """A float8_e4m3fn cache (the job prints its disk bytes and RAM per token) trains Medusa's heads: the loss
    falls and follows the in-memory curve within fp8's rounding."""
    hs, fp8 = f"data.target_states_dir={tmp_path / 'hs'}", "data.target_states_dtype=float8_e4m3fn"
    cache_states(short("medusa", tmp_path / "a", cache_dir, hs, fp8))
    printed = capsys.readouterr().out
    assert "in float8_e4m3fn" in printed and "bytes per token in RAM" in printed, printed[-2000:]
    disk = run_medusa(short("medusa", tmp_path / "b", cache_dir, hs, fp8, "data.target_states=disk"))
    with pytest.raises(ValueError, match="another dtype: cache 'float8_e4m3fn', this run 'bfloat16'"):
        run_medusa(short("medusa", tmp_path / "c", cache_dir, hs, "data.target_states=disk"))
    memory = run_medusa(short("medusa", tmp_path / "d", cache_dir))
    a, b = ([x["stage1/loss"] for x in r["train_curves"]["stage1"]] for r in (disk, memory))
    assert len(a) == len(b) > 2 and a[-1] < 0.8 * a[0], a
    assert a == pytest.approx(b, rel=5e-3)  # 6e-4 measured


@pytest.mark.slow
def test_eagle3_trains_on_its_three_layer_cache_as_in_memory(tmp_path, cache_dir):
    """``train/cache_hidden_states.py --config-name eagle3`` caches the drafter's three layers; training on that
    cache follows the in-memory curve."""
    own = ["eagle3.ttt_steps=2", "eval.peer_runs=[]", "data.target_states_dtype=float32"]
    hs = f"data.target_states_dir={tmp_path / 'hs'}"
    folder = cache_states(short("eagle3", tmp_path / "a", cache_dir, *own, hs))
    assert json.loads((Path(folder) / "manifest.json").read_text())["spec"]["layer_ids"] == [0, 2, 3]
    disk = run_eagle3(short("eagle3", tmp_path / "b", cache_dir, *own, hs, "data.target_states=disk"))
    memory = run_eagle3(short("eagle3", tmp_path / "c", cache_dir, *own))
    a, b = disk["train_curves"]["eagle3"], memory["train_curves"]["eagle3"]
    assert [x["step"] for x in a] == [x["step"] for x in b] and a
    assert [x["eagle3/loss"] for x in a] == pytest.approx([x["eagle3/loss"] for x in b], rel=1e-4)


@pytest.mark.slow
def test_two_ranks_write_their_shares_of_one_cache(tmp_path, cache_dir, tiny):
    """accelerate launch with 2 processes: each writes its shards; the cache equals a 1-process build."""
    common = ["+experiment=smoke", "data.cache_shard_rows=8", "data.target_states_dtype=float32",
              f"cache_dir={cache_dir}"]
    stdout = {}
    for procs, name in ((["--multi_gpu", "--num_processes", "2"], "two"), (["--num_processes", "1"], "one")):
        cmd = launch_cmd("cache_hidden_states", procs, *common, f"output_dir={tmp_path / name}",
                         f"data.target_states_dir={tmp_path / name / 'hs'}")
        proc = subprocess.run(cmd, env=launch_env(cache_dir), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        stdout[name] = proc.stdout
    assert "[rank 0] wrote 4 shards" in stdout["two"] and "[rank 1] wrote 3 shards" in stdout["two"]
    one = json.loads((tmp_path / "one" / "hs" / "manifest.json").read_text())
    two = json.loads((tmp_path / "two" / "hs" / "manifest.json").read_text())
    assert one["spec"] == two["spec"] and len(two["shards"]) == 7
    assert [s["rows"] for s in one["shards"]] == [s["rows"] for s in two["shards"]]
    for s in two["shards"]:
        a, b = load_file(str(tmp_path / "one" / "hs" / s["file"])), load_file(str(tmp_path / "two" / "hs" / s["file"]))
        assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_vllm_layer_ids_are_ours_plus_one_and_the_last_state_is_normed_here(tiny, tmp_path, monkeypatch):
    """vLLM's id i is the input of decoder layer i (transformers' hidden_states[i]); ours i is the output of layer
    i. Fed files in vLLM's convention, the vLLM state source gives exactly the in-process states, in any layer
    order, and the last hidden state after the target's own final norm."""
    from draftheads.data import vllm_states as vs
    model, tokenizer = tiny
    rows = rows_of(LENGTHS[:3], model.config.vocab_size)
    L = model.config.num_hidden_layers
    assert vs.vllm_layer_ids([0, 2], L) == [1, 3] and vs.vllm_layer_ids(None, L) == [L]

    def fake_extractor(python, job):  # what vLLM writes: [T, layers, D], ascending ids, pre-norm at id L
        files = []
        for k, ids in enumerate(job["prompts"]):
            with record_layer_outputs(model, range(L)) as outputs:
                hidden = model.base_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
            inputs = [*hidden[:L], outputs[L - 1]]  # vLLM id i < L: input of layer i; id L: last output, pre-norm
            path = tmp_path / f"req{k}.safetensors"
            save_file({"hidden_states": torch.stack([inputs[i][0] for i in job["layer_ids"]], 1),
                       "token_ids": torch.tensor(ids)}, str(path))
            files.append(str(path))
        return {"files": files}

    monkeypatch.setattr(vs, "run_extractor", fake_extractor)
    for layer_ids in (None, [2, 0], [L - 1]):
        served = vs.vllm_states(Path("python"), model, "folder", rows, layer_ids, tmp_path, 64, {})(rows)
        computed = forward_states(model, layer_ids, 2, tokenizer.pad_token_id, torch.float32)(rows)
        for a, b in zip(served, computed):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    states = vs.vllm_states(Path("python"), model, "folder", rows, None, tmp_path, 64, {})
    rows[1]["input_ids"] = rows[1]["input_ids"].flip(0)  # not the tokens vLLM was given
    with pytest.raises(ValueError, match="other tokens"):
        states(rows)


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
@pytest.mark.parametrize("job", ["medusa", "dspark"])
def test_vllm_makes_the_cache_the_in_process_target_makes(job, tmp_path, cache_dir):
    """target_backend=vllm: vLLM's states (its layer ids mapped to ours, the last state normed here) equal the
    in-process target's within float32 noise, in a cache training accepts; a run on the partial target trained
    from it follows the run trained from the in-process cache. Two drafters cover every kind of layer a cache
    holds: Medusa's stage-2 pair (the layer before the trained ones and the last), DSpark's evenly spaced layers
    and the last one its confidence head reads (EAGLE-3 and the DFlash drafters read layers of the same kind; each
    drafter trains from a disk cache on the partial target in tests/jobs/test_partial_target.py)."""
    own = [*short_settings(job), *VLLM_TINY, "eval.enabled=false", "data.target_states_dtype=float32",
           "data.cache_shard_rows=16"]
    ours, theirs = tmp_path / "hs-transformers", tmp_path / "hs-vllm"
    cache_states(smoke(job, tmp_path / "a", cache_dir, *own, f"data.target_states_dir={ours}"))
    cache_states(smoke(job, tmp_path / "b", cache_dir, *own, f"data.target_states_dir={theirs}", "target_backend=vllm",
                       f"vllm.venv={VLLM_VENV}"))
    a, b = (json.loads((f / "manifest.json").read_text()) for f in (ours, theirs))
    assert a["spec"] == b["spec"] and a["num_rows"] == b["num_rows"]
    worst = 0.0
    for shard in a["shards"]:
        x, y = load_file(str(ours / shard["file"])), load_file(str(theirs / shard["file"]))
        assert x.keys() == y.keys()
        worst = max(worst, *((x[k] - y[k]).abs().max().item() / x[k].abs().max().item() for k in x))
    assert worst < 1e-3, worst
    trained = [train(job, smoke(job, tmp_path / name, cache_dir, *own, "data.target_states=disk",
                                f"data.target_states_dir={hs}", "model.partial=true"))
               for name, hs in (("c", ours), ("d", theirs))]
    first, second = ([p[k] for p in next(iter(r["train_curves"].values())) for k in p if k.endswith("/loss")]
                     for r in trained)
    # Same initial weights on states equal within 1e-3: the first loss agrees closely. lr 2e-2 on a random target
    # then amplifies the states' float32 noise step by step (5.5e-3 apart by the 7th step on 2 AMD EPYC cores).
    assert first[0] == pytest.approx(second[0], rel=1e-3)
    assert first == pytest.approx(second, rel=2e-2)
