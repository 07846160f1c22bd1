"""Draftheads' Medusa stage 1 beside the reference trainer, FasterDecoding/Medusa as published on PyPI (``medusa-llm``
0.1), on the same training rows and settings (not part of the test run).

    python tests/benchmarks/bench_reference.py                        # SmolLM2-135M, the Medusa job's rows, 2 epochs
    python tests/benchmarks/bench_reference.py epochs=1 trainer.lr=1e-3   # any override of conf/medusa.yaml
    python tests/benchmarks/bench_reference.py max_steps=2 data.num_train_prompts=64 data.num_val_prompts=8 \
        eval.max_new_tokens=16                                        # a check in minutes (bench_training's rows)

``epochs=`` (default 2) and ``max_steps=`` are draftheads' ``stage1.epochs`` and ``stage1.max_steps``; every other
argument overrides ``conf/medusa.yaml`` for both trainers. The reference's environment is made on first use
(``$DRAFTHEADS_CACHE/medusa-ref-venv``, ~1 GB: the CPU torch, transformers 4.34.1 of its time, ``medusa-llm`` and
``fschat`` without their dependencies); ``reference_medusa_driver.py`` runs there its ``MedusaModel`` and
``CustomizedTrainer`` (an HF Trainer) as its ``train()`` does, on the job's training rows (``job_rows``: the
self-distilled answers, cached; never the held-out rows) instead of its fastchat/vicuna preprocessing: labels -100
off the loss mask, every row padded, as that preprocessing pads to ``model_max_length``, to the longest training row
(the least padding that cuts no row). Its target is draftheads' converted folder carried to transformers 4.34
(:func:`reference_model`). Draftheads runs ``train/medusa.py`` with stage 2, evaluation and export off.

Shared: heads, residual layers, learning rate, batch size, gradient accumulation, weight decay, clipping, seed, the
optimizer step count (draftheads' for the epochs, capped by ``max_steps``), AdamW with as many warmup steps and then
cosine decay, bf16 autocast when ``trainer.mixed_precision=bf16`` (the default; the reference's README trains with
``--bf16 True``), and the heads: each with its own LM head (V x D, from the target's), the heads' losses summed
undecayed (:data:`SAME_HEADS`; draftheads' default shares the target's frozen LM head, head k's loss weighted
0.8^k). Each trainer's own, and measured with it: the reference loads the target in bfloat16 (its ``train()``
hard-codes it), runs it on every batch and trains bfloat16 heads; draftheads computes the target's states once and
trains float32 heads.

Both sets of heads are then measured here with one target: validated on the job's held-out rows, and evaluated
by draftheads' evaluator on the run's held-out eval prompts (greedy, the heads' chain; no tree, which would grow
from draftheads' heads' accuracies for both, no prompt lookup); the reference's read back by the strict TGI-layout
loader.

Columns: ``steps`` optimizer steps; ``epochs`` those steps in passes over the training rows; ``wall s/ep`` and
``CPU s/ep`` the trainer's whole process (start, target load, rows, target states, training, saving) in wall seconds
and in user + system CPU seconds (its ``wait4`` usage, its children's included) per epoch; ``peak GiB`` its peak
resident memory; ``trainable`` its trained parameters; ``tau`` the chain's acceptance length on the chitchat set,
``alpha`` its acceptance rate per draft position, ``greedy`` the share of prompts whose output equals plain greedy
decoding (1: verification is lossless); then each head's top-1 accuracy on the held-out rows. The ``ratio`` row is
reference / draftheads. Both runs stay in the work folder printed first (logs, heads). A last line
``RESULTS <json>`` carries every number, every eval set's included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from safetensors.torch import save_file

from draftheads.data.batching import BatchPlan, collate
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.drafters import register_configs
from draftheads.drafters.medusa.validation import validate
from draftheads.evaluation.methods import load_eval_sets
from draftheads.runs.life import close_job, evaluate_drafter, open_job
from draftheads.runs.rows import job_rows
from draftheads.runs.saved import open_run

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("reference_medusa_driver.py")

TORCH = "torch==2.13.0"
"""Installed first and alone, at the version this machine's index holds as a CPU wheel (a bare ``torch`` from PyPI
is the multi-GB CUDA build)."""
REFERENCE = ["transformers==4.34.1", "accelerate==0.24.1", "tokenizers==0.14.1"]
"""Of the reference's time (October 2023; ``medusa-llm`` pins nothing): its ``modeling_llama_kv`` imports
transformers' Llama internals of then."""
NO_DEPS = ["fschat==0.2.36", "medusa-llm==0.1"]
"""Without their dependencies: unpinned, they would pull today's transformers; fschat's (servers, UI) are never
imported by the trainer."""

