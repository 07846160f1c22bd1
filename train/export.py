"""Re-export a finished run's drafter for inference servers, from its saved model read back strictly.

    python train/export.py runs/medusa          # export/vllm and export/tgi
    python train/export.py runs/medusa cache_dir=/scratch/cache
    python train/export.py runs/eagle3 llamacpp=.llamacpp   # also export/llama.cpp/draft.gguf (llama.cpp built there)

Medusa: ``export/vllm`` and ``export/tgi``; the TGI config points at the run's base model (the stage-2 target
export when there is one). A DFlash run's ``export/dflash`` is its saved model, written by the job: there is
nothing else to export. With ``llamacpp=DIR``, EAGLE-3, DFlash, DFlash 2 and DSpark exports are also made the GGUF
llama-server loads (``export/llama.cpp/draft.gguf``), by llama.cpp's own converter at float32; an export with
settings llama.cpp does not read (EAGLE-3.1's ``fc_norm``, ``norm_output``) is refused, naming them.
"""

from __future__ import annotations

import sys

from draftheads.jobs.export import cli

if __name__ == "__main__":
    cli(sys.argv[1:], __doc__)
