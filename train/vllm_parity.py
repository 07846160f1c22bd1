"""Our evaluator and vLLM side by side, greedy, on a run's held-out prompts: what the export does when served.

    python train/vllm_parity.py runs/medusa                 # the Medusa export (export/vllm) as vLLM serves it
    python train/vllm_parity.py runs/dflash serve=true      # the DFlash export, also through the OpenAI server
    python train/vllm_parity.py runs/medusa vllm_venv=/opt/vllm eval.max_new_tokens=64

Both sides decode the same prompt token ids greedily with the same drafter: our chain evaluator with the
export read back by its strict loader, and vLLM's CPU build (offline ``LLM`` API; with ``serve=true`` also
its OpenAI server queried with the openai client). Medusa in vLLM proposes top-1 chains, so it is compared with
our Medusa chain (not the tree); DFlash drafts block size - 1 tokens in one pass on both sides.

Printed per eval set: output agreement (token-identical; the server's answers as text), tau = 1 + accepted /
drafts (accepted drafts counted before the token budget cuts them, as vLLM counts), and per-position acceptance
(accepted at position i / drafts). Parity holds when every output agrees and tau differs by at most
``tolerance`` (0.02: float32 kernels differ between vLLM and PyTorch, and a flipped near-tie changes one
acceptance, ~0.004 of tau over a 250-draft set). Exits 1 when it does not.

The vLLM environment is made on first use at ``$DRAFTHEADS_CACHE/vllm-venv`` (``vllm_venv=`` to choose):
vLLM pins its own transformers, so it never shares ours; the wheels it pulls that do not import beside the CPU
torch build (torchvision, torchaudio, torchcodec) are removed.
"""

from __future__ import annotations

import sys

from draftheads.jobs.parity import cli

if __name__ == "__main__":
    cli(sys.argv[1:], __doc__)
