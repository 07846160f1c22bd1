"""Train a DSpark drafter (a DFlash drafter with a Markov head and a confidence head) for a target model,
evaluate it speculatively, export it for vLLM.

    accelerate launch train/dspark.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/dspark.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/dspark.py dspark.block_size=8 dspark.num_layers=3 dspark.markov_rank=128
    accelerate launch --multi_gpu --num_processes 2 train/dspark.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/dspark.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows (the same cache as Medusa's) -> target features of K layers and the last
(data.target_states: memory, disk or online) -> training (random blocks per sequence, one pass each; Markov bias
teacher-forced; confidence head against each position's acceptance probability) -> held-out validation ->
export/dspark -> speculative evaluation beside plain decoding, the DFlash and Medusa runs and prompt lookup. Rank
0 alone validates, exports and evaluates.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.runs.life import train

register_configs()


@hydra.main(config_path="../conf", config_name="dspark", version_base=None)
def main(cfg: DictConfig) -> None:
    train("dspark", cfg)


if __name__ == "__main__":
    main()
