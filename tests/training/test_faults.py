"""Faults a long run meets: a non-finite loss, a full disk or unwritable run directory, a damaged checkpoint
(resumed from the one before it), a resume on another batch plan (refused), and a SIGKILL in the middle of
training (resumed to the same weights as a run never killed)."""

import json
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch import nn

from draftheads.run_folder import finished_steps
from draftheads.runs.output_dir import check_writable
from draftheads.training.checkpoint import complete_checkpoints, latest_checkpoint
from draftheads.training.config import StageConfig, TrainerConfig
from draftheads.training.spine import fit
from tests.helpers import ROOT, SMOKE_STAGES, cut_back, launch_cmd, launch_env, run_medusa, smoke


class ToyStrategy:
    """Regression of a token's id on a linear layer; the loss is NaN on batches holding row ``poison``."""
    name, required_fields, unpacks = "toy", ("input_ids",), False

    def __init__(self, poison: int | None):
        torch.manual_seed(0)
        self.module, self.poison = nn.Linear(1, 1), poison

    def param_groups(self, lr):
        return [{"params": list(self.module.parameters()), "lr": lr}]

    def forward_loss(self, module, batch):
        x = batch["input_ids"][:, :1].float()
        loss = (module(x) - x).pow(2).mean()
        if self.poison is not None and (batch["input_ids"][:, 1] == self.poison).any():
            loss = loss * float("nan")
        return loss, {}


def toy_rows(n: int = 16) -> list[dict]:
    return [{"input_ids": torch.tensor([i % 5, i]), "loss_mask": torch.ones(2, dtype=torch.bool), "source": "toy",
             "row": i} for i in range(n)]


def toy_fit(tmp_path, poison, nonfinite="stop", rows=None, resume_from=None, **trainer):
    sizes = {"batch_size": 4, "tokens_per_batch": None, **trainer}
    trainer = TrainerConfig(checkpoint_every=2, log_every=1, nonfinite=nonfinite, **sizes)
    strategy = ToyStrategy(poison)
    state = fit(Accelerator(cpu=True), strategy, rows or toy_rows(), trainer, StageConfig(epochs=2), str(tmp_path),
                0, {"model": {}}, resume_from)
    return strategy, state


def test_a_non_finite_loss_stops_the_run_naming_step_batch_and_rows(tmp_path):
    with pytest.raises(FloatingPointError, match=r"\[toy\] non-finite loss at optimizer step \d+ \(epoch 0, batch "
                                                 r"\d+, micro-batch \d+\).*\('toy', 7\).*trainer.nonfinite=skip"):
        toy_fit(tmp_path, poison=7)


def test_skipping_non_finite_batches_counts_them_and_keeps_the_weights_finite(tmp_path):
    strategy, state = toy_fit(tmp_path, poison=7, nonfinite="skip")
    assert state.skipped_nonfinite == 2  # row 7's batch, once per epoch
    assert state.step == 8 - 2 and all(torch.isfinite(p).all() for p in strategy.module.parameters())
    assert state.history[-1]["toy/skipped_nonfinite"] == 2
    last, meta = complete_checkpoints(tmp_path)[-1]
    assert meta["step"] == state.step and meta["done"]
    with pytest.raises(ValueError, match="skip needs trainer.grad_accum 1"):
        toy_fit(tmp_path / "accum", poison=7, nonfinite="skip", grad_accum=2)


def test_a_stage_whose_every_batch_is_skipped_is_an_error_not_a_silent_success(tmp_path):
    class AlwaysNaN(ToyStrategy):
        def forward_loss(self, module, batch):
            loss, metrics = super().forward_loss(module, batch)
            return loss * float("nan"), metrics

    trainer = TrainerConfig(batch_size=4, tokens_per_batch=None, checkpoint_every=2, log_every=1, nonfinite="skip")
    with pytest.raises(FloatingPointError, match=r"\[toy\] all 8 micro-batches had a non-finite loss"):
        fit(Accelerator(cpu=True), AlwaysNaN(None), toy_rows(), trainer, StageConfig(epochs=2), str(tmp_path), 0,
            {"model": {}})


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full, a device every write to fails on")
def test_a_full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(tmp_path, monkeypatch):
    """The second checkpoint's optimizer file is /dev/full, so torch.save itself fails as on a full disk (with a
    RuntimeError, not an OSError): the error names the checkpoint and the one kept, and no partial folder is left."""
    saves = []

    def save_state(self, path):
        saves.append(path)
        if len(saves) == 2:
            Path(path).mkdir(parents=True)
            (Path(path) / "optimizer.bin").symlink_to("/dev/full")
        return REAL_SAVE_STATE(self, path)
    monkeypatch.setattr(Accelerator, "save_state", save_state)
    with pytest.raises(OSError, match=r"cannot write checkpoint .*toy-step000004 \(.+\); the previous checkpoint "
                                      r".*toy-step000002 is intact") as failure:
        toy_fit(tmp_path, poison=None)
    assert isinstance(failure.value.__cause__, RuntimeError)  # what torch.save raised, kept
    (kept, meta), = complete_checkpoints(tmp_path)
    assert meta["step"] == 2 and kept.name == "toy-step000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["toy-step000002"]  # no partial left


