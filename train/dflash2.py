"""Train a DFlash 2 drafter (DFlash with grouped dynamic convolutions and a candidate selector) for a target model,
evaluate it speculatively, export it for vLLM.

    accelerate launch train/dflash2.py                                 # SmolLM2-135M-Instruct, from runs/dflash
    accelerate launch train/dflash2.py +experiment=smoke               # tiny random Llama, < 1 minute
    accelerate launch train/dflash2.py dflash2.init_from=null train.epochs=10   # from random weights
    accelerate launch --multi_gpu --num_processes 2 train/dflash2.py   # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/dflash2.py resume=true                     # continue an interrupted run

Flow: target -> self-distilled rows (the same cache as Medusa's) -> target features of K layers
(data.target_states: memory, disk or online) -> training (random blocks per sequence, one pass each; the unary
objective and the selector's K-way cross-entropy, teacher-forced) -> held-out validation -> export/dflash2 ->
speculative evaluation (the selector's walk, as vLLM drafts) beside plain decoding, the DFlash and DSpark runs and
prompt lookup. Rank 0 alone validates, exports and evaluates.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.runs.life import train

register_configs()


@hydra.main(config_path="../conf", config_name="dflash2", version_base=None)
def main(cfg: DictConfig) -> None:
    train("dflash2", cfg)


if __name__ == "__main__":
    main()
