"""A finished run in llama.cpp: its export made a GGUF by llama.cpp's own converter (``export/llama.cpp``), and the
parity of our evaluator with ``llama-server`` on the run's held-out prompts, greedy: the target alone first, then
the drafter, with the server's decode speed with and without it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from draftheads import drafters
from draftheads.data.regenerate import target_prompt_ids
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.methods import load_eval_sets
from draftheads.jobs.cli import parse_args
from draftheads.models.speculative import plain_decode, speculative_decode
from draftheads.runs.output_dir import holding
from draftheads.runs.saved import SavedRun, open_run
from draftheads.serving.llamacpp import (
    DRAFT_GGUF,
    EXPORT,
    READINGS,
    LlamaServer,
    convert,
    decode_speed,
    float_target,
    llamacpp_counts,
    usable_cores,
    weights_type,
)
from draftheads.serving.llamacpp_env import BUILD, LlamaCpp, ensure_llamacpp
from draftheads.serving.parity import TOLERANCE
from draftheads.serving.preflight import mismatches


def llamacpp_unread(run: SavedRun) -> list[str]:
    """What of ``run``'s drafter llama.cpp does not serve as trained: ``ValueError`` for a drafter it does not serve
    at all (Medusa); the settings its GGUF loader does not read
    (:meth:`~draftheads.drafters.contract.Serving.llamacpp_unread`), with which it would serve another drafter."""
    if run.recipe.spec.llamacpp_spec is None:
        raise ValueError(f"{run.folder}: llama.cpp {BUILD} serves no {run.recipe.spec.name} drafter (docs/serving.md)")
    return run.recipe.llamacpp_unread(run.conf, run.trained, run.target)


def llamacpp_export(run: SavedRun, llamacpp: LlamaCpp, force: bool = False) -> Path:
    """``<run>/export/llama.cpp/draft.gguf``: the run's strict export (``recipe.spec.vllm_weights``) converted by
    llama.cpp's ``convert_hf_to_gguf.py`` at float32, the target's folder giving the tokenizer and sizes. Refused
    (``ValueError``) where :func:`llamacpp_unread` names settings, unless ``force``; ``RuntimeError`` when the
    converter refuses it."""
    unread = llamacpp_unread(run)
    if unread and not force:
        raise ValueError(f"{run.folder}: llama.cpp {BUILD} would load this {run.recipe.spec.name} export and serve "
                         f"another drafter: " + "; ".join(unread) + " (force=true makes it anyway)")
    with holding(run.folder):
        return convert(llamacpp, run.folder / run.recipe.spec.vllm_weights, Path(run.target_path),
                       run.folder / EXPORT / DRAFT_GGUF)


def served(llamacpp: LlamaCpp, model: Path, prompts: list[list[int]], max_tokens: int, threads: int,
           repack: bool = True, **draft) -> tuple[list[dict], dict]:
    """Each prompt's greedy completion by one ``llama-server`` (``draft``: its ``draft``, ``spec_type``,
    ``n_max``), and what it says it read of the drafter (:meth:`~draftheads.serving.llamacpp.LlamaServer.readings`)."""
    with LlamaServer(llamacpp, model, threads=threads, repack=repack, **draft) as server:
        return [server.complete(ids, max_tokens) for ids in prompts], server.readings()


def parity_row(name: str, ours_plain: list[list[int]], ours: list[dict], plain: list[dict], spec: list[dict],
               max_tokens: int, n_max: int, misread: list[str] = (), tau_judged: bool = True) -> dict:
    """One eval set's row: the targets' greedy agreement, then on the prompts where they agree identical outputs
    and tau (1 + accepted / verification steps) ours against llama-server's, both counted as llama-server counts;
    tau over every prompt too; decode tokens per second with and without the drafter; ``misread``: what the server
    read of the drafter otherwise than we mean (:func:`~draftheads.serving.preflight.mismatches`). Parity: nothing
    misread, some prompts agree, all of them decode identically, and, where ``tau_judged`` (a float32 target: the
    drafter reads the hidden states ours reads), tau differs by at most :data:`~draftheads.serving.parity.TOLERANCE`;
    a quantized target's drafter reads other hidden states, so its tau is reported, not judged."""
    agree = [i for i, (a, b) in enumerate(zip(ours_plain, plain)) if a == b["tokens"]]
    counted = [llamacpp_counts(o["steps"], len(o["tokens"]), max_tokens, n_max) for o in ours]

    def tau(counts: list[dict], where) -> float:
        return 1 + sum(counts[i]["accepted"] for i in where) / max(sum(counts[i]["drafts"] for i in where), 1)

    theirs = [{"drafts": s["drafts"], "accepted": s["draft_n_accepted"]} for s in spec]
    every = range(len(ours))
    speed = {"plain": decode_speed(plain), "drafter": decode_speed(spec)}
    row = {"set": name, "prompts": len(ours), "target_agreement": len(agree) / len(ours),
           "identical": sum(ours[i]["tokens"] == spec[i]["tokens"] for i in agree) / max(len(agree), 1),
           "lossless_in_llamacpp": sum(s["tokens"] == p["tokens"] for s, p in zip(spec, plain)) / len(spec),
           "tau_ours": tau(counted, agree), "tau_llamacpp": tau(theirs, agree),
           "tau_ours_all": tau(counted, every), "tau_llamacpp_all": tau(theirs, every),
           "drafts_ours": sum(counted[i]["drafts"] for i in agree),
           "drafts_llamacpp": sum(theirs[i]["drafts"] for i in agree),
           "tokens_per_s_plain": speed["plain"], "tokens_per_s_drafter": speed["drafter"],
           "speedup": speed["drafter"] / speed["plain"], "misread": list(misread), "tau_judged": tau_judged}
    row["parity"] = not misread and bool(agree) and row["identical"] == 1.0 and \
        (not tau_judged or abs(row["tau_ours"] - row["tau_llamacpp"]) <= TOLERANCE)
    return row


