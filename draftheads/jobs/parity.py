"""Our evaluator and vLLM side by side, greedy, on a finished run's held-out prompts (any drafter vLLM serves)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from draftheads import drafters
from draftheads.data.regenerate import prompt_messages, target_prompt_ids
from draftheads.data.templates import stop_token_ids, template_kwargs
from draftheads.evaluation.methods import load_eval_sets
from draftheads.jobs.cli import parse_args
from draftheads.runs.preflight import vllm_serving
from draftheads.runs.saved import open_run
from draftheads.serving.parity import TOLERANCE, compare, our_side, run_vllm
from draftheads.serving.vllm_env import VLLM


def parity(run_dir: Path, overrides: list[str] = (), vllm_venv: str | None = None, serve: bool = False) -> list[dict]:
    """Decode the run's eval prompts with its export as vLLM loads it (``recipe.spec.vllm_weights``, read back by
    the strict loader) on both sides: our chain evaluator and vLLM's CPU build (offline ``LLM`` API; with
    ``serve`` also its OpenAI server). Prints the table, writes ``<run>/vllm_parity.json``; raises
    ``SystemExit(1)`` without parity. The vLLM environment is made on first use
    (``$DRAFTHEADS_CACHE/vllm-venv`` unless ``vllm_venv``); one whose vLLM lacks the drafter's method is refused
    before any engine starts (``ValueError``, :func:`~draftheads.runs.preflight.vllm_serving`)."""
    run = open_run(run_dir, overrides, drafters.of_run(run_dir).spec.vllm_weights)  # refused before vLLM is set up
    eval_cfg, tokenizer = run.conf.eval, run.tokenizer
    drafter = run.recipe.chain(run.conf, run.trained, run.target)
    spec = run.recipe.vllm_config(run.folder, run.conf, run.trained)
    python = vllm_serving(run.recipe.spec, spec["method"], vllm_venv)  # a vLLM without the method: refused here
    rows = []
    for name, prompts in load_eval_sets(replace(eval_cfg, enabled=True), tokenizer).items():
        chats = [prompt_messages(tokenizer, p) for p in prompts]
        ids = [target_prompt_ids(tokenizer, p) for p in prompts]  # in the set's thinking mode
        ours = our_side(run.target, tokenizer, drafter, ids, eval_cfg.max_new_tokens)
        job = {"target": str(run.target_path), "speculative_config": spec, "prompts": ids, "max_tokens":
               eval_cfg.max_new_tokens, "messages": chats,
               "port": 8011, "stop_token_ids": sorted(stop_token_ids(tokenizer, run.target.generation_config)),
               "chat_template": tokenizer.chat_template,
               "chat_template_kwargs": template_kwargs(prompts[0].thinking) or None}  # served in the set's mode
        rows.append({"mode": "offline", **compare(name, ours, run_vllm(python, {**job, "mode": "offline"}))})
        if serve:
            served = run_vllm(python, {**job, "mode": "serve"})
            rows.append({"mode": "serve", **compare(name, ours, served,
                                                    lambda t: tokenizer.decode(t, skip_special_tokens=True))})
    print(f"\n{drafter.name} in vLLM ({VLLM}) vs draftheads, greedy, {eval_cfg.max_new_tokens} new tokens; "
          f"parity: identical outputs and |tau difference| <= {TOLERANCE}")
    print(f"{'set':<12}{'vLLM via':<10}{'identical':>10}{'tau ours':>10}{'tau vLLM':>10}  per-position (ours | vLLM)")
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["per_position_ours"][:5]) + " | " + \
              " ".join(f"{b:.2f}" for b in r["per_position_vllm"][:5])
        print(f"{r['set']:<12}{r['mode']:<10}{r['identical']:>10.2f}{r['tau_ours']:>10.3f}{r['tau_vllm']:>10.3f}  {pos}"
              f"{'' if r['parity'] else '   <- NO PARITY'}")
    (Path(run_dir) / "vllm_parity.json").write_text(json.dumps({"method": drafter.name, "vllm": VLLM, "rows": rows},
                                                               indent=1))
    if not all(r["parity"] for r in rows):
        raise SystemExit(1)
    return rows


def cli(argv: list[str], usage: str = __doc__) -> list[dict]:
    """``train/vllm_parity.py``'s command line: the run, ``vllm_venv=``, ``serve=true``, config overrides."""
    run_dir, options, overrides = parse_args(argv, ("vllm_venv", "serve"), usage)
    return parity(run_dir, overrides, options.get("vllm_venv"), options.get("serve", "false").lower() == "true")
