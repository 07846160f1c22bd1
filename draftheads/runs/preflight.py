"""A training job's serving preflight (``serving.preflight``): whether it runs, and running it, before the job
computes any target state (:mod:`draftheads.serving.preflight` holds the comparison; docs/serving.md,
"Preflight"); and the vLLM environment every vLLM tool runs in, once its vLLM is known to serve the drafter
(:func:`vllm_serving`)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from draftheads import drafters
from draftheads.data.regenerate import prompt_ids
from draftheads.data.templates import stop_token_ids
from draftheads.drafters.contract import Serving
from draftheads.drafters.spec import DrafterSpec
from draftheads.run_folder import update_report
from draftheads.runs.job import Job
from draftheads.serving.llamacpp import DRAFT_GGUF, READINGS, LlamaServer, convert, float_target
from draftheads.serving.llamacpp_env import BUILD, ensure_llamacpp, find_llamacpp
from draftheads.serving.matrix import SERVERS, check_vllm_serves
from draftheads.serving.preflight import (
    MAX_MODEL_LEN,
    PROMPT,
    Expect,
    PreflightMismatch,
    mismatches,
    preflight_job,
    refusal,
    run_preflight,
)
from draftheads.serving.vllm_env import ensure_vllm, probe_vllm
from draftheads.training.config import Preflight

VENV_VARIABLE = "DRAFTHEADS_VLLM_VENV"
"""Names the vLLM environment when ``vllm.venv`` does not (the one CI and the vLLM tests use)."""


def preflight_python(job: Job, recipe: Serving) -> tuple[Path | None, str]:
    """The vLLM environment's python the preflight runs in, or None and why it does not run: ``off``; ``auto``
    without an environment named (``vllm.venv``, ``$DRAFTHEADS_VLLM_VENV``) or one that does not exist, or whose
    vLLM does not serve the drafter's method or is no vLLM of the serving matrix whose cell says it loads the
    export, or runs it on GPUs only (:attr:`~draftheads.serving.matrix.Cell.cpu`) on a machine without one.
    Raises ``ValueError`` with ``on`` for a vLLM that does not serve the method
    (:func:`vllm_serving`, which makes the environment on first use)."""
    mode, venv = job.conf.serving.preflight, job.conf.vllm.venv or os.environ.get(VENV_VARIABLE)
    if mode == Preflight.off:
        return None, "serving.preflight=off"
    if mode == Preflight.auto:
        if not venv:
            return None, f"no vLLM environment named (vllm.venv, ${VENV_VARIABLE})"
        if not (Path(venv) / "bin" / "python").exists():
            return None, f"vllm.venv / ${VENV_VARIABLE}={venv} holds no environment (serving.preflight=on makes it)"
        try:
            python = vllm_serving(recipe.spec, recipe.spec.vllm_method, venv)
        except ValueError as e:
            return None, str(e)
        version = probe_vllm(python)["version"]
        row = recipe.spec.served(recipe.spec.vllm_weights)
        cells = [row.cells[s.key] for s in SERVERS if s.kind == "vllm" and version.startswith(s.release + ".")]
        if not any(cell.loads for cell in cells):
            return None, (f"vLLM {version} is no vLLM of the serving matrix that loads {recipe.spec.vllm_weights} "
                          f"(docs/serving.md)")
        if not torch.cuda.is_available() and not any(cell.cpu for cell in cells if cell.loads):
            return None, (f"vLLM {version} runs {recipe.spec.name} on GPUs only, and this machine has none "
                          "(docs/serving.md)")
        return python, ""
    return vllm_serving(recipe.spec, recipe.spec.vllm_method, venv), ""


def serving_preflight(job: Job, recipe: Serving) -> dict:
    """On the main process, before the rows and target states: vLLM loads the job's drafter exported untrained
    (:meth:`~draftheads.drafters.contract.Serving.untrained`, in a temporary folder), drafts
    ``serving.preflight_tokens`` tokens of one prompt, and what its engine read is held to
    :meth:`~draftheads.drafters.contract.Serving.served_reads` and the draft's ``max_model_len``
    (:func:`~draftheads.serving.preflight.check`). Returns the record for ``report.json`` (``mode``, ``ran``;
    ``why`` it did not; else ``passed``, ``seconds``, ``readings``...); {} on other processes.

    Raises :class:`~draftheads.serving.preflight.PreflightMismatch` (a ``ValueError``) naming each key, our
    value and the server's when vLLM reads the export otherwise, after writing the record into ``report.json``;
    with ``serving.preflight=on`` also ``ValueError`` for a drafter without a preflight or a vLLM that does not
    serve it, and ``CalledProcessError`` when the engine refuses the export (``auto`` records it and goes on)."""
    if not job.accelerator.is_main_process:
        return {}
    start, mode = time.perf_counter(), job.conf.serving.preflight.value
    python, why = preflight_python(job, recipe)
    if python is None:
        print(f"serving preflight: skipped ({why})", flush=True)
        return {"mode": mode, "ran": False, "why": why}
    conf, target, tokenizer = job.conf, job.target, job.tokenizer
    with tempfile.TemporaryDirectory(prefix="draftheads-preflight-") as tmp:
        trained = recipe.untrained(job, Path(tmp))
        if trained is None:
            why = f"{recipe.spec.name} has no serving preflight"
            if conf.serving.preflight == Preflight.on:
                raise ValueError(f"serving.preflight=on: {why}; use serving.preflight=auto or off")
            print(f"serving preflight: skipped ({why})", flush=True)
            return {"mode": mode, "ran": False, "why": why}
        max_len = min(MAX_MODEL_LEN, target.config.max_position_embeddings)
        expected = recipe.served_reads(conf, trained, target) | {"draft_max_model_len": Expect(
            max_len, "config.json max_position_embeddings", "the engine's max_model_len: drafts over the whole "
                                                            "context the target serves")}
        spec = recipe.vllm_config(Path(tmp), conf, trained)
        run = preflight_job(job.target_path, spec, prompt_ids(tokenizer, PROMPT),
                            stop_token_ids(tokenizer, target.generation_config), conf.serving.preflight_tokens,
                            max_len, {"dtype": str(conf.model.dtype), **conf.vllm.engine()})
        print(f"serving preflight: vLLM ({python}) loads {recipe.spec.name}'s untrained export", flush=True)
        try:
            record = run_preflight(python, run, expected)
        except subprocess.CalledProcessError as e:
            if conf.serving.preflight == Preflight.on:
                raise
            tail = (e.stderr or e.output or "")[-1500:] if isinstance(e.stderr or e.output, str) else ""
            print(f"WARNING: serving preflight UNDECIDED: vLLM's engine failed on {recipe.spec.name}'s untrained "
                  f"export ({e}), so nothing says it will serve what this job trains. serving.preflight=auto goes on; "
                  f"serving.preflight=on stops here instead. The engine's last words:\n{tail}", file=sys.stderr,
                  flush=True)
            return {"mode": mode, "ran": True, "passed": None, "why": f"undecided: the engine failed: {e}"}
    record = {"mode": mode, "ran": True, **record, "seconds": round(time.perf_counter() - start, 1)}
    if not record["passed"]:
        update_report(job.out, {"drafter": recipe.spec.name, "preflight": record})
        raise refusal(record, f"{recipe.spec.vllm_weights} of {recipe.spec.name}, untrained")
    print(f"serving preflight: passed in {record['seconds']:.1f} s (vLLM read "
          + ", ".join(f"{k}={v['server']}" for k, v in record["readings"].items()) + ")", flush=True)
    return record


def llamacpp_preflight(job: Job, recipe: Serving) -> dict:
    """``serving.llamacpp_preflight``, on the main process after :func:`serving_preflight`: llama-server loads the
    job's drafter exported untrained and made a GGUF by llama.cpp's converter, beside the target's float GGUF
    (:func:`~draftheads.serving.llamacpp.float_target`), drafts ``serving.preflight_tokens`` tokens of one prompt,
    and what it says it read (:meth:`~draftheads.serving.llamacpp.LlamaServer.readings`) is held to
    :meth:`~draftheads.drafters.contract.Serving.served_reads`; the settings llama.cpp does not read
    (:meth:`~draftheads.drafters.contract.Serving.llamacpp_unread`) fail it too. Returns the record
    (``report.json``'s ``preflight["llama.cpp"]``: ``ran``, ``why``; else ``passed``, ``readings``, ``seconds``);
    {} when off or on other processes.

    Raises :class:`~draftheads.serving.preflight.PreflightMismatch` naming each setting or reading; with ``on``
    also ``ValueError`` for a drafter llama.cpp does not serve and ``RuntimeError`` when the converter or the server
    refuses the export (``auto`` records it and goes on)."""
    mode = job.conf.serving.llamacpp_preflight
    if not job.accelerator.is_main_process or mode == Preflight.off:
        return {}
    start, conf, target = time.perf_counter(), job.conf, job.target
    if recipe.spec.llamacpp_spec is None:
        why = f"llama.cpp {BUILD} serves no {recipe.spec.name} drafter (docs/serving.md)"
        if mode == Preflight.on:
            raise ValueError(f"serving.llamacpp_preflight=on: {why}")
        print(f"llama.cpp preflight: skipped ({why})", flush=True)
        return {"mode": mode.value, "ran": False, "why": why}
    llamacpp = ensure_llamacpp() if mode == Preflight.on else find_llamacpp()
    if llamacpp is None:
        why = ("no llama.cpp built ($DRAFTHEADS_LLAMACPP, $DRAFTHEADS_CACHE/llamacpp; serving.llamacpp_preflight=on "
               "builds it)")
        print(f"llama.cpp preflight: skipped ({why})", flush=True)
        return {"mode": mode.value, "ran": False, "why": why}
    with tempfile.TemporaryDirectory(prefix="draftheads-preflight-") as tmp:
        trained = recipe.untrained(job, Path(tmp))
        meant = {k: e for k, e in recipe.served_reads(conf, trained, target).items() if k in READINGS}
        unread = recipe.llamacpp_unread(conf, trained, target)
        print(f"llama.cpp preflight: llama-server ({llamacpp.root}) loads {recipe.spec.name}'s untrained export",
              flush=True)
        try:
            draft = convert(llamacpp, Path(tmp) / recipe.spec.vllm_weights, Path(job.target_path),
                            Path(tmp) / DRAFT_GGUF)
            with LlamaServer(llamacpp, float_target(llamacpp, Path(job.target_path)), draft, recipe.spec.llamacpp_spec,
                             recipe.draft_length(conf, trained)) as server:
                drafted = server.complete(prompt_ids(job.tokenizer, PROMPT), conf.serving.preflight_tokens)["drafts"]
                read = server.readings()
        except RuntimeError as e:
            if mode == Preflight.on:
                raise
            print(f"WARNING: llama.cpp preflight UNDECIDED: {e}", file=sys.stderr, flush=True)
            return {"mode": mode.value, "ran": True, "passed": None, "why": f"undecided: {e}"[:2000]}
    bad = unread + mismatches(meant, read) + ([] if drafted else ["drafts: llama-server drafted nothing"])
    record = {"mode": mode.value, "ran": True, "passed": not bad, "mismatches": bad, "drafts": drafted,
              "readings": {k: {"key": e.key, "ours": e.ours, "server": read.get(k)} for k, e in meant.items()},
              "seconds": round(time.perf_counter() - start, 1)}
    if bad:
        update_report(job.out, {"drafter": recipe.spec.name, "preflight": {"llama.cpp": record}})
        raise PreflightMismatch(f"llama.cpp preflight: llama-server {BUILD} would serve {recipe.spec.name}'s export "
                                f"otherwise than this job means; stopped before any target state is computed:\n  "
                                + "\n  ".join(bad) + "\n(serving.llamacpp_preflight=off skips this check)")
    print(f"llama.cpp preflight: passed in {record['seconds']:.1f} s (llama-server read "
          + ", ".join(f"{k}={v['server']}" for k, v in record["readings"].items()) + ")", flush=True)
    return record


def vllm_serving(spec: DrafterSpec, method: str, vllm_venv: str | None = None) -> Path:
    """The python of the vLLM environment (``vllm_venv``, made on first use by
    :func:`~draftheads.serving.vllm_env.ensure_vllm`) once its vLLM is known to serve ``method``, the drafter's
    speculative method: its version and methods are read from its source (no engine started). Raises
    ``ValueError`` for a vLLM without the method, naming the last vLLM that serves it (``spec``'s serving row
    for ``spec.vllm_weights``) and the registered drafters this one serves
    (:func:`~draftheads.serving.matrix.check_vllm_serves`)."""
    python = ensure_vllm(vllm_venv)
    rows = {}
    for name in drafters.DRAFTERS:
        try:
            rows[name] = drafters.get(name).spec.served(drafters.get(name).spec.vllm_weights)
        except KeyError:  # a drafter that declares no row is named by none
            pass
    check_vllm_serves(method, probe_vllm(python), rows.get(spec.name), {n: r.method for n, r in rows.items()},
                      str(python))
    return python
