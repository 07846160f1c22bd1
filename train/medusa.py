"""Train Medusa heads for a target model in two stages, evaluate them speculatively, export them.

    accelerate launch train/medusa.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/medusa.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/medusa.py medusa.num_heads=3 stage2.unfreeze_last_n_layers=2 trainer.lr=1e-3
    accelerate launch --multi_gpu --num_processes 2 train/medusa.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/medusa.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows -> cached hidden states -> stage 1 (heads) -> stage 2 (heads + last N
layers, KL to the original) -> validation and drift -> speculative evaluation -> export. Rank 0 alone
validates, evaluates and exports.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.runs.life import train

register_configs()


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    train("medusa", cfg)


if __name__ == "__main__":
    main()
