"""Faults a long run meets: a non-finite loss, a full disk or unwritable run directory, and a SIGKILL in the
middle of training (resumed to the same weights as a run never killed)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file
from torch import nn

from draftheads.training.checkpoint import complete_checkpoints
from draftheads.training.config import StageConfig, TrainerConfig
from draftheads.training.job import check_writable
from draftheads.training.spine import fit
from tests.helpers import ROOT, SMOKE_STAGES



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


def toy_fit(tmp_path, poison, nonfinite="stop", **trainer):
    trainer = TrainerConfig(batch_size=4, tokens_per_batch=None, checkpoint_every=2, log_every=1, nonfinite=nonfinite,
                            **trainer)
    strategy = ToyStrategy(poison)
    state = fit(Accelerator(cpu=True), strategy, toy_rows(), trainer, StageConfig(epochs=2), str(tmp_path), 0,
                {"model": {}})
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


def test_a_full_disk_fails_the_checkpoint_clearly_and_keeps_the_previous_one(tmp_path, monkeypatch):
    writes = []

    def save_state(self, path):
        if writes:
            Path(path).mkdir(parents=True)
            (Path(path) / "half.bin").write_bytes(b"x")
            raise OSError(28, "No space left on device")
        writes.append(path)
        return REAL_SAVE_STATE(self, path)
    monkeypatch.setattr(Accelerator, "save_state", save_state)
    with pytest.raises(OSError, match=r"cannot write checkpoint .*toy-step000004 \(No space left on device\); the "
                                      r"previous checkpoint .*toy-step000002 is intact"):
        toy_fit(tmp_path, poison=None)
    (kept, meta), = complete_checkpoints(tmp_path)
    assert meta["step"] == 2 and kept.name == "toy-step000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["toy-step000002"]  # no partial left


REAL_SAVE_STATE = Accelerator.save_state


def test_an_unwritable_output_dir_fails_before_any_work(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=f"output_dir={blocker / 'run'} is not a writable directory"):
        check_writable(blocker / "run")


def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(tmp_path, cache_dir):
    """The smoke Medusa job (stage 1 only) is killed with SIGKILL right after its second checkpoint and resumed:
    its heads equal, bit for bit, those of the same job never interrupted."""
    args = ["+experiment=smoke", *SMOKE_STAGES, "stage2.enabled=false", "eval.enabled=false", "export=false",
            "trainer.checkpoint_every=3", f"cache_dir={cache_dir}"]
    env = {**os.environ, "DRAFTHEADS_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}

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


def test_a_rank_that_dies_ends_every_rank_promptly(tmp_path, cache_dir):
    """One of two DDP ranks is killed mid-training: the launcher and the other rank end within a minute with
    an error, instead of the survivor waiting in a collective until the timeout."""
    import psutil
    env = {**os.environ, "DRAFTHEADS_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "train" / "medusa.py"),
           "+experiment=smoke", *SMOKE_STAGES, "stage1.epochs=200", "trainer.checkpoint_every=2", f"output_dir={out}"]
    launcher = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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