FIXED = ["tracker=none", "eval.enabled=false", "stage2.enabled=false", "export=false", "trainer.tokens_per_batch=null"]
"""Stage 1 only, on batches of ``trainer.batch_size`` rows as the reference's; draftheads' evaluation runs here
afterwards, for both trainers alike."""
SAME_HEADS = ["medusa.per_head_lm_head=true", "medusa.position_decay=1.0"]
"""Draftheads trains the reference's heads by default here (each its own LM head, losses summed undecayed);
overrides after them choose draftheads' own (``medusa.per_head_lm_head=false medusa.position_decay=0.8``)."""
EVAL = ["eval.enabled=true", "tree.enabled=false", "eval.prompt_lookup_tokens=0"]
OPTIONS = ("epochs=", "max_steps=")
IGNORE_INDEX = -100
"""The label the reference's CrossEntropyLoss ignores (transformers' ``LabelSmoother.ignore_index``)."""

register_configs()


def ensure_reference(venv: str | Path | None = None) -> Path:
    """The reference environment's python, the environment made (a few minutes) when it cannot import the
    reference trainer; ``venv`` None: ``$DRAFTHEADS_CACHE/medusa-ref-venv`` (``~/.cache/draftheads/...``)."""
    if venv is None:
        cache = os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads")
        venv = Path(cache).expanduser() / "medusa-ref-venv"
    python = Path(venv) / "bin" / "python"
    probe = [python, "-c", "import medusa.train.train"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating the reference Medusa environment at {venv} (a few minutes, ~1 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, *REFERENCE], check=True)
    subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
    subprocess.run(probe, check=True)
    return python


