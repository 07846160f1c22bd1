"""The data-scaling curve: held-out tau against the rows a drafter trains on, each drafter's default job under
``+experiment=general`` (the target's own prompts and chitchat's, answered by the target) at growing sizes.

    python tests/benchmarks/bench_data_scaling.py                                  # medusa, eagle3 at 384..4096
    python tests/benchmarks/bench_data_scaling.py drafters=medusa rows=384,1024 out=runs/scaling
    python tests/benchmarks/bench_data_scaling.py rows=8192 trainer.lr=3e-3        # any other key: to every job

Each point is a whole job in its own process (``accelerate launch train/<drafter>.py``, output
``<out>/<drafter>-<rows>``, its log and times beside it), so a killed point resumes as any run does
(``resume=true``); a point whose run finished its evaluation is read back, not run again, so the curve grows over
several invocations. A larger point reuses the smaller points'
answers and self-made prompts from the cache (``data/regenerate.py``'s settings key; ``data/self_made.py``'s
batches), so it pays only for its new rows, as long as every point generates with the same settings and engine
(``data.generation.*`` is part of what makes an answer). Per point: tau with its 95% interval over prompts on held-out
general, chitchat and HumanEval prompts, greedy and at T=0.7, prompt lookup's greedy tau on the general set, and
the CPU-hours and wall-clock hours the job took (measured when it ran, read back after). Writes
``<out>/scaling.json`` (every point measured so far), ``<out>/scaling.md`` (the table for docs/data.md) and
``<out>/scaling.png``.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETS = ("general", "chitchat", "humaneval")
TEMPERATURES = ("", "@T0.7")  # the report's set names: greedy, then sampled


def run_point(drafter: str, rows: int, out: Path, overrides: list[str]) -> dict:
    """Train and evaluate ``drafter`` on ``rows`` training rows (or read back a finished run): the point's
    numbers. Raises ``RuntimeError`` naming the log when the job fails."""
    from draftheads.run_folder import finished_steps, read_report

    run = out / f"{drafter}-{rows}"
    timing, log = out / f"{drafter}-{rows}.timing.json", out / f"{drafter}-{rows}.log"
    finished = finished_steps(run)
    if "evaluation" not in (finished or []):
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
        with open(log, "a") as f:
            done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1",
                                   str(ROOT / "train" / f"{drafter}.py"), "+experiment=general",
                                   f"data.num_train_prompts={rows}", f"output_dir={run}", "tracker=none",
                                   *(["resume=true"] if finished is not None else []), *overrides],
                                  cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        spent = json.loads(timing.read_text()) if timing.exists() else {"cpu_hours": 0.0, "wall_hours": 0.0}
        spent["cpu_hours"] += (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / 3600
        spent["wall_hours"] += (time.time() - start) / 3600  # a killed invocation's share is lost, not guessed
        timing.write_text(json.dumps(spent))
        if done.returncode:
            raise RuntimeError(f"{drafter} at {rows} rows failed (exit {done.returncode}): see {log}")
    report = read_report(run)
    point = {"drafter": drafter, "rows": rows, "run": str(run),
             **(json.loads(timing.read_text()) if timing.exists() else {}), "tau": {}}
    for name in SETS:
        for suffix in TEMPERATURES:
            m = report.get("eval", {}).get(name + suffix)
            if m is None:
                continue
            peers = m.get("peers", {})
            point["tau"][name + suffix] = {"tau": m["acceptance_length"],
                                           "interval": m["intervals"]["acceptance_length"],
                                           "method": m["method"],
                                           "own_methods": {k: p["acceptance_length"] for k, p in peers.items()
                                                           if "@" not in k and k != "prompt_lookup"}}
            lookup = peers.get("prompt_lookup")
            if lookup and name == "general" and not suffix:
                point["prompt_lookup_general"] = lookup["acceptance_length"]
    return point


def table(points: list[dict]) -> str:
    """The markdown table of every point: greedy and T=0.7 tau [95%] per set, CPU-hours."""
    head = ["drafter", "rows"] + [f"{s}{' T=0.7' if t else ''}" for s in SETS for t in TEMPERATURES]
    tail = ["its other methods, general T0", "prompt lookup, general", "CPU-h", "wall h"]
    lines = ["| " + " | ".join(head + tail) + " |", "|" + " --- |" * (len(head) + len(tail))]
    for p in sorted(points, key=lambda p: (p["drafter"], p["rows"])):
        cells = [p["drafter"], str(p["rows"])]
        for s in SETS:
            for t in TEMPERATURES:
                m = p["tau"].get(s + t)
                cells.append("-" if m is None else f"{m['tau']:.2f} [{m['interval'][0]:.2f}, {m['interval'][1]:.2f}]")
        others = p["tau"].get("general", {}).get("own_methods", {})
        cells += [", ".join(f"{k} {v:.2f}" for k, v in others.items()) or "-",
                  f"{p.get('prompt_lookup_general', float('nan')):.2f}", f"{p.get('cpu_hours', float('nan')):.2f}",
                  f"{p.get('wall_hours', float('nan')):.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    """tau on the general set against rows (log scale), one line per drafter and temperature, 95% intervals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in sorted({p["drafter"] for p in points}):
        mine = sorted((p for p in points if p["drafter"] == drafter), key=lambda p: p["rows"])
        for suffix, style in zip(TEMPERATURES, ("-o", "--s")):
            have = [p for p in mine if "general" + suffix in p["tau"]]
            if not have:
                continue
            taus = [p["tau"]["general" + suffix] for p in have]
            ax.errorbar([p["rows"] for p in have], [t["tau"] for t in taus], fmt=style, capsize=3,
                        yerr=[[t["tau"] - t["interval"][0] for t in taus], [t["interval"][1] - t["tau"] for t in taus]],
                        label=f"{taus[0]['method']} ({'greedy' if not suffix else 'T=0.7'})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("training rows (self-made + chitchat, answered by the target)")
    ax.set_ylabel("tau on held-out general prompts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> None:
    own = ("out", "drafters", "rows")
    args = dict(a.split("=", 1) for a in argv if a.split("=", 1)[0] in own)
    overrides = [a for a in argv if a.split("=", 1)[0] not in own]  # to every job
    out = Path(args.get("out", "runs/scaling")).resolve()
    drafters = args.get("drafters", "medusa,eagle3").split(",")
    sizes = [int(r) for r in args.get("rows", "384,1024,2048,4096").split(",")]
    out.mkdir(parents=True, exist_ok=True)
    results = out / "scaling.json"
    points = {(p["drafter"], p["rows"]): p for p in json.loads(results.read_text())} if results.exists() else {}
    for rows in sizes:  # every drafter at a size before the next size: answers are made once per size
        for drafter in drafters:
            point = run_point(drafter, rows, out, overrides)
            points[drafter, rows] = point
            results.write_text(json.dumps(list(points.values()), indent=1))
            general = point["tau"].get("general", {})
            print(f"{drafter} at {rows} rows: general tau {general.get('tau', float('nan')):.2f} "
                  f"{general.get('interval')}, {point.get('cpu_hours', float('nan')):.2f} CPU-h", flush=True)
    (out / "scaling.md").write_text(table(list(points.values())))
    plot(list(points.values()), out / "scaling.png")
    print(table(list(points.values())))


if __name__ == "__main__":
    main(sys.argv[1:])
