"""The serving preflight: before a training job computes any target state, vLLM loads the job's drafter, exported
untrained (the shapes, layer ids and keys the trained one will have), drafts a few tokens of one prompt, and says
what it read; each reading is held to what the trainer meant. A server that reads a layer id, a norm flag or a
config key otherwise than the trainer meant still serves, with acceptance near zero; the preflight stops the job
instead, naming the key, our value and the server's.

What vLLM read comes from inside its engine (:func:`~draftheads.serving.vllm_runner.engine_reads`: the loaded
models' attributes and the speculative config), never from our own files; what we meant comes from the config and
the drafter built in memory (each recipe's ``served_reads``), never from the export either, so an exporter that
writes a key wrongly is caught too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from draftheads.serving.parity import run_vllm

PROMPT = "Write one sentence about the sea."
"""The one prompt drafted on (chat template applied)."""
MAX_MODEL_LEN = 1024
"""The engine's context length at most (the runner's default): a smaller target's is taken."""


@dataclass(frozen=True)
class Expect:
    """One reading the server must make of an export: our value, and the key of the export that says it."""
    ours: object
    """What the trainer meant, in the server's terms (vLLM's layer ids, target ids of draft tokens)."""
    key: str
    """Where the export says it (``config.json eagle_config.eagle_aux_hidden_state_layer_ids``)."""
    note: str = ""
    """How ``ours`` was had, when it is not the config's value as written (draftheads layers + 1)."""


class PreflightMismatch(ValueError):
    """The server read an export otherwise than the trainer meant (raised before any target state is computed)."""


def _shown(value) -> str:
    """A value as a message shows it: a long list by its length, ends and sum."""
    if isinstance(value, list) and len(value) > 8:
        return f"[{len(value)} values: {value[0]}, {value[1]}, ..., {value[-1]}; sum {sum(value)}]"
    return repr(value)


def mismatches(expected: dict[str, Expect], read: dict) -> list[str]:
    """One line per reading of ``read`` (the engine's, :func:`~draftheads.serving.vllm_runner.engine_reads`)
    that differs from ``expected`` (reading name -> :class:`Expect`): the reading, the export's key, our value
    and the server's. A reading the engine did not report counts as a mismatch (this vLLM has no such attribute:
    it does not read the key as we meant). Lists compare in order (the order features are concatenated in);
    tuples count as lists."""
    lines = []
    for name, e in expected.items():
        ours = list(e.ours) if isinstance(e.ours, tuple) else e.ours
        if name not in read:
            lines.append(f"{name} ({e.key}): ours {_shown(ours)}{f' ({e.note})' if e.note else ''}, the server "
                         f"reports no {name}: it does not read the key as meant")
            continue
        theirs = list(read[name]) if isinstance(read[name], tuple) else read[name]
        if theirs != ours:
            lines.append(f"{name} ({e.key}): ours {_shown(ours)}{f' ({e.note})' if e.note else ''}, the server read "
                         f"{_shown(theirs)}")
    return lines


def check(expected: dict[str, Expect], result: dict) -> dict:
    """The preflight's record (``report.json``'s ``preflight``) of the runner's ``result``: ``passed``, the
    ``mismatches`` (:func:`mismatches`, and the drafts when the engine drafted nothing), the ``readings``
    compared (the export's key, ours and the server's) and the ``drafts`` vLLM made."""
    read, drafts = result["read"], result["metrics"].get("drafts", 0)
    bad = mismatches(expected, read)
    if not drafts:
        bad.append(f"drafts: the engine made no draft in {len(result['outputs'][0])} tokens of one prompt")
    return {"passed": not bad, "mismatches": bad, "drafts": drafts,
            "readings": {name: {"key": e.key, "ours": _short(e.ours), "server": _short(read.get(name))}
                         for name, e in expected.items()}}


def refusal(record: dict, where: str) -> PreflightMismatch:
    """The error that stops a job whose preflight ``record`` did not pass, naming every mismatch and ``where``
    the export was read from."""
    return PreflightMismatch(f"serving preflight: vLLM reads the untrained export ({where}) otherwise than this job "
                             f"means, so the trained drafter would be served wrongly; stopped before any target "
                             f"state is computed:\n  " + "\n  ".join(record["mismatches"])
                             + "\n(fix the export or the key; serving.preflight=off skips this check)")


def _short(value):
    """A reading as ``report.json`` keeps it (a draft vocabulary by its size and sum)."""
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return {"size": len(value), "sum": int(sum(value))}
    return list(value) if isinstance(value, tuple) else value


def preflight_job(target_path: str, spec: dict, prompt_ids: list[int], stop: list[int], max_new_tokens: int,
                  max_model_len: int, engine: dict) -> dict:
    """The runner's job: ``spec`` (vLLM's ``speculative_config``) on ``target_path``, ``max_new_tokens`` of one
    prompt, the engine at ``max_model_len`` with ``engine`` (``LLM`` arguments) over the runner's defaults."""
    return {"mode": "preflight", "target": target_path, "speculative_config": spec, "prompts": [prompt_ids],
            "max_tokens": max_new_tokens, "stop_token_ids": sorted(stop),
            "engine": {**engine, "max_model_len": max_model_len}}


def run_preflight(python: Path, job: dict, expected: dict[str, Expect]) -> dict:
    """Run ``job`` (:func:`preflight_job`) in the vLLM environment's ``python`` and :func:`check` what its engine
    read against ``expected``; returns the record with ``seconds`` (wall: the runner's start, vLLM's import, the
    engine) and ``engine_seconds`` (the engine's own start and drafting). Raises ``CalledProcessError`` when the
    engine fails (it refuses the export)."""
    start = time.perf_counter()
    result = run_vllm(python, job)
    return check(expected, result) | {"seconds": round(time.perf_counter() - start, 1),
                                      "engine_seconds": round(result.get("engine_seconds", 0.0), 1)}
