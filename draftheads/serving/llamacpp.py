"""llama.cpp serving our exports: the GGUF its own converter makes from a strict export, ``llama-server`` started on
a target GGUF with and without the drafter, and what one completion returns.

Read at build b11434 (the tree :func:`~draftheads.serving.llamacpp_env.ensure_llamacpp` unpacks):
- ``convert_hf_to_gguf.py --target-model-dir``: EAGLE-3 (``conversion/llama.py:49-105``: the draft found by
  ``draft_vocab_size`` and one layer; ``eagle_aux_hidden_state_layer_ids`` or the default ``[2, L/2, L-3]``; only
  ``norm_before_residual`` and ``norm_before_fc`` read), DFlash and DFlash 2 (``conversion/qwen.py:721-800``:
  ``dflash_config`` with ``target_layer_ids`` written as id + 1), DSpark (:924-990, ``Qwen3DSparkModel``). The
  tokenizer is the target folder's.
- The server counts, per verification step, the drafts it accepted (``tools/server/server-context.cpp:4322-4331``,
  one step less with a replayed draft) and reports ``1 + accepted / steps`` as "mean len" (:702); a completion
  returns ``draft_n`` and ``draft_n_accepted`` in ``timings`` (``server-common.cpp:99-101``), ``/metrics`` the
  steps (``llamacpp:spec_decode_num_drafts_total``, ``server-task.cpp:1573``). A draft is never longer than the
  tokens left minus one (``get_n_draft_max``, ``server-context.cpp:517-535``), where vLLM drafts its full length
  and counts what the budget then cuts: :func:`llamacpp_counts` counts our decoding as llama-server does.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from draftheads.serving.llamacpp_env import LlamaCpp

EXPORT = "export/llama.cpp"
"""The folder, in a run, of the drafter's GGUF (:data:`DRAFT_GGUF`) and its ``serving.json``."""
DRAFT_GGUF = "draft.gguf"
READINGS = {"aux_hidden_state_layers": (r"extract_layers = \[([-\d, ]*)\]",),
            "mask_token_id": (r"mask_token_id=(-?\d+)",),
            "num_speculative_tokens": (r"clamping to (\d+)", r"- n_max=(\d+)")}
"""What llama-server says it read of a drafter GGUF (the first pattern its log matches), by the names of the vLLM
preflight's readings (:meth:`~draftheads.drafters.contract.Serving.served_reads`): the target layers it extracts
(``src/models/eagle3.cpp:12``, ``src/models/dflash.cpp:50``: the input of decoder layer i), DFlash's mask token
(``common/speculative.cpp:1070``) and the draft length (:1069, or the block's where it clamps a longer one, :1077;
EAGLE-3's at :550), from its log at verbosity 4."""
TARGET_GGUF = "target-f32.gguf"
"""The float target's GGUF, written inside the target's folder: the weights our evaluator runs, as llama.cpp
reads them."""
LLAMACPP_LAYER_INPUTS = {
    "llama": "src/models/llama.cpp:127",
    "mistral": "src/models/llama.cpp:127 (its converter makes a Mistral target arch llama: conversion/__init__.py:194)",
    "qwen3": "src/models/qwen3.cpp:72",
}
"""Targets (``config.model_type``) whose llama.cpp b11434 graph records each layer's input, which its EAGLE-3 and
DFlash drafters read, with the line that does; Gemma 3's (``src/models/gemma3.cpp``) does not. Other graphs that
do (Qwen3-MoE, Qwen3-Next, Gemma 4, ...) are not listed until a target of theirs is tried here."""


