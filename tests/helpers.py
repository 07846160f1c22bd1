"""Pieces several test modules share: a stub drafter base and a real 2-process launch."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class StubDrafter:
    """The ChainDrafter protocol's bookkeeping for test drafters that read only the last hidden state;
    subclasses set ``gamma`` and define ``draft_logits``."""
    name, target_layer_ids = "test", ()

    def start(self) -> None:
        pass


def launch_ddp(job: str, output_dir: Path, cache_dir, *overrides: str) -> dict:
    """``accelerate launch --multi_gpu --num_processes 2 train/<job>.py +experiment=smoke ...`` (gloo on CPU);
    asserts it succeeded and returns its report."""
    env = {**os.environ, "DRAFTHEADS_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(ROOT / "train" / f"{job}.py"), "+experiment=smoke", *overrides, f"output_dir={output_dir}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((Path(output_dir) / "report.json").read_text())
