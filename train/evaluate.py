"""Speculative evaluation of a finished run's drafter (the same evaluator the training run ends with).

    python train/evaluate.py runs/medusa
    python train/evaluate.py run_dir=runs/medusa drafter=export/vllm eval.temperatures=[0,0.7]
    python train/evaluate.py run_dir=runs/medusa 'eval.peers=[medusa_tree]' eval.medusa_choices='[[0],[0,0],[1]]'
    python train/evaluate.py runs/dflash eval.temperatures=[0.7] dflash.denoise_steps=8
    python train/evaluate.py runs/medusa 'eval.sets=[{name: gsm8k, source: hub, path: openai/gsm8k, subset: main, split: test, num_prompts: 50}]'

``run_dir`` (or the first argument) is the run; ``drafter`` an export folder to measure instead of the run's
own (``export/vllm``, ``export/tgi``: read back by their strict loaders; a DFlash run is measured from
``export/dflash`` by default). Other ``key=value`` pairs override the run's saved config. Updates the run's
``report.json`` and plot: the sets measured replace those of the same name (each says which ``drafter`` it
measured), others are kept, and ``evaluations`` records every invocation (overrides, eval config, hardware).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from train.evaluation import format_table, hardware, write_report
from train.finish import evaluate_heads, load_eval_sets, load_saved_run


def parse_args(argv: list[str], options: tuple[str, ...], usage: str) -> tuple[Path, dict[str, str], list[str]]:
    """``(run_dir, {option: value}, config overrides)`` from ``argv``: the run as ``run_dir=`` or the first
    argument, ``key=value`` for each of ``options``, every other argument an override of the run's config.
    Raises ``SystemExit`` with ``usage`` when no run is given."""
    keys = tuple(f"{k}=" for k in ("run_dir", *options))
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith(keys)}
    rest = [a for a in argv if not a.startswith(keys)]
    if "run_dir" not in args:
        if not rest or "=" in rest[0]:
            raise SystemExit(usage)
        args["run_dir"], rest = rest[0], rest[1:]
    return Path(args.pop("run_dir")), args, rest


def main(argv: list[str]) -> dict:
    out, options, overrides = parse_args(argv, ("drafter",), __doc__)
    drafter = options.get("drafter")
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if (out / "export" / "dflash").exists():
        from models.target import model_identity
        from train.dflash import evaluate_dflash, load_medusa_peer, load_saved_run as load_dflash_run
        conf, target, tokenizer, model = load_dflash_run(out, overrides, drafter)
        medusa = load_medusa_peer(conf.dflash.medusa_run, model_identity(target, conf.model))
        sets = evaluate_dflash(conf, load_eval_sets(conf.eval), target, tokenizer, model, medusa)
    else:
        conf, target, tokenizer, heads, _ = load_saved_run(out, overrides, drafter)
        sets = evaluate_heads(conf.eval, load_eval_sets(conf.eval), target, tokenizer, heads,
                              report.get("head_rank_accuracy"))
    source = str(out / drafter) if drafter else "run"
    for m in sets.values():
        m["drafter"] = source
    report["eval"] = {**report.get("eval", {}), **sets}
    report.setdefault("evaluations", []).append({
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "drafter": source, "overrides": overrides,
        "sets": sorted(sets), "eval": json.loads(json.dumps(asdict(conf.eval))), "hardware": hardware(),
        "dtype": conf.model.dtype})
    print(format_table(sets))
    print(f"report: {write_report(report, out)}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
