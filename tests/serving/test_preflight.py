"""The serving preflight: the comparison of what vLLM's engine read with what the job means, on stand-in readings
(no vLLM); the job stopped before its rows and target states when they differ (the engine's readings stood in);
every drafter with a preflight says what vLLM must read in names the engine reports; and, in vLLM's environment
(``DRAFTHEADS_VLLM_VENV``), a correct EAGLE-3 export passing and a wrong one caught, naming its keys."""

import json
from types import SimpleNamespace

import pytest
import torch
from draftheads.models.target import TINY, TargetSpec, load_target

from draftheads import drafters
from draftheads.drafters.eagle3 import export as eagle3_export
from draftheads.run_folder import finished_steps
from draftheads.runs import life as train_module
from draftheads.runs import preflight as job_preflight
from draftheads.runs.life import train
from draftheads.runs.preflight import VENV_VARIABLE, preflight_python
from draftheads.serving import preflight as preflight_module
from draftheads.serving.preflight import Expect, PreflightMismatch, check, mismatches, refusal
from draftheads.training.config import to_schema
from tests.helpers import VLLM_TINY, VLLM_VENV, short_settings, smoke

ENGINE_READS = {"method", "num_speculative_tokens", "max_model_len", "draft_max_model_len", "aux_hidden_state_layers",
                "norm_before_fc", "fc_norm", "norm_output", "num_aux_hidden_states", "norm_before_residual",
                "mask_token_id", "draft_vocabulary"}
"""What ``vllm_runner.engine_reads`` can report (a recipe expecting another name would always mismatch)."""

EXPECTED = {"aux_hidden_state_layers": Expect([2, 3, 4], "config.json eagle_config.eagle_aux_hidden_state_layer_ids",
                                              "draftheads layers [1, 2, 3], each + 1"),
            "norm_before_fc": Expect(True, "config.json norm_before_fc"),
            "num_speculative_tokens": Expect(3, "speculative_config num_speculative_tokens"),
            "draft_vocabulary": Expect(list(range(0, 512, 2)), "model.safetensors d2t")}


def engine_result(**read) -> dict:
    """A stand-in of the runner's preflight result: the engine read ``EXPECTED``'s values but ``read``."""
    values = {name: e.ours for name, e in EXPECTED.items()} | read
    return {"read": values, "outputs": [[5, 6, 7, 8]], "metrics": {"drafts": 2, "accepted": 1}}


def test_equal_readings_pass_and_the_record_keeps_both_sides():
    record = check(EXPECTED, engine_result())
    assert record["passed"] and record["mismatches"] == [] and record["drafts"] == 2
    assert record["readings"]["aux_hidden_state_layers"] == {"key": EXPECTED["aux_hidden_state_layers"].key,
                                                             "ours": [2, 3, 4], "server": [2, 3, 4]}
    assert record["readings"]["draft_vocabulary"]["server"] == {"size": 256, "sum": sum(range(0, 512, 2))}


def test_a_shifted_layer_id_and_a_flag_read_otherwise_are_named_with_the_key_and_both_values():
    bad = mismatches(EXPECTED, engine_result(aux_hidden_state_layers=(1, 2, 3), norm_before_fc=False)["read"])
    assert len(bad) == 2
    assert bad[0].startswith("aux_hidden_state_layers (config.json eagle_config.eagle_aux_hidden_state_layer_ids)")
    assert "ours [2, 3, 4] (draftheads layers [1, 2, 3], each + 1)" in bad[0] and "server read [1, 2, 3]" in bad[0]
    assert bad[1] == "norm_before_fc (config.json norm_before_fc): ours True, the server read False"
    message = str(refusal(check(EXPECTED, engine_result(norm_before_fc=False)), "export/eagle3"))
    assert "export/eagle3" in message and "norm_before_fc" in message and "serving.preflight=off" in message


def test_order_draft_length_vocabulary_missing_readings_and_no_drafts_fail():
    assert mismatches(EXPECTED, engine_result(aux_hidden_state_layers=[4, 3, 2])["read"])  # the order fed to fc
    assert "ours 3, the server read 4" in mismatches(EXPECTED, engine_result(num_speculative_tokens=4)["read"])[0]
    shifted = mismatches(EXPECTED, engine_result(draft_vocabulary=list(range(1, 513, 2)))["read"])[0]
    assert "[256 values: 0, 2, ..., 510; sum 65280]" in shifted and "[256 values: 1, 3, ..., 511" in shifted
    read = engine_result()["read"]
    del read["norm_before_fc"]  # a vLLM whose draft model has no such attribute reads no such key
    assert "the server reports no norm_before_fc" in mismatches(EXPECTED, read)[0]
    none = engine_result()
    none["metrics"]["drafts"] = 0
    record = check(EXPECTED, none)
    assert not record["passed"] and record["mismatches"][0].startswith("drafts: the engine made no draft")


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return load_target(TargetSpec(name_or_path=TINY), tmp_path_factory.mktemp("cache"))


