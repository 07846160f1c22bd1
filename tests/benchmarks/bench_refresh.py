"""A drafter refreshed after its target changed (warm start, ``<drafter>.init_from``) against one trained from
scratch for the same steps on the same rows, on the changed target (not part of the test run; docs/refresh.md).

    python tests/benchmarks/bench_refresh.py                          # Medusa, DFlash and EAGLE-3 on SmolLM2
    python tests/benchmarks/bench_refresh.py --drafters dflash --medusa-run runs/medusa
    python tests/benchmarks/bench_refresh.py --drafters dflash --settings refresh,scratch   # not the stale drafter
    python tests/benchmarks/bench_refresh.py --table                  # the table of the runs already made
    python tests/benchmarks/bench_refresh.py --smoke --out /tmp/bench_refresh_smoke   # the tiny target, minutes

The old target is the jobs' default (SmolLM2). The changed target is a Medusa run's stage-2 target
(``export/target`` of ``--medusa-run``: its last decoder layers trained on, the rest as they were), made with
``train/medusa.py``'s defaults in ``--out`` when no run is named. Per drafter, each ``python train/<drafter>.py``
(its default config, seed 0, evaluation off), then ``python train/evaluate.py`` on the changed target at
temperatures 0 and 0.7 on the shipped held-out sets (``EVAL`` of bench_objectives.py):

- ``old``: trained on the old target (:data:`OLD`: bench_objectives' budgets), the source of the refresh;
- ``stale``: ``old``'s drafter on the changed target as it is (warm-started, one step at lr 1e-12): what serving
  it unchanged would accept;
- ``refresh``: warm-started from ``old``, :data:`REFRESH` on the changed target's own answers;
- ``scratch``: random weights, the same :data:`REFRESH` steps on the same rows.

Columns as bench_objectives' (tau on each set at T=0 and T=0.7, the chain's alpha per position, held-out loss,
CPU seconds per training epoch); a last line ``RESULTS <json>`` carries every number. The runs stay in ``--out``
(default ``runs/bench_refresh``); a finished one is not trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_objectives import BUDGET, EVAL, _summary, table  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

STAGE = {"medusa": "stage1"}
"""The stage a drafter's steps are counted in (``train`` for every drafter of one stage)."""

OLD = BUDGET
"""The source run's training on the old target (bench_objectives' budgets; Medusa without stage 2: its heads)."""

REFRESH = {"medusa": ["stage1.epochs=0.5", "stage2.enabled=false"], "dflash": ["train.epochs=1"],
           "eagle3": ["train.epochs=1"], "dspark": ["dspark.init_from=null", "train.epochs=1"]}
"""The refresh's training, and the scratch run's (equal steps: the same rows, epochs and batches; from random
weights unless the refresh names its source)."""

SMOKE = ["+experiment=smoke"]
"""``--smoke``: the tiny random target, a few steps per run, a few prompts evaluated (proves the script runs)."""
SMOKE_EVAL = ["eval.temperatures=[0.0]", "eval.max_new_tokens=16", "eval.peer_runs=[]",
              "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]"]


def settings(drafter: str, old: Path, smoke: bool) -> dict[str, list[str]]:
    """Each run's overrides beyond the changed target: ``old`` (the source run's folder) is warm-started from."""
    stage = STAGE.get(drafter, "train")
    refresh = REFRESH[drafter] + ([f"{stage}.max_steps=2"] if smoke else [])
    return {"stale": REFRESH[drafter] + [f"{stage}.max_steps=1", "trainer.lr=1e-12", f"{drafter}.init_from={old}"],
            "refresh": refresh + [f"{drafter}.init_from={old}"], "scratch": refresh}


def train(drafter: str, folder: Path, overrides: list[str], log: Path) -> float:
    """``python train/<drafter>.py`` into ``folder`` (unless finished); its CPU seconds (0 when already made)."""
    if (folder / "bench.json").exists():
        return json.loads((folder / "bench.json").read_text())["cpu_s"]
    cmd = [sys.executable, str(ROOT / "train" / f"{drafter}.py"), *overrides, f"output_dir={folder}", "tracker=none",
           "eval.enabled=false", "overwrite=true"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"}, stdout=out,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: see {log}")
    return usage.ru_utime + usage.ru_stime


