"""A run folder is self-contained: moved or copied, a Medusa run is evaluated on its own stage-2 target and its
exports name no path of the machine that made it; what lies outside it (the base target) is named as the user
named it and checked by its fingerprint; evaluation, export and peer runs refuse a run that never finished its
save."""

import json
import re
import shutil
from pathlib import Path

import pytest

from draftheads.jobs.evaluate import evaluate_run
from draftheads.jobs.export import export_run
from draftheads.runs.saved import load_peer_runs, open_run
from draftheads.models.target import TINY, TargetSpec, load_target, resolve_target_path
from draftheads.models.tiny import TinySpec
from tests.helpers import SMOKE_STAGES, run_medusa, smoke

pytestmark = pytest.mark.slow  # whole Medusa jobs, evaluated again

SHORT = ["eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]", "eval.max_new_tokens=16"]
"""A short evaluation, recorded in the run's config (evaluations without overrides use it)."""
HEADS_CONFIG = Path("medusa_heads") / "medusa_heads.json"


@pytest.fixture(scope="module")
def moved(tmp_path_factory, cache_dir):
    """A finished smoke Medusa run with stage 2, evaluated where it was trained, then moved (nothing is left
    where it was trained): ``(its folder now, the folder it was trained in, its chitchat metrics there)``."""
    root = tmp_path_factory.mktemp("run_folder")
    trained, moved = root / "trained", root / "moved"
    run_medusa(smoke("medusa", trained, cache_dir, *SMOKE_STAGES, "eval.enabled=false", *SHORT))
    in_place = evaluate_run(trained)["eval"]["chitchat"]
    shutil.move(trained, moved)
    return moved, trained, in_place


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_dir):
    """A finished smoke Medusa run without stage 2 (served with the base target, which lies outside it)."""
    out = tmp_path_factory.mktemp("base_run") / "run"
    run_medusa(smoke("medusa", out, cache_dir, "stage1.epochs=1", "stage2.enabled=false", "eval.enabled=false",
                     *SHORT))
    return out


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _edit_json(path: Path, **fields) -> None:
    """Set ``fields`` in the JSON object at ``path``; a field set to None is removed."""
    data = json.loads(path.read_text()) | fields
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}))


def test_a_moved_run_is_evaluated_on_its_own_target_as_where_it_was_trained(moved):
    folder, _, in_place = moved
    assert open_run(folder).target_path == str(folder / "export" / "target")
    again = evaluate_run(folder)["eval"]["chitchat"]
    assert again["acceptance_length"] == in_place["acceptance_length"]
    assert again["acceptance_rate_per_position"] == in_place["acceptance_rate_per_position"]


def test_a_copy_is_evaluated_on_its_own_target(moved, tmp_path):
    copy = _copy(moved[0], tmp_path / "copy")
    assert open_run(copy).target_path == str(copy / "export" / "target")


def test_a_self_made_eval_set_is_written_by_the_configured_target_not_by_a_stage_2_target(moved, base_run, tmp_path):
    """Evaluated in an empty cache on a self-made set, a run with its own stage-2 target and a run on the configured
    target read the same prompts: the configured target writes them, as the training job does before it trains.
    Written by the stage-2 weights (before), they were other prompts, cached under the configured target's key."""
    general = "eval.sets=[{name: general, source: self_made, num_prompts: 4, self_made: {seed: 3, batch_size: 8}}]"
    made = {}
    for name, folder in (("stage2", moved[0]), ("base", base_run)):
        cache = tmp_path / f"cache_{name}"
        evaluate_run(_copy(folder, tmp_path / name), [general, f"cache_dir={cache}", "eval.max_new_tokens=4"])
        files = sorted((cache / "self_made").glob("*-4.jsonl"))
        made[name] = [json.loads(line)["prompt"] for f in files for line in f.read_text().splitlines()]
    assert len(made["stage2"]) == 4 and made["stage2"] == made["base"]


def test_a_run_missing_its_stage_2_target_is_refused_not_evaluated_on_the_base_target(moved, tmp_path):
    copy = _copy(moved[0], tmp_path / "copy")
    shutil.rmtree(copy / "export" / "target")
    with pytest.raises(FileNotFoundError, match=re.escape(str(copy / "export" / "target"))):
        open_run(copy)


def test_heads_saved_with_an_absolute_target_path_are_read_as_before(moved, tmp_path):
    """Heads saved by earlier versions name the stage-2 target by an absolute path: it stays absolute, and a
    missing one is refused, not replaced by the base target."""
    copy = _copy(moved[0], tmp_path / "copy")
    elsewhere = _copy(copy / "export" / "target", tmp_path / "elsewhere")
    _edit_json(copy / HEADS_CONFIG, base_model=str(elsewhere), base_model_in_run=None)
    assert open_run(copy).target_path == str(elsewhere)
    shutil.rmtree(elsewhere)
    with pytest.raises(FileNotFoundError, match=re.escape(str(elsewhere))):
        open_run(copy)


