"""End of a Medusa run on the main process: validation and drift, model-only save, export, speculative
evaluation, report. ``train/evaluate.py`` and ``train/export.py`` reuse these pieces on a saved run."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from models.export.medusa import export_tgi_medusa, export_vllm_medusa, save_heads
from models.speculative import MedusaDrafter, Sampling, prompt_lookup_decode, speculative_decode
from models.tree import Tree, TypicalAcceptance, default_choices, tree_decode
from train.evaluation import eval_prompts, evaluate_set, format_table, hardware, log_eval, write_report
from train.runtime import distributed
from train.validation import validate


def load_eval_sets(eval_cfg) -> dict[str, list]:
    """Each eval set's held-out prompts. Raises ``ValueError`` for an empty set or ``max_new_tokens`` < 1,
    and the source's own error (file, line, field) for a malformed file."""
    if eval_cfg.max_new_tokens < 1:
        raise ValueError(f"eval.max_new_tokens={eval_cfg.max_new_tokens} must be >= 1")
    sets = {s.name: eval_prompts(s) for s in eval_cfg.sets} if eval_cfg.enabled else {}
    for name, prompts in sets.items():
        if not prompts:
            raise ValueError(f"eval set {name!r} has no prompts (num_prompts >= 1 and a non-empty source needed)")
    return sets


def evaluate_methods(eval_cfg, eval_sets: dict[str, list], target, tokenizer, drafter,
                     peers_at: Callable[[Sampling], dict]) -> dict:
    """Speculative evaluation of ``drafter`` on every eval set at every temperature in ``eval.temperatures``:
    ``{set name: metrics}``, the set named ``<set>@T<t>`` for t > 0. ``peers_at(sampling)`` gives the methods
    measured beside it on the same prompts (``name -> decode(prompt_ids, generator)``), kept to ``eval.peers``
    when that is set. Raises ``ValueError`` for a name in ``eval.peers`` that no temperature offers."""
    samplings = [Sampling(t, eval_cfg.top_k, eval_cfg.top_p) for t in eval_cfg.temperatures]
    offered = [peers_at(sampling) for sampling in samplings]
    if eval_cfg.peers is not None:
        unknown = set(eval_cfg.peers) - set().union(*offered)
        if unknown:
            raise ValueError(f"eval.peers: {sorted(unknown)} not measured by this run; available: "
                             f"{sorted(set().union(*offered))}")
        offered = [{k: v for k, v in peers.items() if k in eval_cfg.peers} for peers in offered]
    results = {}
    for sampling, peers in zip(samplings, offered):
        for name, prompts in eval_sets.items():
            key = name if sampling.greedy else f"{name}@T{sampling.temperature:g}"
            results[key] = evaluate_set(target, tokenizer, drafter, prompts, eval_cfg.max_new_tokens,
                                        eval_cfg.tie_tolerance, sampling, eval_cfg.seed, peers, desc=f"eval {key}")
    return results


def evaluate_heads(eval_cfg, eval_sets: dict[str, list], target, tokenizer, heads,
                   rank_accuracy: list[list[float]] | None) -> dict:
    """Medusa heads evaluated as a chain (``medusa_chain``), beside the heads as a tree (``medusa_tree``; with
    t > 0 or ``eval.typical``, ``medusa_tree_typical``) and transformers' prompt lookup.
    ``rank_accuracy`` ([K][r]) grows the default tree.
    Raises ``ValueError`` for a tree deeper than the heads, or no tree and no accuracies to grow one.
    """
    drafter = MedusaDrafter(heads.eval(), target.get_output_embeddings())
    tree = medusa_tree(eval_cfg, heads.num_heads, rank_accuracy) if eval_cfg.tree else None
    return evaluate_methods(eval_cfg, eval_sets, target, tokenizer, drafter,
                            lambda sampling: {**medusa_peers(eval_cfg, target, tokenizer, heads, tree, sampling),
                                              **prompt_lookup_peer(eval_cfg, target, tokenizer, sampling)})


def medusa_tree(eval_cfg, num_heads: int, rank_accuracy: list[list[float]] | None) -> Tree:
    """``eval.medusa_choices`` as a tree, or one grown from rank accuracies ([K][r]) for ``eval.tree_budget``
    nodes. Raises ``ValueError`` for a tree deeper than ``num_heads`` or neither choices nor accuracies."""
    choices = eval_cfg.medusa_choices
    if choices is None:
        if rank_accuracy is None:
            raise ValueError("no eval.medusa_choices and no measured head accuracies to grow a tree from")
        choices = default_choices(rank_accuracy, eval_cfg.tree_budget)
    return Tree.from_choices(choices, num_heads)


def medusa_peers(eval_cfg, target, tokenizer, heads, tree: Tree | None, sampling: Sampling,
                 chain: bool = False) -> dict:
    """Medusa as a peer at this temperature: the tree (greedy, or typical acceptance at t > 0 or with
    ``eval.typical``) and, with ``chain``, the heads as a chain too (for runs of another drafter)."""
    eos, n = tokenizer.eos_token_id, eval_cfg.max_new_tokens
    drafter = MedusaDrafter(heads.eval(), target.get_output_embeddings())
    peers = {}
    if chain:
        peers[drafter.name] = lambda ids, gen: speculative_decode(target, drafter, ids, n, eos, sampling, gen)
    if tree is not None:
        typical = (TypicalAcceptance(eval_cfg.typical_epsilon, eval_cfg.typical_delta, sampling.temperature or 0.7)
                   if eval_cfg.typical or not sampling.greedy else None)
        peers["medusa_tree_typical" if typical else "medusa_tree"] = \
            lambda ids, gen: tree_decode(target, drafter, tree, ids, n, eos, typical)
    return peers


