"""The target's states computed by vLLM for the offline state cache (``train/cache_hidden_states.py
target_backend=vllm``): vLLM runs the target with its own tensor, pipeline and data parallelism, so a target too
large for one trainer's GPU still gets its states; the cache is the same one the in-process target writes.

vLLM extracts states through its ``extract_hidden_states`` speculative method and a KV connector
(:mod:`draftheads.data.vllm_extract`, run in vLLM's own environment). Its layer ids are not ours: vLLM's id i is
the *input* of decoder layer i, the residual stream after layer i-1 (``vllm/model_executor/models/llama.py``:
``_maybe_add_hidden_state(aux, idx + 1, hidden_states, residual)`` after layer ``idx``), while draftheads' id i
is the *output* of decoder layer i. So ours i is vLLM's i + 1, and the last hidden state Medusa reads (after the
final norm) is vLLM's id L, before the final norm, normed here with the target's own norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

from draftheads.data.state_cache import StateSource

EXTRACTOR = Path(__file__).resolve().with_name("vllm_extract.py")


def vllm_layer_ids(layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """vLLM's ids for draftheads' ``layer_ids`` (outputs of decoder layers; None: the last hidden state)."""
    return [num_layers] if layer_ids is None else [i + 1 for i in layer_ids]


def run_in_vllm(python: Path, script: Path, job: dict) -> dict:
    """Run ``script`` (a job runner that imports nothing from draftheads) with the vLLM environment's ``python``
    on ``job`` (written as ``job.json``; our ``PYTHONPATH`` left out, the script's folder importable, as vLLM's
    connector loader needs); returns its ``result.json``. Raises ``CalledProcessError`` when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(script.parent)}
        subprocess.run([str(python), str(script), str(job_file), str(result_file)], env=env, check=True,
                       stdout=sys.stderr)
        return json.loads(result_file.read_text())


def run_extractor(python: Path, job: dict) -> dict:
    """:mod:`draftheads.data.vllm_extract` on ``job`` (its ``files``, one per prompt)."""
    return run_in_vllm(python, EXTRACTOR, job)


def vllm_states(python: Path, target, target_folder: str, rows: list[dict], layer_ids: Sequence[int] | None,
                work_dir: Path, max_model_len: int, engine: dict) -> StateSource:
    """Extract the states of every row in ``rows`` with vLLM, in one engine run, into ``work_dir``; returns the
    :class:`~draftheads.data.state_cache.StateSource` that serves them to the cache writer, in draftheads'
    layout: ``[T, D]`` after the final norm (``layer_ids`` None, normed with ``target``'s own norm, which a
    partial target holds) or ``[T, K*D]``, layers in ``layer_ids``' order. Rows are the same objects the writer
    passes back. Raises ``ValueError`` when vLLM's file for a row holds other tokens."""
    num_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    ids = vllm_layer_ids(layer_ids, num_layers)
    captured = sorted(set(ids))  # vLLM captures in ascending layer order
    dtype = str(target.dtype).removeprefix("torch.")
    result = run_extractor(python, {"target": str(target_folder), "prompts": [r["input_ids"].tolist() for r in rows],
                                    "layer_ids": captured, "out_dir": str(work_dir), "dtype": dtype,
                                    "max_model_len": max_model_len, "engine": engine})
    files = {id(r): Path(f) for r, f in zip(rows, result["files"])}
    pick = [captured.index(i) for i in ids]
    norm = target.get_decoder().norm if layer_ids is None else None

    @torch.no_grad()
    def states(batch: list[dict]) -> list[torch.Tensor]:
        out = []
        for row in batch:
            got = load_file(str(files[id(row)]))
            if not torch.equal(got["token_ids"].long(), row["input_ids"].long()):
                raise ValueError(f"{files[id(row)]}: vLLM's states are for other tokens than row {row.get('row')} "
                                 f"of {row.get('source')}")
            h = got["hidden_states"].reshape(len(row["input_ids"]), len(captured), -1)[:, pick].flatten(1)
            if norm is not None:
                h = norm(h.to(norm.weight.device, norm.weight.dtype))
            out.append(h)
        return out
    return states
