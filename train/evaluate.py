"""Speculative evaluation of a finished run's drafter (the same evaluator the training run ends with).

    python train/evaluate.py runs/medusa
    python train/evaluate.py run_dir=runs/medusa weights=export/vllm eval.temperatures=[0,0.7]
    python train/evaluate.py run_dir=runs/medusa 'eval.peers=[medusa_tree]' tree.choices='[[0],[0,0],[1]]'
    python train/evaluate.py runs/dflash eval.temperatures=[0.7] dflash.denoise_steps=8
    python train/evaluate.py runs/medusa backend=vllm vllm_venv=/opt/vllm     # measured in vLLM, target not loaded
    python train/evaluate.py runs/medusa \
        'eval.sets=[{name: gsm8k, source: hub, path: openai/gsm8k, subset: main, split: test, num_prompts: 50}]'

``run_dir`` (or the first argument) is the run; ``weights`` an export folder to measure instead of the run's
own (``export/vllm``, ``export/tgi``: read back by their strict loaders; a DFlash run is measured from
``export/dflash`` by default). Other ``key=value`` pairs override the run's saved config. Updates the run's
``report.json`` and plot: the sets measured replace those of the same name (each says which ``drafter`` it
measured), others are kept, and ``evaluations`` records every invocation (overrides, eval config, hardware).
"""

from __future__ import annotations

import sys

from draftheads.jobs.evaluate import cli

if __name__ == "__main__":
    cli(sys.argv[1:], __doc__)