def test_exports_hold_no_path_of_the_machine_that_made_them(moved, cache_dir):
    """Written where the run was trained, and again where it lies now: no file of ``export/`` or the heads names
    either folder or the cache; TGI is told to serve the stage-2 target beside its folder."""
    folder, trained, _ = moved

    def files_naming(*paths):
        files = [f for f in [*(folder / "export").rglob("*"), folder / HEADS_CONFIG] if f.is_file()]
        return [(str(f), p) for f in files for p in paths if str(p).encode() in f.read_bytes()]

    assert json.loads((folder / "export" / "tgi" / "config.json").read_text())["base_model_name_or_path"] == "../target"
    assert json.loads((folder / HEADS_CONFIG).read_text())["base_model"] == "export/target"
    assert files_naming(trained, cache_dir) == []
    export_run(folder)
    assert files_naming(trained, folder, cache_dir) == []


def test_overriding_the_target_of_a_run_evaluated_on_its_own_target_is_an_error(moved):
    with pytest.raises(ValueError, match=r"model.name_or_path.*export/target"):
        evaluate_run(moved[0], ["model.name_or_path=tiny://qwen3"])


def test_a_run_without_stage_2_names_its_target_as_the_user_did(base_run):
    assert json.loads((base_run / HEADS_CONFIG).read_text())["base_model"] == TINY
    assert json.loads((base_run / "export" / "tgi" / "config.json").read_text())["base_model_name_or_path"] == TINY


def test_a_base_target_other_than_the_one_trained_against_is_refused(base_run, cache_dir):
    """Another target of the same sizes (another seed) is refused, naming both; another dtype of the same one is
    not (its weights sample cannot be compared)."""
    other = resolve_target_path(TargetSpec(name_or_path=TINY, tiny=TinySpec(seed=1)), cache_dir)
    with pytest.raises(ValueError, match=rf"trained against '{TINY}'.*{re.escape(other)}.*weights_sample_sha256"):
        open_run(base_run, ["model.tiny.seed=1"])
    assert open_run(base_run, ["model.dtype=bfloat16"]).target.dtype.is_floating_point


def _unfinished(run: Path, dest: Path, finished: list[str] | None) -> Path:
    """A copy of ``run`` whose ledger says only ``finished`` steps finished (None: neither ledger nor report): a
    run killed before its save, or a new run started over it, leaves the old drafter beside such a ledger. Its
    report still says every step finished: only the ledger is read back."""
    copy = _copy(run, dest)
    if finished is None:
        (copy / "progress.json").unlink()
        (copy / "report.json").unlink()
    else:
        _edit_json(copy / "progress.json", finished=finished)
    return copy


@pytest.mark.parametrize("finished", [[], ["training", "validation"], None])
def test_a_run_that_never_finished_its_save_is_refused_by_evaluation_and_export(moved, tmp_path, finished):
    copy = _unfinished(moved[0], tmp_path / "copy", finished)
    for tool in (evaluate_run, export_run):
        with pytest.raises(FileNotFoundError, match=r"has not finished its save.*resume=true finishes it"):
            tool(copy)


def test_export_of_a_run_killed_before_its_save_says_resume_finishes_it(moved, tmp_path):
    copy = _unfinished(moved[0], tmp_path / "copy", ["training", "validation"])
    shutil.rmtree(copy / "medusa_heads")
    with pytest.raises(FileNotFoundError, match="resume=true finishes it"):
        export_run(copy)


def test_an_unfinished_peer_run_fails_or_is_skipped_with_a_note_when_asked(moved, tmp_path, cache_dir):
    folder = moved[0]
    record = json.loads((folder / "target.json").read_text())
    model, _, host = load_target(TargetSpec(TINY), cache_dir)
    unfinished = _unfinished(folder, tmp_path / "unfinished", [])
    with pytest.raises(ValueError, match=rf"{unfinished} cannot be measured"):
        load_peer_runs([str(folder), str(unfinished)], record, host, model)
    peers, notes = load_peer_runs([str(folder), str(unfinished)], record, host, model, "skip")
    assert [p.folder for p in peers] == [folder]
    assert notes[0].startswith(f"{folder}: medusa, measured")
    assert notes[1].startswith(f"{unfinished}: skipped") and "resume=true finishes it" in notes[1]