REAL_SAVE_STATE = Accelerator.save_state


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, name", [(truncate, "model.safetensors"), (flip_a_byte, "optimizer.bin"),
                                          (Path.unlink, "random_states_0.pkl"), (truncate, "meta.json")])
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_the_previous_one(tmp_path, damage, name):
    toy_fit(tmp_path, poison=None)  # 8 steps; keep_last 2 keeps steps 6 and 8
    (older, _), (newest, meta) = complete_checkpoints(tmp_path)
    assert set(meta["files_sha256"]) == {p.name for p in newest.iterdir()} - {"meta.json"}
    damage(newest / name)
    with pytest.warns(UserWarning, match=rf"checkpoint {re.escape(str(newest))} is damaged: {name} .*; resuming from "
                                         rf"{re.escape(str(older))}"):
        assert latest_checkpoint(tmp_path, {}, ("toy",))[0] == older
    _, state = toy_fit(tmp_path, poison=None, resume_from=str(older))
    assert state.step == 8 and latest_checkpoint(tmp_path, {}, ("toy",))[1]["step"] == 8  # rewritten, intact


def test_resume_without_an_intact_checkpoint_is_refused_naming_them(tmp_path):
    toy_fit(tmp_path, poison=None)
    (older, _), (newest, _) = complete_checkpoints(tmp_path)
    flip_a_byte(older / "model.safetensors")
    truncate(newest / "optimizer.bin")
    with pytest.raises(ValueError, match=rf"no intact checkpoint to resume from.*{re.escape(str(newest))}: "
                                         rf"optimizer.bin .*{re.escape(str(older))}: model.safetensors .*"
                                         rf"overwrite=true"):
        latest_checkpoint(tmp_path, {}, ("toy",))


def test_checkpoints_written_without_checksums_or_plan_are_resumed_as_before(tmp_path):
    """Checkpoints of earlier versions record neither: nothing to check, nothing said."""
    toy_fit(tmp_path, poison=None)
    (older, _), (newest, _) = checkpoints = complete_checkpoints(tmp_path)
    for path, meta in checkpoints:
        old = {k: v for k, v in meta.items() if k not in ("files_sha256", "plan")}
        (path / "meta.json").write_text(json.dumps(old))
    flip_a_byte(newest / "optimizer.bin")  # undetectable without checksums
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path, {}, ("toy",))[0] == newest
    assert toy_fit(tmp_path, poison=None, resume_from=str(older), seed=1)[1].step == 8


@pytest.mark.parametrize("change, named", [
    ({"batch_size": 2}, "trainer.batch_size"), ({"tokens_per_batch": 6}, "trainer.tokens_per_batch"),
    ({"grad_accum": 2}, "trainer.grad_accum"), ({"seed": 1}, "trainer.seed"), ({"rows": 20}, "data_sha256"),
    ({"num_processes": 2}, "num_processes")])
def test_resuming_on_another_batch_plan_is_refused_naming_what_changed(tmp_path, change, named):
    """A resumed run must take the same micro-batches from the same rows, or it replays or skips rows."""
    toy_fit(tmp_path, poison=None)
    older, meta = complete_checkpoints(tmp_path)[0]
    assert toy_fit(tmp_path / "same", poison=None, resume_from=str(older))[1].step == 8  # the same plan resumes
    if "num_processes" in change:  # one process here: the checkpoint says it was written by two
        meta["plan"]["num_processes"] = 2
        (older / "meta.json").write_text(json.dumps(meta))
        change = {}
    rows = toy_rows(change.pop("rows", 16))
    with pytest.raises(ValueError, match=rf"checkpoint {re.escape(str(older))} was written on another batch plan"
                                         rf".*{named}.*overwrite=true or another output_dir"):
        toy_fit(tmp_path, poison=None, rows=rows, resume_from=str(older), **change)


