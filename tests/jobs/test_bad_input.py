"""Bad input never costs a run: what cannot be trained is skipped and counted, or refused before training,
with the row and the reason named."""

import json

import pytest

from draftheads.jobs.cli import parse_args
from draftheads.run_folder import finished_steps
from tests.helpers import run_dflash, run_medusa, smoke

pytestmark = pytest.mark.slow  # training jobs on bad data


def tokenized(path, rows: list[tuple[int, int]]):
    """A JSONL file of pre-tokenised rows, each ``(length, trainable tokens at its end)``."""
    lines = [json.dumps({"input_ids": [(7 * i + 3 * t) % 500 + 4 for t in range(n)],
                         "loss_mask": [0] * (n - k) + [1] * k}) for i, (n, k) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n")
    return ["data.source=jsonl", f"data.path={path}", "data.regenerate=false",
            f"data.num_train_prompts={len(rows) - 1}", "data.num_val_prompts=1", "eval.enabled=false"]


def test_a_validation_share_emptied_by_skipped_rows_fails_before_training(tmp_path, cache_dir):
    data = tokenized(tmp_path / "rows.jsonl", [(30, 20)] * 10 + [(30, 0)])  # the held-out row trains nothing
    with pytest.raises(ValueError, match=r"no validation row left after skipping bad ones .*no_trainable_token 1"):
        run_medusa(smoke("medusa", tmp_path / "run", cache_dir, *data))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_that_failed_on_bad_data_does_not_block_the_corrected_rerun(tmp_path, cache_dir):
    """The failed run trained nothing: its output_dir holds no run, so the rerun needs no overwrite=true."""
    out, short = tmp_path / "run", ["stage1.epochs=1", "stage2.enabled=false"]
    bad = tokenized(tmp_path / "bad.jsonl", [(30, 20)] * 10 + [(30, 0)])  # the held-out row trains nothing
    with pytest.raises(ValueError, match="no validation row left"):
        run_medusa(smoke("medusa", out, cache_dir, *bad, *short))
    good = tokenized(tmp_path / "good.jsonl", [(30, 20)] * 11)
    report = run_medusa(smoke("medusa", out, cache_dir, *good, *short))
    assert finished_steps(out) == ["training", "validation", "save", "export"] and report["data"]["rows_out"] == 11


def test_rows_a_dflash_block_cannot_train_on_are_skipped_and_counted(tmp_path, cache_dir):
    """Rows with a single trainable token (an empty answer's end of turn) give a DFlash block no target: they
    are counted, not trained on, and never fill a batch on their own."""
    data = tokenized(tmp_path / "rows.jsonl", [(24, 1)] * 8 + [(30, 20)] * 16 + [(30, 20)])
    report = run_dflash(smoke("dflash", tmp_path / "run", cache_dir, *data, "train.epochs=1", "dflash.block_size=8",
                              "eval.peer_runs=[]"))
    assert report["data"]["skipped"] == {"unusable_row": 8} and report["data"]["rows_out"] == 17
    assert "no two consecutive trainable tokens" in report["data"]["examples"]["unusable_row"]
    assert finished_steps(tmp_path / "run") == ["training", "validation", "save", "export"]


def test_a_block_size_without_a_known_position_decay_fails_before_the_data(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="set dflash.position_decay"):
        run_dflash(smoke("dflash", tmp_path / "run", cache_dir, "dflash.block_size=5", "data.num_train_prompts=999999"))
    assert not (tmp_path / "run" / "report.json").exists()


def test_help_prints_the_usage_instead_of_reading_a_run_named_help(capsys):
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as exit_:
            parse_args([flag], ("weights",), "usage text")
        assert exit_.value.code == 0 and "usage text" in capsys.readouterr().out