def llamacpp_parity(run_dir: Path, overrides: list[str] = (), llamacpp_dir: str | None = None,
                    target_gguf: str | None = None, draft_gguf: str | None = None, threads: int | None = None,
                    force: bool = False, repack: bool = True) -> list[dict]:
    """Decode the run's eval prompts greedily with our evaluator (plain, and the chain of its export read back by
    the strict loader) and with ``llama-server`` on ``target_gguf`` (default: the run's target at float32,
    :func:`~draftheads.serving.llamacpp.float_target`, the weights our evaluator runs) without and with the
    drafter's GGUF (default: :func:`llamacpp_export`'s; ``draft_gguf`` serves another); ``repack=False``: the
    server without ggml's repacked quantized kernels; ``threads``: llama-server's (default: the cores this process may
    run on, :func:`~draftheads.serving.llamacpp.usable_cores`). Prints the table, writes
    ``<run>/llamacpp_parity.json``; raises ``SystemExit(1)`` without parity on every set. llama.cpp is made on
    first use (:func:`~draftheads.serving.llamacpp_env.ensure_llamacpp`, ``llamacpp_dir``)."""
    recipe = drafters.of_run(Path(run_dir))
    if recipe.spec.llamacpp_spec is None:  # before anything is built or loaded
        raise ValueError(f"{run_dir}: llama.cpp {BUILD} serves no {recipe.spec.name} drafter (docs/serving.md)")
    llamacpp, threads = ensure_llamacpp(llamacpp_dir), threads or usable_cores()
    run = open_run(run_dir, overrides, recipe.spec.vllm_weights)  # the export, read back as the GGUF is made from it
    unread = llamacpp_unread(run)
    draft = Path(draft_gguf) if draft_gguf else llamacpp_export(run, llamacpp, force)
    target = Path(target_gguf) if target_gguf else float_target(llamacpp, Path(run.target_path))
    weights = weights_type(target)
    eval_cfg, tokenizer = run.conf.eval, run.tokenizer
    drafter = recipe.chain(run.conf, run.trained, run.target)
    stop = stop_token_ids(tokenizer, run.target.generation_config)
    meant = {k: e for k, e in recipe.served_reads(run.conf, run.trained, run.target).items() if k in READINGS}
    budget, device = eval_cfg.max_new_tokens, next(run.target.parameters()).device
    rows = []
    for name, prompts in load_eval_sets(replace(eval_cfg, enabled=True), tokenizer).items():
        ids = [target_prompt_ids(tokenizer, p) for p in prompts]
        print(f"{name}: {len(ids)} prompts, ours then llama-server's, plain and with the drafter", flush=True)
        ours_plain = [plain_decode(run.target, torch.tensor(i, device=device), budget, stop).tokens for i in ids]
        ours = []
        for i in ids:
            r = speculative_decode(run.target, drafter, torch.tensor(i, device=device), budget, stop)
            ours.append({"tokens": r.tokens, "steps": r.accepted_per_step})
        plain, _ = served(llamacpp, target, ids, budget, threads, repack)
        spec, read = served(llamacpp, target, ids, budget, threads, repack, draft=draft,
                            spec_type=recipe.spec.llamacpp_spec, n_max=drafter.gamma)
        rows.append(parity_row(name, ours_plain, ours, plain, spec, budget, drafter.gamma, mismatches(meant, read),
                               weights == "ALL_F32"))
    print(f"\n{drafter.name} in llama.cpp {BUILD} ({target.name}, {weights}, {threads} threads) vs draftheads, greedy, "
          f"{budget} new tokens; parity: on the prompts where the targets agree, identical outputs and " +
          (f"|tau difference| <= {TOLERANCE}" if weights == "ALL_F32" else
           "tau reported, not judged (a quantized target: the drafter reads other hidden states than ours)"),
          flush=True)
    print(f"{'set':<12}{'targets agree':>14}{'identical':>10}{'tau ours':>10}{'tau llama':>10}{'(all)':>14}"
          f"{'tok/s plain':>12}{'drafter':>9}{'speedup':>8}")
    for r in rows:
        print(f"{r['set']:<12}{r['target_agreement']:>14.2f}{r['identical']:>10.2f}{r['tau_ours']:>10.3f}"
              f"{r['tau_llamacpp']:>10.3f}{r['tau_ours_all']:>7.3f}/{r['tau_llamacpp_all']:.3f}"
              f"{r['tokens_per_s_plain']:>12.1f}{r['tokens_per_s_drafter']:>9.1f}{r['speedup']:>7.2f}x"
              f"{'' if r['parity'] else '   <- NO PARITY'}")
        for line in r["misread"]:
            print(f"    llama-server misread {line}")
    if unread:
        print("served anyway (force=true), though llama.cpp does not read: " + "; ".join(unread))
    (Path(run_dir) / "llamacpp_parity.json").write_text(json.dumps(
        {"method": drafter.name, "llama.cpp": BUILD, "spec_type": recipe.spec.llamacpp_spec, "n_max": drafter.gamma,
         "target": run.target_path, "target_gguf": str(target), "draft_gguf": str(draft), "weights": weights,
         "threads": threads, "repack": repack, "max_new_tokens": budget, "unread": unread, "rows": rows}, indent=1))
    if not all(r["parity"] for r in rows):
        raise SystemExit(1)
    return rows


def cli(argv: list[str], usage: str = __doc__) -> list[dict]:
    """``train/llamacpp_parity.py``'s command line: the run, ``llamacpp=DIR``, ``target_gguf=``, ``draft_gguf=``,
    ``threads=``, ``force=true``, ``repack=false``, config overrides."""
    run_dir, options, overrides = parse_args(
        argv, ("llamacpp", "target_gguf", "draft_gguf", "threads", "force", "repack"), usage)
    return llamacpp_parity(run_dir, overrides, options.get("llamacpp"), options.get("target_gguf"),
                           options.get("draft_gguf"), int(options["threads"]) if "threads" in options else None,
                           options.get("force", "false").lower() == "true",
                           options.get("repack", "true").lower() == "true")