@pytest.mark.parametrize("name", sorted(drafters.DRAFTERS))
def test_every_drafter_with_a_preflight_expects_readings_the_engine_reports(name, tmp_path, tiny_target, cache_dir):
    """Each registered drafter's untrained export is written where vLLM loads it and its expected readings are
    named as the engine reports them, without drawing from the RNG training initialises from."""
    recipe = drafters.get(name)
    target, tokenizer, _ = tiny_target
    conf = to_schema(smoke(name, tmp_path / "run", cache_dir))
    job = SimpleNamespace(conf=conf, target=target, tokenizer=tokenizer)
    torch.manual_seed(0)
    trained = recipe.untrained(job, tmp_path)
    after = torch.rand(1)
    if trained is None:  # no preflight (Medusa): nothing written
        assert not (tmp_path / recipe.spec.vllm_weights).exists()
        return
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(1))
    assert (tmp_path / recipe.spec.vllm_weights / "config.json").is_file()
    expected = recipe.served_reads(conf, trained, target)
    assert set(expected) <= ENGINE_READS and {"method", "num_speculative_tokens", "aux_hidden_state_layers"} <= set(
        expected)
    assert expected["num_speculative_tokens"].ours == recipe.draft_length(conf, trained)
    assert expected["aux_hidden_state_layers"].ours == [i + 1 for i in recipe.drafter_layers(conf, target)]
    assert recipe.vllm_config(tmp_path, conf, trained)["method"] == expected["method"].ours


