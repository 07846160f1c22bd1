"""Answer a dataset's user turns with the target itself, turn by turn, into a JSONL file (self-distillation).

    python train/regenerate.py data=sharegpt data.path=sharegpt.json output=sharegpt_smollm2.jsonl
    python train/regenerate.py data.source=hub data.path=HuggingFaceH4/ultrachat_200k data.split=train_sft \
        data.server.base_url=http://localhost:8000/v1 data.server.model=Qwen/Qwen3-8B limit=200000
    accelerate launch train/medusa.py data.source=jsonl data.path=sharegpt_smollm2.jsonl data.regenerate=false

Every input row is accounted for: written + failed + skipped == read, printed at the end with the reasons.
A killed or partly failed run continues from ``<output>.partial`` when run again (failed rows are retried);
``<output>.key`` ties the output to its inputs, so a run with other data or settings is refused, not mixed in.
The training jobs regenerate the same way on their own (``data.regenerate=true``, cached).
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from draftheads.drafters import register_configs
from draftheads.jobs.regenerate import regenerate_data

register_configs()


@hydra.main(config_path="../conf", config_name="regenerate", version_base=None)
def main(cfg: DictConfig) -> None:
    regenerate_data(cfg)


if __name__ == "__main__":
    main()
