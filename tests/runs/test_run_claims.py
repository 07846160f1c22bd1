"""A run's folder and record hold what happened (issue 52): nothing is deleted or rewritten before every check that
can fail has passed; a resume refuses a setting the run decided instead of ignoring it while recording it; a
folder is claimed by one job at a time; errors name the file and the next command, before the expensive work."""

import json
import shutil
from pathlib import Path

import pytest

from draftheads import drafters
from draftheads.jobs import evaluate as evaluate_job
from draftheads.jobs import export as export_job
from draftheads.jobs.evaluate import evaluate_run
from draftheads.jobs.export import export_run
from draftheads.run_folder import LEDGER, finished_steps, record_finished
from draftheads.runs import life
from draftheads.runs.output_dir import lock_output_dir, release
from tests.helpers import run_medusa, smoke

pytestmark = pytest.mark.slow  # whole smoke jobs on the tiny target

SHORT = ["stage1.epochs=1", "stage2.enabled=false", "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]",
         "eval.max_new_tokens=8", "eval.peers=[]", "eval.prompt_lookup_tokens=0"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, cache_dir):
    """A finished smoke Medusa run (stage 1, exported, evaluated)."""
    out = tmp_path_factory.mktemp("claims") / "run"
    run_medusa(smoke("medusa", out, cache_dir, *SHORT))
    return out


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run to change."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def snapshot(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def no_target(monkeypatch):
    """Loading the target fails the test: what must be refused is refused before it (and any row)."""
    def refused(*a, **k):
        raise AssertionError("the target was loaded before the refusal")
    monkeypatch.setattr(life, "load_target", refused)


def test_overwrite_with_init_from_naming_the_run_itself_is_refused_and_deletes_nothing(run, cache_dir, monkeypatch):
    """Row 1: a refresh that forgot output_dir, told by the refusal to add overwrite=true, deleted the run it
    started from, then failed ("not a run folder")."""
    before = snapshot(run)
    no_target(monkeypatch)
    for where in (run, run / "export" / "vllm"):
        with pytest.raises(ValueError, match=rf"medusa.init_from={where} is inside output_dir={run}.*_refreshed"):
            run_medusa(smoke("medusa", run, cache_dir, *SHORT, "overwrite=true", f"medusa.init_from={where}"))
    assert snapshot(run) == before


@pytest.mark.parametrize("override, key", [("trainer.lr=0.5", "trainer.lr"), ("medusa.num_heads=2", "medusa.num_heads"),
                                           ("data.num_train_prompts=9", "data.num_train_prompts")])
def test_a_resume_that_changes_what_the_run_decided_is_refused_before_any_work(run, cache_dir, monkeypatch,
                                                                              override, key):
    """Rows 2, 3 and 7: a new rate was ignored while config.yaml and report.json recorded it; another head count
    failed late with a raw state_dict error after regeneration and target states, config.yaml rewritten."""
    before = snapshot(run)
    no_target(monkeypatch)
    with pytest.raises(ValueError, match=rf"resume=true continues the run .* {key}: the run has .*overwrite=true"):
        run_medusa(smoke("medusa", run, cache_dir, *SHORT, "resume=true", override))
    assert snapshot(run) == before


def test_a_finished_run_resumed_with_other_eval_settings_is_left_as_it_is(run, cache_dir, capsys):
    """Row 3: "nothing to resume" rewrote config.yaml with settings nothing ran with."""
    before = snapshot(run)
    run_medusa(smoke("medusa", run, cache_dir, *SHORT, "resume=true", "eval.max_new_tokens=4"))
    assert "nothing to resume" in capsys.readouterr().out
    assert {k: v for k, v in snapshot(run).items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}


def test_resume_and_overwrite_together_are_refused(tmp_path, cache_dir, monkeypatch):
    """Row 14: overwrite=true was silently ignored under resume=true."""
    no_target(monkeypatch)
    with pytest.raises(ValueError, match="resume=true .* overwrite=true deletes it: set one of them"):
        run_medusa(smoke("medusa", tmp_path / "run", cache_dir, *SHORT, "resume=true", "overwrite=true"))


def test_resume_on_a_folder_without_a_run_says_it_starts_afresh(tmp_path, cache_dir, capsys):
    """Row 14: it trained from scratch without a word."""
    run_medusa(smoke("medusa", tmp_path / "run", cache_dir, *SHORT, "resume=true", "eval.enabled=false"))
    assert "holds no checkpoint to continue from: starting afresh" in capsys.readouterr().out
    assert finished_steps(tmp_path / "run") == ["training", "validation", "save", "export"]


