"""Each drafter's default job trained under each objective, position weighting and optimizer worth a run, side
by side on the same rows, steps and seed (not part of the test run).

    python tests/benchmarks/bench_objectives.py                       # every drafter, every setting below
    python tests/benchmarks/bench_objectives.py --drafters dflash --settings ce,dpace
    python tests/benchmarks/bench_objectives.py --drafters eagle3 --settings fp8_cache,fp8_cache+seed1
    python tests/benchmarks/bench_objectives.py --table               # the table of the runs already made

Each run is ``python train/<drafter>.py`` (its default config on chitchat's rows, ``data=chitchat``, as every table
of docs/objectives.md was measured: SmolLM2, the target's regenerated answers, seed 0) with the setting's overrides
and :data:`BUDGET`'s shorter training (the same for every setting of a drafter), evaluation off; then ``python
train/evaluate.py`` on it at temperatures 0 and 0.7 on the shipped held-out sets (:data:`EVAL`). The runs stay in
``--out`` (default ``runs/bench_objectives``); a finished one is not trained again.

Columns: ``tau`` the acceptance length as the servers count it on each set at T=0 and T=0.7 (the drafter's
chain; for Medusa also its tree), ``alpha per position`` the chitchat chain's acceptance rate at positions 1-5 at
T=0, ``val loss`` the held-out teacher-forced loss (each objective's own: comparable within a row's objective
only), ``CPU s/epoch`` the training process's user + system CPU seconds (``wait4``; start, target load, states,
training and save) per training epoch, ``cache MiB`` the state cache's size on disk for a run that trains from
one (its writing not counted in the CPU seconds). A last line ``RESULTS <json>`` carries every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = {
    "ce": ["{d}.loss=ce", "{d}.position_weights=decay"],
    "dpace": ["{d}.loss=ce", "{d}.position_weights=dpace"],
    "kl": ["{d}.loss=kl"],
    "lk_hybrid": ["{d}.loss=lk_hybrid"],
    "lk_dpace": ["{d}.loss=lk_hybrid", "{d}.position_weights=dpace"],
    "muon": ["trainer.optimizer=muon"],
    "adamw": ["trainer.optimizer=adamw"],
    "noise": ["{d}.feature_noise=0.05"],
    "eagle31": ["eagle3.norm_before_fc=true", "eagle3.norm_output=true"],
    "eagle30": ["eagle3.norm_before_fc=false", "eagle3.norm_output=false"],
    "mixture": ["data.mixture=[{source: chitchat, weight: 3}, {source: humaneval, weight: 1}]"],
    "bf16_cache": ["data.target_states=disk", "data.target_states_dtype=bfloat16"],
    "fp8_cache": ["data.target_states=disk", "data.target_states_dtype=float8_e4m3fn"],
    "seed1": ["trainer.seed=1"],
}
"""Named settings (``{d}``: the drafter's config section). ``eagle31`` (speculators' EAGLE-3.1, EAGLE-3's default
since 2026-12-03) and ``eagle30`` (without its norms, the default before: join it to reproduce the rows measured
then) are EAGLE-3's only; ``adamw`` is the other drafters' optimizer, EAGLE-3's before 2026-12-04 (Muon since);
``mixture`` trains on chitchat and HumanEval's training rows, 3:1, instead of chitchat alone; ``bf16_cache`` and
``fp8_cache`` train from a state cache in that dtype, written first into the run's folder by
``train/cache_hidden_states.py``; ``seed1`` another seed, for run-to-run spread. Settings joined by ``+``
(``fp8_cache+seed1``) apply together. ``ce`` is cross-entropy with the papers' decaying position weights (Medusa's and
EAGLE-3's default; DFlash's default is ``dpace``, DSpark's a mix of ``ce`` and ``tv``); every other setting
changes only what it names, over the drafter's default."""

BUDGET = {
    "medusa": ["stage1.epochs=1", "stage2.enabled=false"],
    "dflash": ["train.epochs=3"],
    "eagle3": ["train.epochs=2"],
    "dspark": ["dspark.init_from=null", "train.epochs=3"],
}
"""Each drafter's shorter training for the comparison, from random weights (the default jobs train 2 + 0.4, 10, 5
epochs, and DSpark's 3 from the DFlash job's drafter)."""

EPOCHS = {"medusa": 1, "dflash": 3, "eagle3": 2, "dspark": 3}

EVAL = ["eval.temperatures=[0.0,0.7]", "eval.max_new_tokens=48",
        "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 12}, "
        "{name: humaneval, source: humaneval, num_prompts: 8}]", "eval.peer_runs=[]", "eval.peers=null"]
"""Held-out sets of 12 chitchat and 8 HumanEval prompts, greedy and sampled (the jobs' own sizes are in
conf/eval/builtin.yaml)."""


