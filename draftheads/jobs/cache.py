"""Write the target's states for a training job's rows to disk once (the state cache); training then
reads them (``data.target_states=disk``). Which states: what the run's drafter trains on (the registry says)."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import DictConfig, open_dict

from draftheads import drafters
from draftheads.data.state_cache import (
    bytes_per_token,
    estimated_bytes,
    footprint,
    forward_states,
    pending_shards,
    shard_indices,
    source_dtype,
    write_cache,
    write_manifest,
)
from draftheads.data.vllm_states import vllm_states
from draftheads.runs.life import close_job, open_job
from draftheads.runs.output_dir import release
from draftheads.runs.rows import job_rows, state_cache_dir, state_cache_spec
from draftheads.serving.vllm_env import ensure_vllm
from draftheads.training.config import TargetBackend
from draftheads.training.runtime import print0


def cache_states(cfg: DictConfig) -> Path:
    """Cache the states of ``cfg``'s rows (each rank its share of the shards; the estimated size is printed
    first, and a cache larger than the free disk is refused before any work; at the end the main process
    prints the disk bytes and the RAM per token, :func:`~draftheads.data.state_cache.footprint`); returns the
    cache folder.
    With ``target_backend=vllm`` vLLM computes them (one process: vLLM brings its own parallelism) and this
    job holds only the target's ends (``model.partial``).

    Its output_dir is claimed as a training job's is (:func:`~draftheads.runs.output_dir.claim_output_dir`): one
    holding no run (nothing, or a state cache build) is taken, and the training job may then run there reading
    the cache; one holding a training run is refused, whose ``config.yaml`` and ``target.json`` this job would
    replace (``overwrite=true`` deletes that run but the cache).

    Raises ``OSError`` (28) when the disk cannot hold it; ``ValueError`` for ``model.partial`` with the
    in-process target, or ``target_backend=vllm`` under several processes; ``FileExistsError`` for an output_dir
    holding a training run."""
    vllm = cfg.get("target_backend") == TargetBackend.vllm.value
    with open_dict(cfg):
        cfg.tracker.name = "none"  # a cache build is not a training run
        if vllm:
            cfg.model.partial = True  # vLLM holds the target; this job its final norm and fingerprint
    if cfg.model.get("partial") and not vllm:
        raise ValueError("model.partial=true: the state cache is made by the whole target's forward (set "
                         "model.partial=false for train/cache_hidden_states.py, or target_backend=vllm; training "
                         "may then read it partially)")
    job = open_job(cfg)
    try:
        return write_states(job, vllm)
    finally:
        release(job.lock)  # the output_dir's lock, held since the job opened


def write_states(job, vllm: bool) -> Path:
    """The body of :func:`cache_states` on an open job: the rows, the states (in process or by vLLM), the shards
    and the manifest; returns the cache folder."""
    conf, accelerator, target = job.conf, job.accelerator, job.target
    if vllm and accelerator.num_processes > 1:
        raise ValueError("target_backend=vllm runs the target with vLLM's own parallelism: launch one process and set "
                         "vllm.tensor_parallel_size / pipeline_parallel_size / data_parallel_size")
    recipe = drafters.get(conf.drafter)
    layer_ids = recipe.state_layers(conf, target)
    train_rows, val_rows, _ = job_rows(job, attach=False, unusable=recipe.unusable, trains=False)  # what training reads
    rows = train_rows + val_rows
    spec = state_cache_spec(job, rows, layer_ids)
    folder = state_cache_dir(conf)
    width = target.config.hidden_size * (len(layer_ids) if layer_ids else 1)
    size = estimated_bytes(rows, width, spec.dtype)
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    print0(accelerator, f"caching {'layers ' + str(list(layer_ids)) if layer_ids else 'last hidden states'} of "
                        f"{len(rows)} rows in {spec.dtype} ({conf.target_backend}): {size / 2**30:.2f} GiB estimated "
                        f"({size / max(len(rows), 1) / 2**20:.1f} MiB per row, {bytes_per_token(width, spec.dtype)} "
                        f"bytes per token), {free / 2**30:.1f} GiB free at {folder}")
    needed = size * (2 if vllm else 1)  # vLLM's per-request files stay beside the shards until they are written
    if needed > free:
        raise OSError(28, f"the cache needs ~{needed / 2**30:.1f} GiB, {folder} has {free / 2**30:.1f} GiB free")
    shard_rows = conf.data.cache_shard_rows
    if vllm:
        pending = [rows[i] for k in pending_shards(folder, len(rows), shard_rows)
                   for i in shard_indices(k, len(rows), shard_rows)]
        python = ensure_vllm(conf.vllm.venv)
        work = folder / "vllm-extracted"
        states = vllm_states(python, target, job.target_path, pending, layer_ids, work,
                             max(len(r["input_ids"]) for r in rows) + 1, conf.vllm.engine()) if pending else None
    else:
        states = forward_states(target, layer_ids, conf.data.target_batch_size, job.tokenizer.pad_token_id,
                                source_dtype(spec.dtype, target.dtype))
    written = write_cache(states, rows, folder, spec, shard_rows, accelerator.process_index, accelerator.num_processes,
                          accelerator.is_main_process)
    print(f"[rank {accelerator.process_index}] wrote {len(written)} shards", flush=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(f"manifest: {write_manifest(folder, spec, len(rows), shard_rows)}", flush=True)
        cost = footprint(folder, rows, width, target.dtype)
        print(f"state cache: {cost['tokens']} tokens, {cost['disk_bytes'] / 2**20:.1f} MiB on disk in {cost['dtype']} "
              f"({cost['disk_bytes_per_token']:.0f} bytes per token); read back in "
              f"{str(target.dtype).removeprefix('torch.')}: "
              f"{cost['ram_bytes_per_token']} bytes per token in RAM", flush=True)
        if vllm:
            shutil.rmtree(folder / "vllm-extracted", ignore_errors=True)
    close_job(job, {})
    return folder
