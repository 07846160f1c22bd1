"""Write the target's states for a training job's rows to disk once; training then reads them
(``data.target_states=disk``) instead of running the target at the start of every run.

    accelerate launch train/cache_hidden_states.py                          # the Medusa job's rows (last hidden states)
    accelerate launch train/cache_hidden_states.py --config-name dflash     # DFlash: outputs of its K target layers
    accelerate launch --multi_gpu --num_processes 8 train/cache_hidden_states.py data=ultrachat \
        data.target_states_dir=/scratch/hs data.target_states_dtype=bfloat16
    accelerate launch train/medusa.py data=ultrachat data.target_states=disk data.target_states_dir=/scratch/hs
    python train/cache_hidden_states.py target_backend=vllm vllm.tensor_parallel_size=8   # vLLM runs the target
    accelerate launch train/cache_hidden_states.py data.target_states_dtype=float8_e4m3fn   # fp8: half of bf16's disk

Takes the training job's own config, so the rows are exactly the ones it trains on. Each rank writes its share
of the shards; the estimated size is printed first. A killed run is resumed by running it again: complete
shards are kept (checked by checksum), partial ones rewritten. At the end it prints the cache's disk bytes and
the RAM per token of the states read back.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.jobs.cache import cache_states

register_configs()


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    cache_states(cfg)


if __name__ == "__main__":
    main()