def run(drafter: str, setting: str, out: Path, extra: list[str]) -> dict:
    """Train (unless finished) and evaluate one run; its numbers."""
    folder = out / f"{drafter}_{setting}"
    overrides = (["data=chitchat"] + [o.format(d=drafter) for name in setting.split("+") for o in SETTINGS[name]]
                 + BUDGET[drafter] + extra)
    report_path = folder / "report.json"
    record_path = folder / "bench.json"
    if not record_path.exists():
        env = {**os.environ, "WANDB_MODE": "offline"}
        cache_mib = None
        if "data.target_states=disk" in overrides:  # the state cache first, in the run's folder (not timed)
            with open(out / f"{drafter}_{setting}.cache.log", "w") as log:
                subprocess.run([sys.executable, str(ROOT / "train" / "cache_hidden_states.py"), "--config-name",
                                drafter, *overrides, f"output_dir={folder}", "overwrite=true"], cwd=ROOT, env=env,
                               stdout=log, stderr=subprocess.STDOUT, check=True)
            cache_mib = sum(f.stat().st_size for f in (folder / "hidden_states").iterdir()) / 2**20
        cmd = [sys.executable, str(ROOT / "train" / f"{drafter}.py"), *overrides, f"output_dir={folder}",
               "tracker=none", "eval.enabled=false", "overwrite=true"]
        start = time.time()
        with open(out / f"{drafter}_{setting}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: see {out / f'{drafter}_{setting}.log'}")
        cpu = usage.ru_utime + usage.ru_stime
        subprocess.run([sys.executable, str(ROOT / "train" / "evaluate.py"), str(folder), *EVAL], cwd=ROOT, env=env,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        record_path.write_text(json.dumps({"cpu_s": cpu, "wall_s": time.time() - start, "overrides": overrides,
                                           "cache_mib": cache_mib}))
    record = json.loads(record_path.read_text())
    report = json.loads(report_path.read_text())
    return {"drafter": drafter, "setting": setting, "overrides": record["overrides"],
            "cpu_s_per_epoch": record["cpu_s"] / EPOCHS[drafter], "cache_mib": record.get("cache_mib"),
            "validation": report["validation"],
            "eval": {name: _summary(s) for name, s in report["eval"].items()}}


def _summary(result: dict) -> dict:
    """The chain's tau and acceptance per position, and each peer's tau."""
    return {"method": result["method"], "tau": result["acceptance_length"],
            "alpha": result["acceptance_rate_per_position"], "greedy_match": result.get("greedy_match"),
            "peers": {n: p["acceptance_length"] for n, p in result.get("peers", {}).items()}}


def table(results: list[dict]) -> str:
    head = (f"{'drafter':8} {'setting':16} {'method':13} {'chitchat T0':>11} {'T0.7':>6} {'humaneval T0':>12} "
            f"{'T0.7':>6}  {'alpha per position (chitchat, T0)':34} {'val loss':>8} {'CPU s/epoch':>11} "
            f"{'cache MiB':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        e = r["eval"]
        loss = next((v for k, v in r["validation"].items() if k.endswith("_loss") and "head" not in k),
                    r["validation"].get("val/head1_loss", float("nan")))
        methods = [e["chitchat"]["method"]] + [m for m in e["chitchat"]["peers"] if m.startswith("medusa_tree")][:1]
        for i, m in enumerate(methods):
            taus = []
            for name in ("chitchat", "chitchat@T0.7", "humaneval", "humaneval@T0.7"):
                s = e.get(name)
                if s is None or (m != s["method"] and m not in s["peers"]):
                    taus.append(float("nan"))
                    continue
                taus.append(s["tau"] if m == s["method"] else s["peers"][m])
            alpha = " ".join(f"{a:.2f}" for a in e["chitchat"]["alpha"][:5]) if i == 0 else ""
            lines.append(f"{r['drafter'] if i == 0 else '':8} {r['setting'] if i == 0 else '':16} {m:13} "
                         f"{taus[0]:11.2f} {taus[1]:6.2f} {taus[2]:12.2f} {taus[3]:6.2f}  {alpha:34} "
                         + (f"{loss:8.3f} {r['cpu_s_per_epoch']:11.0f} {r.get('cache_mib') or float('nan'):9.1f}"
                            if i == 0 else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="medusa,dflash,eagle3,dspark")
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_objectives"))
    parser.add_argument("--table", action="store_true", help="print the runs already made, train nothing")
    parser.add_argument("overrides", nargs="*", help="more overrides for every run (e.g. +experiment=smoke)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.table:  # the rows regenerated (and cached) once, before any run is timed
        subprocess.run([sys.executable, str(ROOT / "train" / "medusa.py"), "stage1.max_steps=1", "stage2.enabled=false",
                        "eval.enabled=false", "export=false", "tracker=none", "overwrite=true",
                        f"output_dir={out / '_rows'}", *args.overrides], cwd=ROOT, check=True)
    results = []
    for drafter in args.drafters.split(","):
        for setting in args.settings.split(","):
            if args.table and not (out / f"{drafter}_{setting}" / "bench.json").exists():
                continue
            results.append(run(drafter, setting, out, args.overrides))
            print(f"done: {drafter} {setting}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs")
    print(table(results))
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
