"""Re-export a finished run's drafter for inference servers, from its saved model read back strictly.

    python train/export.py runs/medusa          # export/vllm and export/tgi
    python train/export.py runs/medusa cache_dir=/scratch/cache

Medusa: ``export/vllm`` and ``export/tgi``; the TGI config points at the run's base model (the stage-2 target
export when there is one). A DFlash run's ``export/dflash`` is its saved model, written by the job: there is
nothing else to export.
"""

from __future__ import annotations

import sys

from draftheads.jobs.export import cli

if __name__ == "__main__":
    cli(sys.argv[1:], __doc__)
