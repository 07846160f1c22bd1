"""Every job claims its output_dir the same way: a folder holding a training run is refused unless resumed or
overwritten; an overwritten run keeps nothing of the old one but the state cache it reads; a folder holding
files no run writes is never deleted from; a run that failed before training produced anything is no run."""

import json

import pytest

from draftheads.jobs.cache import cache_states
from draftheads.run_folder import finished_steps
from draftheads.runs.output_dir import claim_output_dir
from tests.helpers import run_medusa, smoke

FINISHED = {"drafter": "medusa", "finished": ["training", "validation", "save"]}


def old_run(out, report: dict = FINISHED):
    """``out`` holding what a finished Medusa run leaves (its state cache and tracker files too): each file says
    "old"."""
    for name in ("checkpoints/stage1-step000005/meta.json", "medusa_heads/medusa_heads.json",
                 "export/vllm/config.json", "export/dflash/config.json", "hidden_states/manifest.json",
                 "config.yaml", "target.json", "acceptance.png", "logs/events.out.tfevents.1", "wandb_run_id"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("old")
    (out / "report.json").write_text(json.dumps(report))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("target_states, kept", [("memory", set()), ("disk", {"hidden_states"})])
def test_an_overwriting_run_keeps_nothing_of_the_old_one_but_the_state_cache_it_reads(target_states, kept, tmp_path,
                                                                                        cache_dir):
    out = old_run(tmp_path / "run")
    with pytest.raises(ValueError, match="num_val_prompts"):  # interrupted right after the claim
        run_medusa(smoke("medusa", out, cache_dir, "overwrite=true", f"data.target_states={target_states}",
                         "data.num_val_prompts=0"))
    assert {p.name for p in out.iterdir()} == {"config.yaml", "target.json", "progress.json", ".lock", *kept}
    assert "old" not in {(out / name).read_text() for name in ("config.yaml", "target.json")}
    assert json.loads((out / "progress.json").read_text())["finished"] == []
    assert not kept or (out / "hidden_states" / "manifest.json").read_text() == "old"


def test_overwrite_never_deletes_from_a_folder_holding_files_no_run_writes(tmp_path):
    out = old_run(tmp_path / "home")
    (out / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for delete in (False, True):
        with pytest.raises(FileExistsError, match=r"files no run writes \(notes.txt\).*move them"):
            claim_output_dir(out, overwrite=True, delete=delete, saved=("medusa_heads",))
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


@pytest.mark.parametrize("report, checkpoint, held", [
    ({"drafter": "medusa", "finished": [], "started": "2025-01-01T00:00:00+00:00"}, False, False),  # failed start
    ({"drafter": "medusa", "finished": [], "started": "2025-01-01T00:00:00+00:00"}, True, True),  # killed in training
    (FINISHED, False, True),
    ("{not json", False, True),
])
def test_a_run_that_failed_before_training_produced_anything_is_no_run(report, checkpoint, held, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.json").write_text(report if isinstance(report, str) else json.dumps(report))
    if checkpoint:
        (out / "checkpoints" / "stage1-step000005").mkdir(parents=True)
    if held:
        with pytest.raises(FileExistsError, match="holds a training run"):
            claim_output_dir(out, overwrite=False, delete=True)
    else:
        claim_output_dir(out, overwrite=False, delete=True)


@pytest.mark.slow
def test_the_state_cache_and_its_training_run_share_one_output_dir_and_no_cache_job_rewrites_the_run(tmp_path,
                                                                                                    cache_dir):
    """The documented order: cache_hidden_states.py (again: it resumes), then the training job reading that cache
    in the same output_dir; a cache job into the finished run's folder is then refused, its config.yaml and
    target.json unchanged (a run of another target once took such a folder for a peer of its own)."""
    out = tmp_path / "run"
    short = ["stage1.epochs=1", "stage2.enabled=false", "eval.enabled=false", "data.num_train_prompts=16",
             "data.num_val_prompts=4", "data.target_states_dtype=float32"]
    for _ in range(2):
        cache_states(smoke("medusa", out, cache_dir, *short))
    run_medusa(smoke("medusa", out, cache_dir, *short, "data.target_states=disk"))
    assert finished_steps(out) == ["training", "validation", "save", "export"]
    record = {name: (out / name).read_bytes() for name in ("config.yaml", "target.json")}
    with pytest.raises(FileExistsError, match="holds a training run .*: overwrite=true starts afresh there") as refused:
        cache_states(smoke("medusa", out, cache_dir, *short, "model.tiny.hidden_size=32"))
    assert "resume=true" not in str(refused.value)
    assert {name: (out / name).read_bytes() for name in record} == record
