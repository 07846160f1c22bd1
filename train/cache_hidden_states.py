"""Write the target's states for a training job's rows to disk once; training then reads them
(``data.hidden_states=offline``) instead of running the target at the start of every run.

    accelerate launch train/cache_hidden_states.py                              # the Medusa job's rows (last hidden states)
    accelerate launch train/cache_hidden_states.py --config-name dflash         # DFlash: outputs of its K target layers
    accelerate launch --multi_gpu --num_processes 8 train/cache_hidden_states.py data=ultrachat \
        data.hidden_states_dir=/scratch/hs data.hidden_states_dtype=bfloat16
    accelerate launch train/medusa.py data=ultrachat data.hidden_states=offline data.hidden_states_dir=/scratch/hs

Takes the training job's own config, so the rows are exactly the ones it trains on. Each rank writes its share
of the shards; the estimated size is printed first. A killed run is resumed by running it again: complete
shards are kept (checked by checksum), partial ones rewritten.
"""

from __future__ import annotations

import shutil

import hydra
from omegaconf import DictConfig, open_dict

from data.state_cache import estimated_bytes, write_cache, write_manifest
from train.config import DFlashRunConfig, register_configs
from train.dflash import target_layer_ids
from train.job import close_job, job_rows, open_job, state_cache_dir, state_cache_spec
from train.runtime import print0

register_configs()


def run(cfg: DictConfig) -> str:
    """Cache the states of ``cfg``'s rows; returns the cache folder."""
    with open_dict(cfg):
        cfg.tracker.name = "none"  # a cache build is not a training run
    job = open_job(cfg, stages=())
    conf, accelerator, target = job.conf, job.accelerator, job.target
    layer_ids = target_layer_ids(conf, target) if isinstance(conf, DFlashRunConfig) else None
    train_rows, val_rows, _ = job_rows(job, attach=False)
    rows = train_rows + val_rows
    spec = state_cache_spec(job, rows, layer_ids)
    folder = state_cache_dir(conf)
    width = target.config.hidden_size * (len(layer_ids) if layer_ids else 1)
    size = estimated_bytes(rows, width, spec.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    print0(accelerator, f"caching {'layers ' + str(layer_ids) if layer_ids else 'last hidden states'} of {len(rows)} "
                        f"rows in {spec.dtype}: {size / 2**30:.2f} GiB estimated ({size / max(len(rows), 1) / 2**20:.1f} "
                        f"MiB per row), {free / 2**30:.1f} GiB free at {folder}")
    if size > free:
        raise OSError(28, f"the cache needs ~{size / 2**30:.1f} GiB, {folder} has {free / 2**30:.1f} GiB free")
    written = write_cache(target, rows, folder, spec, conf.data.cache_shard_rows, conf.trainer.hidden_states_batch_size,
                          job.tokenizer.pad_token_id, accelerator.process_index, accelerator.num_processes,
                          accelerator.is_main_process)
    print(f"[rank {accelerator.process_index}] wrote {len(written)} shards", flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"manifest: {write_manifest(folder, spec, len(rows), conf.data.cache_shard_rows)}", flush=True)
    close_job(job, {})
    return str(folder)


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