def stand_in_vllm(folder, version: str, methods: list[str]):
    """A vLLM environment whose probe reports ``version`` and ``methods`` (``bin/python`` a shell script)."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho '{json.dumps({'version': version, 'methods': methods})}'\n")
    python.chmod(0o755)
    return folder


def test_auto_runs_only_where_a_named_vllm_serves_the_drafter_per_the_matrix_and_off_never(tmp_path, monkeypatch,
                                                                                          cache_dir):
    eagle3 = drafters.get("eagle3")
    monkeypatch.delenv(VENV_VARIABLE, raising=False)
    job = SimpleNamespace(conf=to_schema(smoke("eagle3", tmp_path / "run", cache_dir, "serving.preflight=auto")))
    python, why = preflight_python(job, eagle3)
    assert python is None and VENV_VARIABLE in why
    monkeypatch.setenv(VENV_VARIABLE, str(tmp_path / "none"))
    assert "holds no environment" in preflight_python(job, eagle3)[1]
    monkeypatch.setenv(VENV_VARIABLE, str(stand_in_vllm(tmp_path / "old", "0.31.0", ["ngram", "eagle"])))
    assert "does not serve method 'eagle3'" in preflight_python(job, eagle3)[1]
    monkeypatch.setenv(VENV_VARIABLE, str(stand_in_vllm(tmp_path / "new", "0.34.0", ["eagle3"])))
    assert "no vLLM of the serving matrix" in preflight_python(job, eagle3)[1]
    served = stand_in_vllm(tmp_path / "served", "0.32.0", ["medusa", "eagle3"])
    monkeypatch.setenv(VENV_VARIABLE, str(served))
    assert preflight_python(job, eagle3) == (served / "bin" / "python", "")
    dspark = drafters.get("dspark")  # vLLM 0.32 reads DSpark's export but runs it on GPUs only
    monkeypatch.setenv(VENV_VARIABLE, str(stand_in_vllm(tmp_path / "dspark", "0.32.0", ["dspark"])))
    dspark_job = SimpleNamespace(conf=to_schema(smoke("dspark", tmp_path / "ds", cache_dir, "serving.preflight=auto")))
    assert "GPUs only" in preflight_python(dspark_job, dspark)[1]
    job = SimpleNamespace(conf=to_schema(smoke("eagle3", tmp_path / "run", cache_dir)))  # the smoke preset: off
    assert preflight_python(job, eagle3) == (None, "serving.preflight=off")


def test_a_mismatch_stops_the_job_before_its_rows_and_target_states(tmp_path, cache_dir, monkeypatch):
    """The engine's readings stood in (one layer id shifted): the job stops with the key named, report.json
    records the preflight, and no row was built nor target state computed."""
    monkeypatch.setattr(job_preflight, "preflight_python", lambda job, recipe: ("python", ""))
    seen = {}

    def stand_in(python, job):
        seen["spec"] = job["speculative_config"]
        n = job["speculative_config"]["num_speculative_tokens"]
        return engine_result(method="eagle3", num_speculative_tokens=n,
                             aux_hidden_state_layers=[1, 2, 3], norm_before_fc=False, fc_norm=False, norm_output=False,
                             norm_before_residual=False, num_aux_hidden_states=3, draft_vocabulary=None,
                             draft_max_model_len=job["engine"]["max_model_len"])
    monkeypatch.setattr(preflight_module, "run_vllm", stand_in)
    monkeypatch.setattr(train_module, "job_rows", lambda *a, **k: pytest.fail("rows built after a failed preflight"))
    out = tmp_path / "run"
    with pytest.raises(PreflightMismatch, match=r"aux_hidden_state_layers \(config.json eagle_config") as stopped:
        train("eagle3", smoke("eagle3", out, cache_dir, "eagle3.target_layer_ids=[2,3,0]", "serving.preflight=on"))
    assert "ours [3, 4, 1]" in str(stopped.value) and "server read [1, 2, 3]" in str(stopped.value)
    assert seen["spec"]["method"] == "eagle3" and not (out / "export").exists()  # the export was temporary
    report = json.loads((out / "report.json").read_text())
    assert finished_steps(out) == [] and report["preflight"]["passed"] is False
    assert report["preflight"]["readings"]["aux_hidden_state_layers"]["server"] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllm_reads_a_correct_eagle3_export_as_meant_and_catches_a_wrong_one(tmp_path, cache_dir, monkeypatch):
    """Real vLLM on the tiny target: the job's untrained EAGLE-3.1 export (``norm_before_residual`` on) passes
    (report.json says so, with its seconds); an exporter that writes draftheads' layer ids (vLLM's less one) and an
    ``eagle_config`` flag that vLLM reads before the top-level one is caught, naming both keys, before any row or
    target state."""
    own = [*VLLM_TINY, "eagle3.target_layer_ids=[1,2,3]", "eagle3.norm_before_fc=true", "eagle3.fc_norm=true",
           "eagle3.norm_before_residual=true", "eagle3.draft_vocab_size=256", "eagle3.gamma=3", "serving.preflight=on",
           f"vllm.venv={VLLM_VENV}", "eval.enabled=false", "train.max_steps=2", "eagle3.ttt_steps=2"]
    right = eagle3_export.server_config

    def wrong(model):
        config = right(model)
        config["eagle_config"] = {**config["eagle_config"], "norm_before_fc": False,
                                  "eagle_aux_hidden_state_layer_ids": list(model.target_layer_ids)}
        return config
    monkeypatch.setattr(eagle3_export, "server_config", wrong)
    monkeypatch.setattr(train_module, "job_rows", lambda *a, **k: pytest.fail("rows built after a failed preflight"))
    with pytest.raises(PreflightMismatch) as stopped:
        train("eagle3", smoke("eagle3", tmp_path / "wrong", cache_dir, *own))
    message = str(stopped.value)
    assert "aux_hidden_state_layers (config.json eagle_config.eagle_aux_hidden_state_layer_ids" in message
    assert "ours [2, 3, 4]" in message and "server read [1, 2, 3]" in message
    assert "norm_before_fc (config.json norm_before_fc (eagle_config.norm_before_fc first)): ours True, the server " \
           "read False" in message
    monkeypatch.undo()
    report = train("eagle3", smoke("eagle3", tmp_path / "right", cache_dir, *own))
    record = report["preflight"]
    assert record["ran"] and record["passed"] and record["drafts"] > 0 and record["seconds"] > 0
    assert record["readings"]["aux_hidden_state_layers"]["server"] == [2, 3, 4]
    assert record["readings"]["draft_vocabulary"]["server"]["size"] == 256
    assert record["readings"]["norm_before_residual"]["server"] is True
    print(f"preflight on the tiny target: {record['seconds']} s ({record['engine_seconds']} s in the engine)")


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_an_engine_that_fails_on_the_export_is_undecided_loudly_and_stops_the_job_under_on(tmp_path, cache_dir,
                                                                                         monkeypatch, capsys, mode):
    """Issue 53: under auto a vLLM engine crash became passed: null with one quiet line, and training went on."""
    import subprocess
    monkeypatch.setattr(job_preflight, "preflight_python", lambda job, recipe: ("python", ""))

    def crash(python, job):
        raise subprocess.CalledProcessError(1, ["python", "vllm_runner.py"], stderr="RuntimeError: engine died")
    monkeypatch.setattr(preflight_module, "run_vllm", crash)
    overrides = ["eagle3.target_layer_ids=[2,3,0]", f"serving.preflight={mode}", "eval.enabled=false"]
    if mode == "on":
        monkeypatch.setattr(train_module, "job_rows", lambda *a, **k: pytest.fail("rows built after the crash"))
        with pytest.raises(subprocess.CalledProcessError):
            train("eagle3", smoke("eagle3", tmp_path / "run", cache_dir, *overrides))
        return
    report = train("eagle3", smoke("eagle3", tmp_path / "run", cache_dir, *short_settings("eagle3"), *overrides))
    err = capsys.readouterr().err
    assert "WARNING: serving preflight UNDECIDED" in err and "engine died" in err and "serving.preflight=on" in err
    assert report["preflight"]["passed"] is None and report["preflight"]["why"].startswith("undecided")