def measure(drafter: str, setting: str, folder: Path, overrides: list[str], epochs: float, eval_overrides: list[str],
            out: Path) -> dict:
    """Train (unless finished) and evaluate one run on the changed target; its numbers."""
    if not (folder / "bench.json").exists():
        cpu = train(drafter, folder, overrides, out / f"{drafter}_{setting}.log")
        subprocess.run([sys.executable, str(ROOT / "train" / "evaluate.py"), str(folder), *eval_overrides], cwd=ROOT,
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (folder / "bench.json").write_text(json.dumps({"cpu_s": cpu, "overrides": overrides}))
    record, report = (json.loads((folder / name).read_text()) for name in ("bench.json", "report.json"))
    return {"drafter": drafter, "setting": setting, "overrides": record["overrides"],
            "cpu_s_per_epoch": record["cpu_s"] / epochs, "validation": report["validation"],
            "init_from": report.get("init_from"), "eval": {n: _summary(s) for n, s in report["eval"].items()}}


def changed_target(medusa_run: Path | None, out: Path, overrides: list[str]) -> Path:
    """The stage-2 target of ``medusa_run``, or of a Medusa run made in ``out`` with the defaults (and
    ``overrides``) when none is named."""
    run = medusa_run or out / "medusa_target"
    target = run / "export" / "target"
    if not (target / "config.json").is_file():
        if medusa_run is not None:
            raise SystemExit(f"{target}: no stage-2 target (a finished Medusa run with stage 2 holds one)")
        train("medusa", run, overrides + ["export=true"], out / "medusa_target.log")
    return target.resolve()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", default="medusa,dflash,eagle3")
    parser.add_argument("--medusa-run", default=None, help="a finished Medusa run whose stage-2 target is the changed "
                                                           "target (default: one made in --out)")
    parser.add_argument("--settings", default="stale,refresh,scratch", help="the runs per drafter, of these")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_refresh"))
    parser.add_argument("--smoke", action="store_true", help="the tiny target, a few steps, a few prompts")
    parser.add_argument("--table", action="store_true", help="print the runs already made, train nothing")
    parser.add_argument("overrides", nargs="*", help="more overrides for every training run")
    args = parser.parse_args()
    unknown = set(args.settings.split(",")) - {"stale", "refresh", "scratch"}
    if unknown:
        parser.error(f"--settings: unknown {sorted(unknown)}; the runs are stale, refresh and scratch")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = (SMOKE if args.smoke else []) + args.overrides
    eval_overrides = SMOKE_EVAL if args.smoke else EVAL
    target = None if args.table else changed_target(args.medusa_run and Path(args.medusa_run), out,
                                                    extra + (["stage1.max_steps=2", "stage2.max_steps=2"]
                                                             if args.smoke else []))
    results = []
    for drafter in args.drafters.split(","):
        old = out / f"{drafter}_old"
        steps = ([f"{STAGE.get(drafter, 'train')}.max_steps=2"] if args.smoke else [])
        if not args.table and not (old / "bench.json").exists():  # the source, on the old target
            cpu = train(drafter, old, OLD[drafter] + steps + extra, out / f"{drafter}_old.log")
            (old / "bench.json").write_text(json.dumps({"cpu_s": cpu, "overrides": OLD[drafter] + steps + extra}))
        for setting, overrides in settings(drafter, old, args.smoke).items():
            if setting not in args.settings.split(","):
                continue
            folder = out / f"{drafter}_{setting}"
            if args.table and not (folder / "bench.json").exists():
                continue
            epochs = next(float(o.split("=")[1]) for o in REFRESH[drafter] if ".epochs=" in o)
            runs = overrides + extra + ([] if target is None else [f"model.name_or_path={target}"])
            results.append(measure(drafter, setting, folder, runs, epochs, eval_overrides, out))
            print(f"done: {drafter} {setting}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    print(f"commit {commit}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs; changed target {target}")
    print(table(results))
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
