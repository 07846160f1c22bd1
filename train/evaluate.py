"""Speculative evaluation of a finished run's drafter (the same evaluator the training run ends with).

    python train/evaluate.py runs/medusa
    python train/evaluate.py runs/dflash eval.temperatures=[0,0.7] dflash.denoise_steps=8
    python train/evaluate.py runs/medusa eval.max_new_tokens=128 'eval.sets=[{name: mt, source: jsonl, path: question.jsonl, num_prompts: 80}]'

Overrides are ``key=value`` pairs on the run's saved config. Updates ``report.json`` and the plot.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from train.evaluation import format_table, hardware, write_report
from train.finish import evaluate_heads, load_eval_sets, load_saved_run


def main(argv: list[str]) -> dict:
    if not argv:
        raise SystemExit(__doc__)
    out = Path(argv[0])
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    if (out / "export" / "dflash").exists():
        from models.target import model_identity
        from train.dflash import evaluate_dflash, load_medusa_peer, load_saved_run as load_dflash_run
        conf, target, tokenizer, drafter = load_dflash_run(out, argv[1:])
        medusa = load_medusa_peer(conf.dflash.medusa_run, model_identity(target, conf.model))
        sets = evaluate_dflash(conf, load_eval_sets(conf.eval), target, tokenizer, drafter, medusa)
    else:
        conf, target, tokenizer, heads, _ = load_saved_run(out, argv[1:])
        sets = evaluate_heads(conf.eval, load_eval_sets(conf.eval), target, tokenizer, heads,
                              report.get("head_rank_accuracy"))
    report["eval"] = {**report.get("eval", {}), **sets}  # sets measured before and not re-run are kept
    report.setdefault("config", {})["eval"] = json.loads(json.dumps(asdict(conf.eval)))
    report["hardware"] = hardware()
    print(format_table(sets))
    print(f"report: {write_report(report, out)}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
