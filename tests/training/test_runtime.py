"""Threads as the user sets them (issue 56): ``accelerate launch --num_cpu_threads_per_process N`` and
``OMP_NUM_THREADS`` are kept; only when neither is given are the cores shared between the local ranks. Launched
for real: the launcher sets ``OMP_NUM_THREADS`` in every process it starts, asked or not."""

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PROBE = "from draftheads.training.runtime import cpu_threads; print('THREADS', *cpu_threads())"


def threads(tmp_path, launch_args: list[str], env: dict) -> tuple[int, str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *launch_args, str(script)]
    env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(li for li in proc.stdout.splitlines() if li.startswith("THREADS"))
    _, n, why = line.split(" ", 2)
    return int(n), why


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the launcher from /proc")
def test_threads_asked_for_are_kept_and_otherwise_the_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    assert threads(tmp_path, ["--num_cpu_threads_per_process", str(cores + 3)], {"OMP_NUM_THREADS": None}) == (
        cores + 3, "accelerate launch --num_cpu_threads_per_process")
    assert threads(tmp_path, [], {"OMP_NUM_THREADS": str(cores + 5)}) == (cores + 5, "OMP_NUM_THREADS")
    n, why = threads(tmp_path, [], {"OMP_NUM_THREADS": None})  # the launcher sets 1 in the process: not asked
    assert n == cores and "shared by 1 local rank" in why


@pytest.mark.parametrize("bf16, sharded, recorded, chosen, said", [
    (True, False, None, "muon", "runs natively"),
    (False, False, None, "adamw", "runs emulated"),  # torch's Muon orthogonalises in bf16: 10x slower emulated
    (True, True, None, "adamw", "FSDP or DeepSpeed"),
    (False, False, "muon", "muon", "the run's own"),  # a resumed run keeps its optimizer on any machine
])
def test_an_auto_optimizer_is_muon_only_where_cheap_and_allowed_and_recorded(bf16, sharded, recorded, chosen, said,
                                                                            monkeypatch):
    from omegaconf import OmegaConf

    from draftheads.models.precision import Native
    from draftheads.training import runtime
    from draftheads.training.config import Optimizer, to_schema
    from tests.helpers import smoke
    monkeypatch.setattr(runtime, "native", lambda dtype, device: Native(dtype, bf16, "this CPU"))
    cfg = smoke("eagle3", "out", "cache", "trainer.optimizer=auto")
    conf = to_schema(cfg)
    line = runtime.settle_optimizer(cfg, conf, sharded, recorded)
    assert conf.trainer.optimizer == Optimizer(chosen) and OmegaConf.select(cfg, "trainer.optimizer") == chosen
    assert line.startswith(f"optimizer: {chosen} (trainer.optimizer=auto: ") and said in line
    explicit = smoke("eagle3", "out", "cache", "trainer.optimizer=adamw")
    assert runtime.settle_optimizer(explicit, to_schema(explicit), sharded, "muon") is None


def test_a_resume_with_auto_takes_the_runs_optimizer_and_refuses_another(tmp_path):
    from omegaconf import OmegaConf

    from draftheads.run_folder import recorded
    from draftheads.runs.resume import check_resume
    from tests.helpers import smoke
    OmegaConf.save(smoke("eagle3", str(tmp_path), "cache", "trainer.optimizer=muon"), tmp_path / "config.yaml")
    check_resume(tmp_path, smoke("eagle3", str(tmp_path), "cache", "trainer.optimizer=auto", "resume=true"))
    assert recorded(tmp_path, "trainer.optimizer") == "muon"
    with pytest.raises(ValueError, match="trainer.optimizer: the run has 'muon', this command 'adamw'"):
        check_resume(tmp_path, smoke("eagle3", str(tmp_path), "cache", "trainer.optimizer=adamw", "resume=true"))


@pytest.mark.parametrize("dtype, chosen", [("bfloat16", "bf16"), ("float32", "no")])
def test_auto_precision_takes_bf16_autocast_for_a_bf16_target_where_bf16_is_emulated(monkeypatch, tmp_path, dtype,
                                                                                     chosen):
    """Where bf16 is emulated ``auto`` is float32, except beside a bfloat16 target, whose states float32 layers
    would refuse (``mat1 and mat2 must have the same dtype``): there it is bf16 autocast, and the line says why."""
    from draftheads.models.precision import Precision
    from draftheads.training import runtime
    from draftheads.training.config import to_schema
    from tests.helpers import smoke
    monkeypatch.setattr(runtime, "choose_precision", lambda requested: Precision(
        requested, "no", "precision: float32 (trainer.mixed_precision=auto: bf16 is emulated)", False))
    cfg = smoke("medusa", tmp_path, tmp_path, f"model.dtype={dtype}", "trainer.mixed_precision=auto")
    conf = to_schema(cfg)
    line = runtime.settle_precision(cfg, conf)
    assert conf.trainer.mixed_precision.value == cfg.trainer.mixed_precision == chosen
    assert ("bf16 autocast after all" in line) == (chosen == "bf16")
