"""Train a DFlash block-diffusion drafter for a target model, evaluate it speculatively, export it.

    accelerate launch train/dflash.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/dflash.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/dflash.py dflash.block_size=8 dflash.num_layers=3 trainer.lr=1e-3
    accelerate launch --multi_gpu --num_processes 2 train/dflash.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/dflash.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows (the same cache as Medusa's) -> target features of K layers
(data.target_states: memory, disk or online) ->
training (random blocks per sequence, one pass each) -> held-out validation -> export/dflash -> speculative
evaluation beside plain decoding, iterative denoising, a Medusa run's heads and prompt lookup. Rank 0 alone
validates, exports and evaluates.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.runs.life import train

register_configs()


@hydra.main(config_path="../conf", config_name="dflash", version_base=None)
def main(cfg: DictConfig) -> None:
    train("dflash", cfg)


if __name__ == "__main__":
    main()
