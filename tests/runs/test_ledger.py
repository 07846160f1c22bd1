"""The resume ledger (``progress.json``) is the only thing read back for which steps a run finished: a run whose
``report.json`` is deleted or edited after it finished still counts as finished, and one whose ledger says a step
did not finish is not taken as finished whatever its report says (resume, tools and peer runs, warm starts, the
output_dir claim). A run folder of an older version, without a ledger, is read by its report as before."""

import json

import pytest

from draftheads import drafters
from draftheads.run_folder import LEDGER, STEPS, check_saved, finished_steps, read_ledger, record_finished, start_ledger
from draftheads.runs import life
from draftheads.runs.output_dir import RUN_ENTRIES, claim_output_dir, run_marks
from draftheads.runs.saved import check_finished
from tests.helpers import smoke

ALL = list(STEPS)
"""Every step a run can finish (a superset of what the smoke config asks for)."""


def folder(tmp_path, ledger: list[str] | None, report: dict | None):
    """A run folder with the ledger listing ``ledger`` and ``report.json`` holding ``report`` (None: no such file)."""
    out = tmp_path / "run"
    out.mkdir(parents=True)
    if ledger is not None:
        start_ledger(out, "medusa")
        record_finished(out, "medusa", ledger)
    if report is not None:
        (out / "report.json").write_text(json.dumps(report))
    return out


def test_the_ledger_is_written_whole_and_keeps_when_the_run_started(tmp_path):
    out = tmp_path / "run"
    start_ledger(out, "dflash")
    started = read_ledger(out)["started"]
    record_finished(out, "dflash", ["training", "validation"])
    assert read_ledger(out) == {"drafter": "dflash", "started": started, "finished": ["training", "validation"]}
    assert {p.name for p in out.iterdir()} == {LEDGER} and LEDGER in RUN_ENTRIES


def test_a_new_run_removes_a_report_a_failed_start_left(tmp_path):
    """A start that failed (a preflight's refusal) leaves its report to the corrected rerun's folder; the rerun's
    ledger takes it away, so no report speaks for the new run before it writes its own."""
    out = folder(tmp_path, [], {"drafter": "medusa", "preflight": {"passed": False}})
    start_ledger(out, "medusa")
    assert {p.name for p in out.iterdir()} == {LEDGER}


@pytest.mark.parametrize("report", [None, {"drafter": "medusa", "finished": []}, {"edited": True}])
def test_a_finished_run_whose_report_is_deleted_or_edited_still_counts_as_finished(report, tmp_path):
    out = folder(tmp_path, ALL, report)
    check_finished(out, drafters.get("medusa").spec)
    check_saved(out, "medusa.init_from", "resume it")
    assert run_marks(out) and finished_steps(out) == ALL
    with pytest.raises(FileExistsError, match="holds a training run"):
        claim_output_dir(out, overwrite=False, delete=True)


def test_a_run_whose_ledger_says_unfinished_is_not_finished_whatever_its_report_says(tmp_path):
    out = folder(tmp_path, ["training", "validation"], {"drafter": "medusa", "finished": ALL})
    with pytest.raises(FileNotFoundError, match=r"progress.json: the run has not finished its save"):
        check_finished(out, drafters.get("medusa").spec)
    with pytest.raises(FileNotFoundError, match="has not finished its save"):
        check_saved(out, "medusa.init_from", "resume it")
    started = folder(tmp_path / "b", [], {"drafter": "medusa", "finished": ALL})  # failed before training
    assert run_marks(started) == []
    claim_output_dir(started, overwrite=False, delete=True)


@pytest.mark.parametrize("report, finished", [({"finished": ["training", "validation", "save"]}, True),
                                              ({"finished": []}, False), ({}, True), (None, False)])
def test_a_folder_of_an_older_version_without_a_ledger_is_read_by_its_report(report, finished, tmp_path):
    """An older version kept the steps in ``report.json`` (one without ``finished`` wrote it after the save)."""
    out = folder(tmp_path, None, report)
    if finished:
        check_finished(out, drafters.get("medusa").spec)
    else:
        with pytest.raises(FileNotFoundError):
            check_finished(out, drafters.get("medusa").spec)
    assert bool(run_marks(out)) == (report is not None and report != {"finished": []})


@pytest.mark.parametrize("ledger, report, resumes", [(ALL, None, False), (ALL, {"edited": True}, False),
                                                     (["training", "validation", "save"], {"finished": ALL}, True)])
def test_resume_decides_by_the_ledger_not_the_report(ledger, report, resumes, tmp_path, cache_dir, monkeypatch,
                                                     capsys):
    """``resume=true``: nothing to resume when the ledger lists every step, even with the report deleted or
    edited; the job goes on (to its rows, stopped here) when the ledger lacks a step, whatever the report says."""
    out = folder(tmp_path, ledger, report)

    def rows(*args, **kwargs):
        raise RuntimeError("rows built: the job resumed")
    monkeypatch.setattr(life, "job_rows", rows)
    cfg = smoke("medusa", out, cache_dir, "resume=true")
    if resumes:
        with pytest.raises(RuntimeError, match="the job resumed"):
            life.train("medusa", cfg)
    else:
        assert life.train("medusa", cfg) == (report or {})
        assert "nothing to resume" in capsys.readouterr().out
    assert read_ledger(out)["finished"] == ledger


@pytest.mark.parametrize("damage", [b'{"drafter": "medusa", "finished": ["trai', b"\xff\xfe\x00", b"[1, 2]"])
def test_a_damaged_ledger_is_named_with_what_to_do_not_a_raw_json_error(tmp_path, damage):
    """Issue 52 row 8: a damaged progress.json gave a raw JSONDecodeError naming no file (resume reads it through
    finished_steps; export, evaluation and peer runs through check_saved)."""
    out = folder(tmp_path, ALL, None)
    (out / LEDGER).write_bytes(damage)
    for read in (finished_steps, lambda o: check_saved(o, "the run", "resume")):
        with pytest.raises(ValueError, match=rf"{out / LEDGER}: the run's ledger is .* overwrite=true") as error:
            read(out)
        assert not isinstance(error.value, json.JSONDecodeError)
