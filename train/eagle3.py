"""Train an EAGLE-3 drafter for a target model, evaluate it speculatively, export it for vLLM and SGLang.

    accelerate launch train/eagle3.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/eagle3.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/eagle3.py eagle3.ttt_steps=5 eagle3.draft_vocab_size=16384 trainer.lr=1e-3
    accelerate launch --multi_gpu --num_processes 2 train/eagle3.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/eagle3.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows (the same cache as Medusa's) -> target features of 3 layers
(data.target_states: memory, disk or online)
-> draft vocabulary (the rows' most frequent trained tokens) -> training-time-test training -> held-out
validation -> export/eagle3 -> speculative evaluation beside plain decoding, peer runs and prompt lookup. Rank 0
alone validates, exports and evaluates.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.runs.life import train

register_configs()


@hydra.main(config_path="../conf", config_name="eagle3", version_base=None)
def main(cfg: DictConfig) -> None:
    train("eagle3", cfg)


if __name__ == "__main__":
    main()