def prompt_lookup_peer(eval_cfg, target, tokenizer, sampling: Sampling) -> dict:
    """transformers' prompt-lookup decoding, the model-free peer, at this temperature (lossless)."""
    if eval_cfg.prompt_lookup_tokens <= 0:
        return {}
    eos, n = tokenizer.eos_token_id, eval_cfg.max_new_tokens
    return {"prompt_lookup": lambda ids, gen: prompt_lookup_decode(target, ids, n, eos, eval_cfg.prompt_lookup_tokens,
                                                                   sampling, gen)}


def export_all(output_dir: Path, target, heads, base_model: str) -> dict[str, str]:
    """``export/vllm`` and ``export/tgi`` (Medusa heads for ``base_model``); returns their paths."""
    lm_head = target.get_output_embeddings().weight
    exports = output_dir / "export"
    return {"vllm": str(export_vllm_medusa(heads, lm_head, exports / "vllm")),
            "tgi": str(export_tgi_medusa(heads, lm_head, exports / "tgi", base_model))}


def finish_run(conf, accelerator, target, tokenizer, heads, target_path: str, identity: dict, val_rows: list,
               eval_sets: dict[str, list], step: int, extra: dict) -> dict:
    """Validate, save, export, evaluate and write ``report.json``; returns the report. Metrics are logged
    at ``step``, the last training step on the tracker's axis."""
    out = Path(conf.output_dir)
    heads = accelerator.unwrap_model(heads).to(target.dtype).eval()  # trained in float32; served in the target's dtype
    val, rank_accuracy = validate(target, heads, val_rows, conf.trainer.hidden_states_batch_size,
                                  tokenizer.pad_token_id)
    accelerator.log(val, step=step)
    print("validation (held-out rows): " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())), flush=True)

    base_model = target_path
    if conf.stage2.enabled:  # the target itself changed: serve it with its heads
        base_model = str((out / "export" / "target").resolve())
        target.save_pretrained(base_model)
        tokenizer.save_pretrained(base_model)
    save_heads(heads, out / "medusa_heads", {"target": identity, "base_model": base_model})

    report = {"config": json.loads(json.dumps(asdict(conf), default=str)), "target": target_path,
              "base_model": base_model, "hardware": hardware(), "distributed": distributed(accelerator),
              "dtype": conf.model.dtype,
              "validation": val, "head_rank_accuracy": rank_accuracy, **extra,
              "notes": "acceptance_length counts the bonus token; alpha is conditional on earlier positions"}
    if conf.eval.enabled:
        report["eval"] = evaluate_heads(conf.eval, eval_sets, target, tokenizer, heads, rank_accuracy)
        print(format_table(report["eval"]), flush=True)
    if conf.export:
        report["exports"] = export_all(out, target, heads, base_model)
    print(f"report: {write_report(report, out)}", flush=True)
    if conf.eval.enabled:
        log_eval(accelerator, report["eval"], out / "acceptance.png", step)
    return report


def load_saved_run(output_dir: str | Path, overrides: list[str] = (), drafter: str | Path | None = None):
    """A finished run's config (with ``key=value`` overrides), target and trained heads.

    The target is the stage-2 export when the run had one, else the run's original target. The heads are the
    run's ``medusa_heads``, or those of ``drafter``: an export folder (``export/vllm``, ``export/tgi``),
    relative to ``output_dir`` or absolute, read back by its strict loader, so what will be served is measured.
    Raises ``FileNotFoundError`` when ``output_dir`` holds no finished run, ``ValueError`` when the heads
    do not fit the target.
    """
    from omegaconf import OmegaConf

    from models.export.medusa import load_any_heads, load_heads
    from models.target import TargetSpec, load_target
    from train.config import MedusaRunConfig

    out = Path(output_dir)
    if not (out / "config.yaml").exists() or not (out / "medusa_heads").exists():
        raise FileNotFoundError(f"{out} holds no finished Medusa run (config.yaml and medusa_heads/ expected)")
    cfg = OmegaConf.merge(OmegaConf.structured(MedusaRunConfig), OmegaConf.load(out / "config.yaml"),
                          OmegaConf.from_dotlist(list(overrides)))
    conf: MedusaRunConfig = OmegaConf.to_object(cfg)
    heads, extra = load_heads(out / "medusa_heads")
    if drafter is not None:
        heads = load_any_heads(out / drafter)
    spec = conf.model
    if Path(extra["base_model"]).is_dir() and (Path(extra["base_model"]) / "config.json").exists():
        spec = TargetSpec(name_or_path=extra["base_model"], dtype=conf.model.dtype)
    target, tokenizer, path = load_target(spec, conf.cache_dir)
    heads.check_target(target.config.hidden_size, target.config.vocab_size, where=path)
    return conf, target, tokenizer, heads.to(target.device).eval(), extra