def job_config(overrides: list[str]):
    """``conf/medusa.yaml`` composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("medusa", overrides=overrides)


def reference_model(target_path: str, folder: Path) -> Path:
    """Draftheads' safetensors folder of the target as transformers 4.34 reads it, every other file linked:
    ``rope_parameters`` back to 4.34's ``rope_theta`` (else it rotates with its default 10000) and ``dtype`` to
    ``torch_dtype``; the tokenizer, which ``MedusaModel`` loads, as a ``PreTrainedTokenizerFast`` whose BPE merges
    are ``"a b"`` strings, the only form tokenizers 0.14 parses. Raises ``ValueError`` for a rotation other than the
    default one."""
    source = Path(target_path)
    folder.mkdir(parents=True)
    config = json.loads((source / "config.json").read_text())
    rope = config.pop("rope_parameters")
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{source}: rope_type {rope['rope_type']!r}; only the default rotation is carried to 4.34")
    config |= {"rope_theta": rope["rope_theta"], "torch_dtype": config.pop("dtype")}
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    merges = tokenizer["model"]["merges"]
    tokenizer["model"]["merges"] = [m if isinstance(m, str) else " ".join(m) for m in merges]
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    for name, content in (("config.json", config), ("tokenizer.json", tokenizer),
                          ("tokenizer_config.json", tokenizer_config)):
        (folder / name).write_text(json.dumps(content, ensure_ascii=False))
    for path in source.iterdir():
        if not (folder / path.name).exists():
            (folder / path.name).symlink_to(path.resolve())
    return folder


def reference_rows(rows: list[dict], width: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """``rows`` as the reference's dataset holds them, ``[N, width]`` each: right-padded to ``width`` (its
    preprocessing pads every row to ``model_max_length``), ``labels`` the ids where ``loss_mask`` is true and
    :data:`IGNORE_INDEX` elsewhere, ``attention_mask`` 1 on the row's tokens."""
    batch = collate(rows, pad_token_id)
    pad = (0, width - batch["input_ids"].shape[1])
    input_ids = F.pad(batch["input_ids"], pad, value=pad_token_id)
    labels = input_ids.masked_fill(~F.pad(batch["loss_mask"], pad), IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": F.pad(batch["attention_mask"], pad)}


@dataclass
class Prepared:
    """What both trainers share, made once."""
    conf: object
    """The composed job config (typed)."""
    steps: int
    """Optimizer steps, draftheads' count for ``stage1.epochs`` capped by ``stage1.max_steps``."""
    epochs: float
    """``steps`` in passes over the training rows."""
    width: int
    """Tokens of the longest training row: the reference's ``model_max_length``, every row padded to it."""
    val_rows: list[dict]
    """Held-out rows with the target's ``hidden_states``."""


def prepare(cfg, work: Path) -> Prepared:
    """The Medusa job's rows as ``train/medusa.py`` makes them (``job_rows``): the training rows written for the
    reference (``work/rows.safetensors``) beside its model folder (``work/model``), the held-out rows kept with their
    target states for validation."""
    job = open_job(cfg)
    train_rows, val_rows, _ = job_rows(job, attach=False)
    conf, pad = job.conf, job.tokenizer.pad_token_id
    attach_hidden_states(job.target, val_rows, conf.data.target_batch_size, pad, show_progress=False)
    width = max(len(r["input_ids"]) for r in train_rows)
    save_file(reference_rows(train_rows, width, pad), str(work / "rows.safetensors"))
    reference_model(job.target_path, work / "model")
    close_job(job, {})
    t = conf.trainer
    plan = BatchPlan(train_rows, 0, 1, t.batch_size, t.tokens_per_batch, t.seed)
    steps = plan.total(conf.stage1.epochs) // t.grad_accum
    steps = min(steps, conf.stage1.max_steps or steps)
    return Prepared(conf, steps, steps * t.grad_accum / plan.count(0), width, val_rows)


def reference_settings(prepared: Prepared, work: Path) -> dict:
    """The driver's settings: the reference's ``TrainingArguments`` for the job's settings (its README's
    ``save_strategy no`` and ``logging_steps 1``; warmup as draftheads counts it, ``int(ratio * steps)``)."""
    conf, steps = prepared.conf, prepared.steps
    t = conf.trainer
    args = {"output_dir": str(work / "reference" / "trainer"), "per_device_train_batch_size": t.batch_size,
            "gradient_accumulation_steps": t.grad_accum, "learning_rate": t.lr, "weight_decay": t.weight_decay,
            "max_grad_norm": t.max_grad_norm, "lr_scheduler_type": "cosine",
            "warmup_steps": int(t.warmup_ratio * steps), "num_train_epochs": conf.stage1.epochs, "max_steps": steps,
            "seed": t.seed, "bf16": t.mixed_precision == "bf16", "fp16": t.mixed_precision == "fp16",
            "use_cpu": not torch.cuda.is_available(), "optim": "adamw_torch", "report_to": "none",
            "save_strategy": "no", "logging_steps": 1, "model_max_length": prepared.width,
            "medusa_num_heads": conf.medusa.num_heads, "medusa_num_layers": conf.medusa.num_layers}
    return {"model": str(work / "model"), "rows": str(work / "rows.safetensors"), "out": str(work / "reference"),
            "args": args}


def timed(command: list, log: Path) -> dict:
    """Run ``command`` from the repository root, its stdout to ``log`` (its stderr, progress bars and errors, to
    this terminal): wall seconds, CPU seconds (user + system, its children included: ``wait4``, what
    ``RUSAGE_CHILDREN`` adds for it) and peak resident GiB. Raises ``RuntimeError`` when it fails."""
    start = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen([str(c) for c in command], cwd=ROOT, stdout=out)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{command[1]} exited with {process.returncode} (its stdout: {log})")
    return {"wall_s": time.perf_counter() - start, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gib": usage.ru_maxrss / 2 ** 20}


def set_summary(metrics: dict) -> dict:
    """One eval set's acceptance numbers."""
    keys = ("acceptance_length", "tokens_per_step", "acceptance_rate_per_position",
            "cumulative_acceptance_per_position", "greedy_match", "greedy_ties", "speedup", "num_prompts")
    return {k: metrics[k] for k in keys}


def measure(run_dir: Path, heads: dict[str, Path | None], val_rows: list[dict]) -> dict[str, dict]:
    """Every ``heads`` folder (None: the run's own) read by the run's strict loader, validated on ``val_rows`` and
    evaluated on the run's eval sets, with the run's target loaded once: ``{name: {trainable, validation, eval}}``."""
    run = open_run(run_dir, EVAL)
    eval_sets = load_eval_sets(run.conf.eval)
    results = {}
    for name, folder in heads.items():
        trained = run.recipe.load(run_dir, run.conf, run.target, None if folder is None else str(folder))
        val, _ = validate(run.target, trained.model, val_rows, run.conf.data.target_batch_size,
                          run.tokenizer.pad_token_id)
        sets = evaluate_drafter(run.conf, run.recipe, trained, run.target, run.tokenizer, eval_sets)
        results[name] = {"trainable": sum(p.numel() for p in trained.model.parameters()),
                         "validation": {k: v for k, v in val.items() if k.startswith("val/")},  # no drift in stage 1
                         "eval": {s: set_summary(m) for s, m in sets.items()}}
    return results


def trained_steps(work: Path) -> dict[str, int]:
    """The optimizer steps each trainer reports having taken."""
    report = json.loads((work / "draftheads" / "report.json").read_text())
    return {"reference": json.loads((work / "reference" / "trainer.json").read_text())["steps"],
            "draftheads": report["train_curves"]["stage1"][-1]["step"]}


def table_row(name: str, r: dict) -> str:
    """One trainer's line of the table (the chitchat set's numbers; "-" without that set)."""
    chat = r["eval"].get("chitchat")
    alpha = " ".join(f"{a:.2f}" for a in chat["acceptance_rate_per_position"]) if chat else "-"
    tau, greedy = (f"{chat['acceptance_length']:.3f}", f"{chat['greedy_match']:.2f}") if chat else ("-", "-")
    top1 = " ".join(f"{v:.3f}" for k, v in r["validation"].items() if k.endswith("_top1"))
    return (f"{name:<12}{r['steps']:>6}{r['epochs']:>7.2f}{r['wall_s'] / r['epochs']:>11.1f}"
            f"{r['cpu_s'] / r['epochs']:>11.1f}{r['peak_rss_gib']:>9.2f}{r['trainable'] / 1e6:>10.2f}M"
            f"{tau:>7}  {alpha:<24}{greedy:>7}  {top1}")


def print_results(rows: dict[str, dict], prepared: Prepared, settings: dict) -> None:
    """The table, then ``RESULTS <json>``."""
    ratio = {k: rows["reference"][k] / rows["draftheads"][k] for k in ("wall_s", "cpu_s", "peak_rss_gib")}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    conf = prepared.conf
    print(f"\ndevice: {device}; weights: reference bfloat16, draftheads {conf.model.dtype}; autocast "
          f"{conf.trainer.mixed_precision}; {prepared.width} tokens per reference row")
    print(f"{'trainer':<12}{'steps':>6}{'epochs':>7}{'wall s/ep':>11}{'CPU s/ep':>11}{'peak GiB':>9}{'trainable':>11}"
          f"{'tau':>7}  {'alpha per position':<24}{'greedy':>7}  held-out top-1 per head")
    for name, r in rows.items():
        print(table_row(name, r))
    print(f"{'ratio':<25}{ratio['wall_s']:>11.2f}{ratio['cpu_s']:>11.2f}{ratio['peak_rss_gib']:>9.2f}"
          f"   (reference / draftheads)")
    print("RESULTS " + json.dumps({"device": device, "rows": rows, "ratio": ratio, "reference_settings": settings}))


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv if a.startswith(OPTIONS))
    overrides = [*FIXED, *SAME_HEADS, f"stage1.epochs={options.get('epochs', 2)}",
                 *([f"stage1.max_steps={options['max_steps']}"] if "max_steps" in options else []),
                 *(a for a in argv if not a.startswith(OPTIONS))]
    python = ensure_reference()
    work = Path(tempfile.mkdtemp(prefix="bench-reference-"))
    print(f"work folder: {work}", flush=True)
    prepared = prepare(job_config([*overrides, f"output_dir={work / 'rows'}"]), work)
    settings = reference_settings(prepared, work)
    (work / "reference.json").write_text(json.dumps(settings, indent=1))
    print(f"reference: {prepared.steps} steps (stdout: {work / 'reference.log'})", flush=True)
    runs = {"reference": timed([python, DRIVER, work / "reference.json"], work / "reference.log")}
    print(f"draftheads: {prepared.steps} steps (stdout: {work / 'draftheads.log'})", flush=True)
    runs["draftheads"] = timed([sys.executable, "train/medusa.py", *overrides, f"output_dir={work / 'draftheads'}"],
                               work / "draftheads.log")
    measured = measure(work / "draftheads", {"draftheads": None, "reference": work / "reference"}, prepared.val_rows)
    steps = trained_steps(work)
    print_results({name: {**runs[name], **measured[name], "steps": steps[name],
                          "epochs": steps[name] * prepared.epochs / prepared.steps} for name in runs},
                  prepared, settings["args"])


if __name__ == "__main__":
    main(sys.argv[1:])