def convert(llamacpp: LlamaCpp, folder: Path, target_dir: Path | None, out: Path, outtype: str = "f32") -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` on ``folder`` (an export, or a target folder when ``target_dir`` is
    None) into ``out`` (written whole, then renamed). ``outtype`` ``f32`` keeps the weights exactly. Raises
    ``RuntimeError`` with the converter's last lines when it refuses the folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, str(llamacpp.converter), str(folder), "--outtype", outtype, "--outfile", str(tmp)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=llamacpp.converter_env())
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{folder}: llama.cpp's converter refused it ({llamacpp.converter.name}, exit "
                           f"{proc.returncode}): {proc.stderr[-2000:]}")
    tmp.replace(out)
    return out


def float_target(llamacpp: LlamaCpp, target_dir: Path) -> Path:
    """The target folder's GGUF at float32 (:data:`TARGET_GGUF`, made once inside the folder)."""
    path = Path(target_dir) / TARGET_GGUF
    return path if path.is_file() else convert(llamacpp, Path(target_dir), None, path)


def weights_type(gguf: Path) -> str:
    """A GGUF's ``general.file_type`` by gguf-py's name for it (``ALL_F32``, ``MOSTLY_Q4_1``, ...; ``unknown``
    where the file does not say), read without loading the tensors."""
    from gguf import GGUFReader, LlamaFileType
    field = GGUFReader(gguf).fields.get("general.file_type")
    return LlamaFileType(int(field.parts[field.data[0]][0])).name if field else "unknown"


def llamacpp_counts(accepted_per_step: list[int], n_tokens: int, max_new_tokens: int, n_max: int) -> dict:
    """Our chain decoding of one prompt counted as llama-server counts it: ``drafts`` (verification steps with a
    draft) and ``accepted``, each step's draft cut to the tokens left minus one (``get_n_draft_max``).

    Args:
        accepted_per_step: drafts accepted at each of our steps (each of ``n_max`` drafts; greedy acceptance keeps a
            prefix, so a shorter draft keeps ``min(accepted, length)``).
        n_tokens: tokens our decoding emitted; max_new_tokens: the budget; n_max: the draft length.
    """
    pos, drafts, accepted = 1, 0, 0  # the first token comes from the prompt's forward
    for a in accepted_per_step:
        cap = min(n_max, max_new_tokens - pos - 1)
        if pos >= n_tokens or cap <= 0:
            break
        drafts, accepted, pos = drafts + 1, accepted + min(a, cap), pos + min(a, cap) + 1
    return {"drafts": drafts, "accepted": accepted}


class LlamaServer:
    """``llama-server`` on ``model`` (a GGUF), with ``draft`` under ``spec_type`` (``draft-eagle3``,
    ``draft-dflash``, ``draft-dspark``) drafting ``n_max`` tokens, on ``threads`` CPU threads (default: the cores
    this process may run on, :func:`usable_cores`; ggml's threads spin, so more than those slow it); a context
    manager that stops it. ``repack=False`` passes ``--no-repack``: ggml's repacked kernels for quantized weights die on
    some CPUs (SIGILL at the warm-up on this project's AMX Xeons; docs/serving.md). Raises ``RuntimeError`` with
    the server's last log lines when it exits before it is ready (a GGUF it refuses), or is not ready within
    ``timeout`` seconds."""

    def __init__(self, llamacpp: LlamaCpp, model: Path, draft: Path | None = None, spec_type: str | None = None,
                 n_max: int | None = None, threads: int | None = None, ctx_size: int = 4096, repack: bool = True,
                 timeout: float = 180):
        self.port = _free_port()
        threads = threads or usable_cores()
        handle, log = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
        os.close(handle)
        self.log = Path(log)
        cmd = [str(llamacpp.server), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-c", str(ctx_size), "-np", "1", "--metrics",
               "--no-webui", "--offline", "-lv", "4"] + ([] if repack else ["--no-repack"])
        if draft is not None:
            cmd += ["-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
                    "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(threads)]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self._tail()
                self.close()
                died = (f"; it died of signal {-self.proc.returncode}: if its quantized weights' repacked kernels "
                        f"fault on this CPU, repack=false (--no-repack) serves them") \
                    if self.proc.returncode < 0 and repack else ""
                raise RuntimeError(f"llama-server refused {draft or model} (exit {self.proc.returncode}{died}): "
                                   f"{tail}")
            try:
                if json.loads(self._get("/health")).get("status") == "ok":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        tail = self._tail()
        self.close()
        raise RuntimeError(f"llama-server not ready within {timeout:.0f} s: {tail}")

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict:
        """Greedy completion of ``prompt_ids``: ``tokens``, ``predicted_n``, ``predicted_ms``, ``draft_n``,
        ``draft_n_accepted`` and ``drafts`` (verification steps, from ``/metrics``)."""
        before = self.metrics()
        body = {"prompt": list(prompt_ids), "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "samplers": ["top_k"], "return_tokens": True, "cache_prompt": False, "seed": 0}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            reply = json.load(r)
        after, timings = self.metrics(), reply["timings"]
        return {"tokens": reply["tokens"], "predicted_n": timings["predicted_n"],
                "predicted_ms": timings["predicted_ms"], "draft_n": timings.get("draft_n", 0),
                "draft_n_accepted": timings.get("draft_n_accepted", 0),
                "drafts": after.get("spec_decode_num_drafts_total", 0) - before.get("spec_decode_num_drafts_total", 0)}

    def readings(self) -> dict:
        """What it says it read of the drafter (:data:`READINGS`, those its log has)."""
        text, out = self.log.read_text(errors="replace"), {}
        for name, patterns in READINGS.items():
            found = next((m for m in (re.search(p, text) for p in patterns) if m), None)
            if found:
                values = [int(v) for v in found.group(1).split(",") if v.strip()]
                out[name] = values if name == "aux_hidden_state_layers" else values[0]
        return out

    def metrics(self) -> dict[str, float]:
        """``/metrics``' ``llamacpp:`` counters by name (without the prefix)."""
        out = {}
        for line in self._get("/metrics").splitlines():
            if line.startswith("llamacpp:"):
                name, value = line.split()[:2]
                out[name.removeprefix("llamacpp:")] = float(value)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.unlink(missing_ok=True)

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return r.read().decode()

    def _tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
        return "\n".join(line for line in lines[-15:])


def decode_speed(completions: list[dict]) -> float:
    """Decode tokens per second over :meth:`LlamaServer.complete`'s ``completions`` (llama-server's own timings,
    the prompt's processing left out)."""
    return sum(c["predicted_n"] for c in completions) / sum(c["predicted_ms"] for c in completions) * 1000


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of the machine's where it has none): llama-server's
    threads by default."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
