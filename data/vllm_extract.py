"""Runs inside the vLLM virtual environment (``train/vllm_env.py`` makes it): the target's hidden states for given
token-id rows, computed by vLLM itself, with its tensor, pipeline and data parallelism, through its
``extract_hidden_states`` speculative method and a KV connector that writes each request's states to a
safetensors file.

    <vllm venv>/bin/python data/vllm_extract.py job.json result.json

Imports nothing from draftheads (that environment has vLLM's pinned transformers, not ours). ``job.json``:
``target`` (a model folder), ``prompts`` (token id lists), ``layer_ids`` (vLLM's ids: id i is the *input* of
decoder layer i, the residual stream after layer i-1; id L the last layer's output before the final norm),
``out_dir``, ``dtype``, ``max_model_len`` and ``engine`` (more ``LLM`` arguments: ``tensor_parallel_size``...).
``result.json``: ``files``, one per prompt, each holding ``hidden_states`` ``[T, len(layer_ids), D]`` (layers in
ascending order, as vLLM captures them) and ``token_ids`` ``[T]``.

vLLM's own ``ExampleHiddenStatesConnector`` copies through CUDA streams into pinned memory; its subclass here,
:class:`SyncHiddenStatesConnector` (loaded through ``kv_connector_module_path``), extracts synchronously, so the
same code runs on vLLM's CPU build and on GPUs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on vLLM's CPU build (read at import)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class _Written:
    """Stands for the example connector's DtoH-copy event: the write is already done."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's ``ExampleHiddenStatesConnector`` with the finished request's states read from the hidden-state KV
    cache and written at once, on whatever device the cache lives."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        save_file({"hidden_states": states.cpu().contiguous(), "token_ids": pending.token_ids.clone()},
                  pending.filename)
        lock = self._lock_fds.pop(pending.req_id, None)
        if lock is not None:
            os.close(lock)
        self._req_copy_events[pending.req_id] = _Written()


def extract(job: dict) -> dict:
    """The job's prompts through vLLM, one token each; the files its connector wrote, in prompt order. An engine of
    one worker runs in this process (executor ``uni``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no engine or worker
    process imports vLLM again. Its connector writes a request's states in the engine step after the request
    finishes, which ``generate`` does not run: the engine steps on until every file is written."""
    engine = dict(job.get("engine", {}))
    alone = all(engine.get(k, 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"))
    if alone:
        engine.setdefault("distributed_executor_backend", "uni")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    llm = LLM(model=job["target"], dtype=job["dtype"], max_model_len=job["max_model_len"], enforce_eager=True,
              generation_config="vllm",
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": list(job["layer_ids"])}}},
              kv_transfer_config={"kv_connector": "SyncHiddenStatesConnector",
                                  "kv_connector_module_path": Path(__file__).stem, "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": job["out_dir"],
                                                                "use_synchronization_lock": False}},
              **engine)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], SamplingParams(max_tokens=1))
    files = [o.kv_transfer_params["hidden_states_path"] for o in outs]
    for _ in range(4):
        if not alone or all(os.path.exists(f) for f in files):
            break
        llm.llm_engine.step()
    return {"files": files}


if __name__ == "__main__":  # run with this folder on PYTHONPATH: vLLM's processes import the connector from it
    Path(sys.argv[2]).write_text(json.dumps(extract(json.loads(Path(sys.argv[1]).read_text()))))