def test_an_unwritable_output_dir_fails_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=f"output_dir={blocker / 'run'} is not a writable directory"):
        check_writable(blocker / "run")


@pytest.mark.slow
def test_a_job_resumes_before_a_damaged_checkpoint_and_refuses_another_seed(tmp_path, cache_dir):
    """The smoke Medusa job (stage 1 only) cut back to two checkpoints, the newer truncated: resumed, it warns and
    continues from the older one to the end; resumed with another ``trainer.seed``, it is refused."""
    overrides = (*SMOKE_STAGES, "stage2.enabled=false", "eval.enabled=false", "export=false")
    out = tmp_path / "run"
    run_medusa(smoke("medusa", out, cache_dir, *overrides, "trainer.keep_last=100"))
    cut = cut_back(out, "stage1-step000010", cut_back(out, "stage1-step000005", tmp_path / "cut"))
    truncate(cut / "checkpoints" / "stage1-step000010" / "model.safetensors")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="another batch plan.*trainer.seed"):
        run_medusa(smoke("medusa", cut, cache_dir, *overrides, "resume=true", "trainer.seed=1"))
    with pytest.warns(UserWarning, match="stage1-step000010 is damaged: model.safetensors"):
        report = run_medusa(smoke("medusa", cut, cache_dir, *overrides, "resume=true"))
    assert report["resumed_from"].endswith("stage1-step000005") and finished_steps(cut)[0] == "training"


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tmp_path, cache_dir, optimizer):
    """The smoke Medusa job (stage 1 only) is killed with SIGKILL right after its second checkpoint and resumed:
    its heads equal, bit for bit, those of the same job never interrupted, with either ``trainer.optimizer``."""
    args = ["+experiment=smoke", *SMOKE_STAGES, "stage2.enabled=false", "eval.enabled=false", "export=false",
            "trainer.checkpoint_every=3", f"trainer.optimizer={optimizer}", f"cache_dir={cache_dir}"]
    env = launch_env(cache_dir)

    def launch(out: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(ROOT / "train" / "medusa.py"), *args, f"output_dir={out}",
                                 *extra], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    killed = tmp_path / "killed"
    proc = launch(killed)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "stage1-step000006" / "meta.json").exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    steps = [meta["step"] for _, meta in complete_checkpoints(killed)]
    assert steps and max(steps) < 24, steps  # killed mid-stage (24 steps in all)
    saved = torch.load(complete_checkpoints(killed)[-1][0] / "optimizer.bin", weights_only=True)
    assert ("muon" in saved) == (optimizer == "muon")  # the state resumed is the optimizer's named
    for out, extra in ((killed, ("resume=true",)), (tmp_path / "whole", ())):
        proc = launch(out, *extra)
        assert proc.wait(timeout=600) == 0, proc.stderr.read()[-2000:]
    report = json.loads((killed / "report.json").read_text())
    assert "stage1-step" in report["resumed_from"]  # the resumed run did not start over
    whole = json.loads((tmp_path / "whole" / "report.json").read_text())
    assert [x["step"] for x in report["train_curves"]["stage1"]] == [x["step"] for x in whole["train_curves"]["stage1"]]
    a = load_file(str(killed / "medusa_heads" / "medusa_heads.safetensors"))
    b = load_file(str(tmp_path / "whole" / "medusa_heads" / "medusa_heads.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_rank_that_dies_ends_every_rank_promptly(tmp_path, cache_dir):
    """One of two DDP ranks is killed mid-training: the launcher and the other rank end within a minute with
    an error, instead of the survivor waiting in a collective until the timeout."""
    import psutil
    out = tmp_path / "ddp"
    cmd = launch_cmd("medusa", ["--multi_gpu", "--num_processes", "2"], "+experiment=smoke", *SMOKE_STAGES,
                     "stage1.epochs=200", "trainer.checkpoint_every=2", f"output_dir={out}")
    launcher = subprocess.Popen(cmd, env=launch_env(cache_dir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    deadline = time.time() + 300
    while not list(out.glob("checkpoints/stage1-*/meta.json")):  # training is under way on both ranks
        assert launcher.poll() is None, launcher.stderr.read()[-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "medusa.py" in " ".join(p.cmdline())]
    assert len(workers) == 2
    workers[1].kill()
    start = time.time()
    code = launcher.wait(timeout=120)
    assert code != 0 and time.time() - start < 60
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
