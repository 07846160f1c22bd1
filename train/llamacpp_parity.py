"""Our evaluator and llama.cpp's llama-server side by side, greedy, on a run's held-out prompts: what the export
does when llama.cpp serves it (EAGLE-3, DFlash, DFlash 2, DSpark; llama.cpp has no Medusa).

    python train/llamacpp_parity.py runs/eagle3
    python train/llamacpp_parity.py runs/dflash llamacpp=.llamacpp threads=2 eval.max_new_tokens=64
    python train/llamacpp_parity.py runs/dflash target_gguf=path/to/SmolLM2-135M-Instruct.Q4_1.gguf

The drafter's export is made a GGUF by llama.cpp's own converter (``export/llama.cpp/draft.gguf``; an export with
settings llama.cpp does not read is refused, ``force=true`` measures it anyway) and the target is served from
its GGUF: by default the run's target converted at float32, the very weights our evaluator runs
(``target_gguf=`` serves another, such as the quantized file users run). Printed per eval set:
- targets agree: the share of prompts whose greedy output llama-server without a drafter and our plain decoding
  give token for token (a quantized target agrees less: its kernels quantize activations too);
- on the prompts where they agree: identical outputs with the drafter, and tau = 1 + accepted / verification
  steps, ours counted as llama-server counts (a draft never longer than the tokens left minus one);
- tau over every prompt, and llama-server's decode tokens per second without and with the drafter (the same
  prompts and threads: ``threads=``, by default the cores this process may run on), whose ratio is the served
  speedup.
Parity holds when some prompts agree, all of them decode identically, and tau differs by at most 0.02. Exits 1
when it does not. llama.cpp is built on first use (``llamacpp=DIR``, default ``$DRAFTHEADS_CACHE/llamacpp``).
"""

from __future__ import annotations

import sys

from draftheads.jobs.llamacpp import cli

if __name__ == "__main__":
    cli(sys.argv[1:], __doc__)