@pytest.mark.parametrize("name, text", [("config.yaml", "learning_rate: 3\n"), ("notes.txt", "mine")])
def test_an_output_dir_holding_someone_elses_files_is_refused_and_left_alone(tmp_path, cache_dir, monkeypatch, name,
                                                                            text):
    """Row 4: a user's own config.yaml was overwritten silently; other stray files were accepted."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / name).write_text(text)
    no_target(monkeypatch)
    with pytest.raises(FileExistsError, match=rf"output_dir={out} holds no run but files no run writes \({name}\)"):
        run_medusa(smoke("medusa", out, cache_dir, *SHORT))
    assert (out / name).read_text() == text


def test_a_second_job_on_a_claimed_output_dir_is_refused_naming_the_holder(tmp_path, cache_dir, monkeypatch):
    """Row 15: nothing stopped two runs on one output_dir."""
    out = tmp_path / "run"
    held = lock_output_dir(out)  # another job holds it (flock: another open file conflicts, even in one process)
    try:
        no_target(monkeypatch)
        with pytest.raises(RuntimeError, match=rf"output_dir={out} is in use by another job \(pid \d+ on "):
            run_medusa(smoke("medusa", out, cache_dir, *SHORT))
    finally:
        release(held)
    assert lock_output_dir(out) is not None  # released: the next job takes it


def test_evaluate_and_export_refuse_a_run_another_job_holds_before_reading_it(run, monkeypatch):
    """train/evaluate.py and train/export.py wrote into a run that a resumed training (or another tool) held."""
    for module in (evaluate_job, export_job):
        monkeypatch.setattr(module, "open_run", lambda *a, **k: pytest.fail("the run was read while held"))
    held = lock_output_dir(run)
    try:
        for tool in (evaluate_run, export_run):
            with pytest.raises(RuntimeError, match=rf"output_dir={run} is in use by another job"):
                tool(run)
    finally:
        release(held)


def test_a_run_stopped_during_its_evaluation_resumes_by_evaluating_only(run, cache_dir, monkeypatch):
    """Row 12: a resume after Ctrl-C during the evaluation ran validation, the save and the export again (and
    computed the target states of every row again)."""
    record_finished(run, "medusa", ["training", "validation", "save", "export"])  # killed while evaluating
    report_before = json.loads((run / "report.json").read_text())
    heads = (run / "medusa_heads" / "medusa_heads.safetensors").read_bytes()
    recipe = type(drafters.get("medusa"))
    for step in ("validate", "save", "export", "write_serving"):
        monkeypatch.setattr(recipe, step, lambda *a, _s=step, **k: pytest.fail(f"{_s} ran again"))
    monkeypatch.setattr("draftheads.runs.rows.attach_hidden_states",
                        lambda *a, **k: pytest.fail("target states computed again for rows nothing trains on"))
    report = run_medusa(smoke("medusa", run, cache_dir, *SHORT, "resume=true"))
    assert json.loads((run / LEDGER).read_text())["finished"][-1] == "evaluation"
    assert report["validation"] == report_before["validation"] and report["eval"]["chitchat"]["num_prompts"] == 2
    assert (run / "medusa_heads" / "medusa_heads.safetensors").read_bytes() == heads


def test_evaluating_a_run_whose_report_cannot_be_written_is_refused_before_evaluating(run, monkeypatch):
    """Row 9: a read-only run was evaluated in full, then writing report.json.tmp failed. (As root a chmod does
    not stop writes: the report's temporary file is made a folder instead.)"""
    (run / "report.json.tmp").mkdir()
    monkeypatch.setattr("draftheads.jobs.evaluate.open_run", lambda *a, **k: pytest.fail("evaluated first"))
    with pytest.raises(PermissionError, match=rf"{run} cannot take this evaluation's report .*copy the run"):
        evaluate_run(run)


def test_weights_that_are_no_folder_are_named_with_the_runs_exports(run, tmp_path, cache_dir):
    """Row 13: weights=export/vllm of a run trained with export=false said "holds no Medusa heads"."""
    with pytest.raises(FileNotFoundError, match=r"weights=export/nothing: no such folder .*export/vllm"):
        evaluate_run(run, weights="export/nothing")
    bare = tmp_path / "bare"
    run_medusa(smoke("medusa", bare, cache_dir, *SHORT, "export=false", "eval.enabled=false"))
    with pytest.raises(FileNotFoundError, match=r"none, it ran with export=false: python train/export.py"):
        evaluate_run(bare, weights="export/vllm")


def test_a_missing_warm_start_source_names_the_job_that_writes_it_before_the_target_loads(tmp_path, cache_dir,
                                                                                          monkeypatch):
    """Row 11: train/dspark.py without runs/dflash said "no such folder" after 45 s."""
    no_target(monkeypatch)
    source = tmp_path / "runs" / "dflash"
    with pytest.raises(FileNotFoundError, match=rf"dspark.init_from={source}: no such folder: run train/dflash.py "
                                                rf"first .* or set dspark.init_from=null"):
        life.train("dspark", smoke("dspark", tmp_path / "run", cache_dir, f"dspark.init_from={source}"))


def test_long_prompts_beyond_the_targets_window_are_refused_before_training(tmp_path, cache_dir, monkeypatch):
    """Row 5: eval=long_context prompts longer than the target's window were measured without a word (the tiny
    target's window: 2048, its max_position_embeddings)."""
    from draftheads.training import spine
    monkeypatch.setattr(spine, "fit", lambda *a, **k: pytest.fail("trained before the refusal"))
    long = "eval.sets=[{name: long, source: chitchat, num_prompts: 1, min_prompt_tokens: 4000}]"
    with pytest.raises(ValueError, match=r"eval set 'long': 1 of 1 prompts do not fit the target's context window"):
        run_medusa(smoke("medusa", tmp_path / "run", cache_dir, "stage1.epochs=1", "stage2.enabled=false", long))


def test_a_missing_peer_run_fails_when_the_job_opens_unless_asked_to_skip(tmp_path, cache_dir, monkeypatch):
    """Issue 53: a peer run that could not be loaded became a note at the end of the run."""
    no_target(monkeypatch)
    with pytest.raises(FileNotFoundError, match=rf"eval.peer_runs: {tmp_path / 'medusa'}: no such run folder.*"
                                                rf"eval.unusable_peers=skip"):
        run_medusa(smoke("medusa", tmp_path / "run", cache_dir, *SHORT, f"eval.peer_runs=[{tmp_path / 'medusa'}]"))
