"""Write the target's states for a training job's rows to disk once (the offline state cache); training then
reads them (``data.hidden_states=offline``). Which states: what the run's drafter trains on (the registry says)."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import DictConfig, open_dict

from draftheads import drafters
from draftheads.data.state_cache import estimated_bytes, write_cache, write_manifest
from draftheads.training.job import close_job, job_rows, open_job, state_cache_dir, state_cache_spec
from draftheads.training.runtime import print0


def cache_states(cfg: DictConfig) -> Path:
    """Cache the states of ``cfg``'s rows (each rank its share of the shards; the estimated size is printed
    first, and a cache larger than the free disk is refused before any work); returns the cache folder.
    Raises ``OSError`` (28) when the disk cannot hold it."""
    with open_dict(cfg):
        cfg.tracker.name = "none"  # a cache build is not a training run
    if cfg.model.get("partial"):
        raise ValueError("model.partial=true: the state cache is made by the whole target's forward (set "
                         "model.partial=false for train/cache_hidden_states.py; training may then read it partially)")
    job = open_job(cfg)
    conf, accelerator, target = job.conf, job.accelerator, job.target
    recipe = drafters.get(conf.drafter)
    layer_ids = recipe.state_layers(conf, target)
    train_rows, val_rows, _ = job_rows(job, attach=False, unusable=recipe.unusable)  # the rows training reads
    rows = train_rows + val_rows
    spec = state_cache_spec(job, rows, layer_ids)
    folder = state_cache_dir(conf)
    width = target.config.hidden_size * (len(layer_ids) if layer_ids else 1)
    size = estimated_bytes(rows, width, spec.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    print0(accelerator, f"caching {'layers ' + str(list(layer_ids)) if layer_ids else 'last hidden states'} of "
                        f"{len(rows)} rows in {spec.dtype}: {size / 2**30:.2f} GiB estimated "
                        f"({size / max(len(rows), 1) / 2**20:.1f} MiB per row), {free / 2**30:.1f} GiB free at {folder}")
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
    return folder
