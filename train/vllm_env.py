"""Make vLLM's CPU build in its own virtual environment (it pins its own transformers, so it never shares
ours); ``train/vllm_parity.py`` makes it on first use, this makes it ahead of time.

    python train/vllm_env.py .vllm-venv
    python train/vllm_env.py              # $DRAFTHEADS_CACHE/vllm-venv, where the jobs look when none is named

CI makes it before draftheads is installed, with the standard-library-only module itself:
``python3 draftheads/serving/vllm_env.py .vllm-venv``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftheads.serving.vllm_env import ensure_vllm

if __name__ == "__main__":
    print(ensure_vllm(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
