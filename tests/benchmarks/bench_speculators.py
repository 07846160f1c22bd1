"""Draftheads' EAGLE-3 and DFlash beside vLLM's own drafter trainer, ``speculators`` 0.9.0 from PyPI, on the same
training rows, target states, drafter sizes and optimizer steps (not part of the test run).

    python tests/benchmarks/bench_speculators.py                     # SmolLM2-135M, the jobs' rows, both drafters
    python tests/benchmarks/bench_speculators.py drafters=eagle3 modes=matched eagle3.gamma=3
    python tests/benchmarks/bench_speculators.py max_steps=2 rows=16 check_rows=2 data.target_states=online \
        eval.max_new_tokens=16 'eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}]'   # a quick check

Options: ``drafters=`` (``eagle3,dflash``), ``modes=`` (speculators' settings: ``defaults``, ``matched`` or both),
``epochs=`` (draftheads' ``train.epochs``; default each job's own: EAGLE-3 5, DFlash 10), ``max_steps=``
(``train.max_steps``), ``check_rows=`` (rows whose states vLLM recomputes for the check below, default 4; 0 skips
it), ``rows=`` (a quick check only: speculators gets the first that many training rows and an eighth as many
held-out ones, draftheads all of them),
``parity=true`` (also ``train/vllm_parity.py`` on every export), ``vllm_venv=``, ``speculators_venv=``,
``draftheads=`` (an earlier benchmark's ``<work>/<drafter>/draftheads`` run of the same steps, measured again
instead of trained again: with one drafter, to add a speculators mode later). Any other
``key=value`` overrides ``conf/eagle3.yaml`` and ``conf/dflash.yaml`` (a key under ``eagle3.``/``dflash.`` only its
drafter's). Speculators' environment is made on first use (``$DRAFTHEADS_CACHE/speculators-venv``: the CPU torch
2.13, then ``speculators==0.9.0`` with its pins, transformers <= 5.19); ``speculators_driver.py`` runs its
``speculators train`` there, with two run-time patches for a machine without an accelerator (its docstring).

Shared, per drafter: the job's training rows (``job_rows``: the target's own regenerated chitchat answers,
:data:`FIXED`, at ``data.max_length``; rows the recipe cannot train on left out) and held-out rows (speculators
validates on them every epoch, as its ``--train-data-ratio`` tail); the target states; the drafter's size (EAGLE-3:
one layer, the target's width, the 16,384-token draft vocabulary from the training rows' trained-token counts, 7
training-time test steps, layers 1/14/26 (vLLM ids 2/15/27); DFlash: one Qwen3 layer, blocks of 16, layers
1/8/14/20/27, mask token 16); the optimizer steps (draftheads' count for its epochs, capped by ``max_steps``;
speculators' epochs are its sampler's, with ``--max-steps``); micro-batches of ``trainer.tokens_per_batch`` (1280)
tokens (speculators packs rows up to that many tokens, draftheads up to rows x longest row); gradient clipping at 1;
bf16 autocast; the seed.

Speculators' modes:

- ``defaults``: its own objective and optimizer (EAGLE-3: KL to the target, equal weights per step, EAGLE-3.1's
  ``norm_before_fc`` and ``norm_output``, ``norm_before_residual``; DFlash: CE with D-PACE, 512 anchors; both:
  Muon with AdamW, lr 1e-3, weight decay 0.01/0.1, linear decay after 1% warmup). Its sizes are draftheads' all
  the same (its own default unrolls EAGLE-3 3 steps and builds DFlash 5 layers deep).
- ``matched``: draftheads' defaults in its flags (docs/objectives.md): CE on the target's greedy tokens, EAGLE-3's
  steps decayed 0.8 per step, DFlash's positions weighted by D-PACE (``--per-position-loss-weight dpace``,
  ``--dpace-alpha`` our ``dpace_floor``; under ``dflash.position_weights=decay``, ``exp(-(k-1)/7)``, its
  ``--dflash-decay-gamma 7``), draftheads' optimizer (``trainer.optimizer``) at its lr and weight decay, cosine after
  ``trainer.warmup_ratio``, the norm flags as draftheads' config has them (``norm_before_fc`` and ``norm_output`` on
  by default, ``norm_before_residual`` off), DFlash with as many blocks per token as ``dflash.max_anchors`` a row
  gives (speculators draws its anchors per packed sequence, draftheads per row: :func:`anchors_per_pack`). Left
  different: speculators sums EAGLE-3's decayed step losses where draftheads takes their weighted mean (a constant
  factor under Adam), keeps EAGLE-3's draft LM head frozen at the target's rows (draftheads trains it), takes CE
  labels from the target's argmax over the draft vocabulary (draftheads from the row: the target's own greedy token),
  and batches rows differently (above).

Without a GPU both modes add :data:`CPU_FLAGS`, speculators' own flags for such hardware.

Target states: speculators' own pipeline (``speculators generate-offline-data`` against a ``vllm serve`` with the
``extract_hidden_states`` method and its ``ExampleHiddenStatesConnector``) needs CUDA: vLLM 0.32's connector
makes ``torch.cuda.Stream``/``Event`` for every copy (``vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py:256,386``), which vLLM's CPU build cannot make. So the states are draftheads'
(the target in process, :func:`write_states`) written in speculators' file format, and ``check_rows`` rows are
recomputed by vLLM's CPU build through the same ``extract_hidden_states`` method (draftheads' synchronous
connector, ``data/vllm_extract.py``: what speculators' files would hold) and compared.

Evaluation, the same for every export: draftheads' ``read_export`` does not read speculators' checkpoint folder
(its own config format: ``speculators_config``, ``transformer_layer_config``; what it says is printed), so its
weights are loaded into draftheads' own drafter (:func:`to_draftheads`: names and config only) and written by
draftheads' exporter into a run folder of its own beside draftheads' run (:func:`shadow_run`), then measured by
``train/evaluate.py``'s evaluator (greedy chain, the held-out eval sets) and, with ``parity=true``,
``train/vllm_parity.py``.

Columns: ``steps`` optimizer steps; ``epochs`` those in passes over the training rows (each trainer's batches);
``CPU s/ep`` the trainer's whole process (start, target load or states read, training, validation, saving) in
user + system CPU seconds per epoch, ``wall s/ep`` in wall seconds, ``peak GiB`` its peak resident memory;
``trained`` the parameters it trains (speculators keeps EAGLE-3's draft LM head frozen at the target's rows,
draftheads trains it); ``tau`` the chain's acceptance length and ``alpha`` its acceptance per
position on the chitchat set, ``greedy`` the share of outputs equal to plain greedy decoding (1: lossless). The
states' preparation is outside both trainers' columns (draftheads computes them again in its process). A last line
``RESULTS <json>`` carries every number.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from bench_reference import timed
from draftheads.data.batching import BatchPlan
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.vllm_states import vllm_states
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file, save_file

from draftheads import drafters
from draftheads.drafters import register_configs
from draftheads.drafters.dflash.model import anchor_candidates
from draftheads.evaluation.methods import load_eval_sets
from draftheads.run_folder import record_finished
from draftheads.runs.life import close_job, evaluate_drafter, open_job
from draftheads.runs.rows import job_rows
from draftheads.runs.saved import open_run
from draftheads.serving.vllm_env import ensure_vllm

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("speculators_driver.py")

TORCH = "torch==2.13.0"
"""Installed first and alone: the CPU wheel (a bare ``torch`` from PyPI is the CUDA build); speculators 0.9.0 pins
``torch<=2.14.1``."""
SPECULATORS = "speculators==0.9.0"

FIXED = ["data=chitchat", "eval=shipped", "tracker=none", "eval.enabled=false"]
"""Draftheads trains and exports; every export is evaluated here afterwards, alike. On chitchat's rows and the
shipped held-out sets, as every table of docs/benchmarks.md was measured (the jobs' default is the general mixture
since 756ffe1: ``data=general eval=builtin`` on the command line measures that)."""
EVAL = ["eval.enabled=true", "eval.prompt_lookup_tokens=0", "eval.peers=[]", "eval.peer_runs=[]"]
OPTIONS = ("drafters=", "modes=", "epochs=", "max_steps=", "check_rows=", "rows=", "parity=", "vllm_venv=",
           "speculators_venv=", "draftheads=")
MODES = ("defaults", "matched")
CPU_FLAGS = ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
"""Speculators' own flags for a machine without a GPU (its defaults cannot run there): its default
``simple_flex_attention`` has no backward on the CPU (``NotImplementedError: FlexAttention does not support
backward on CPU``, from ``speculators/models/attention.py:55``), and its default ``fused`` loss is a Triton kernel
(``speculators/losses/utils.py:140``: ``RuntimeError: 0 active drivers ([]). There should only be one.``). Its
help names both as the choices for such hardware; the objective is the same."""

register_configs()


def ensure_speculators(venv: str | Path | None = None) -> Path:
    """Speculators' environment's python, the environment made (a few minutes, ~6 GB) when it cannot import
    its trainer; ``venv`` None: ``$DRAFTHEADS_CACHE/speculators-venv``."""
    if venv is None:
        cache = os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads")
        venv = Path(cache).expanduser() / "speculators-venv"
    python = Path(venv) / "bin" / "python"
    probe = [python, "-c", "import speculators.train.cli, datasets"]
    if python.exists() and subprocess.run(probe, check=False, capture_output=True).returncode == 0:
        return python
    print(f"creating speculators' environment at {venv} (a few minutes, ~6 GB)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, SPECULATORS], check=True)
    subprocess.run(probe, check=True)
    return python


def job_config(name: str, overrides: list[str]):
    """``conf/<name>.yaml`` composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(name, overrides=overrides)


def for_drafter(name: str, overrides: list[str]) -> list[str]:
    """The overrides that apply to drafter ``name``: every one but those under another drafter's section."""
    others = tuple(f"{d}." for d in ("eagle3", "dflash") if d != name)
    return [o for o in overrides if not o.lstrip("+~").startswith(others)]


def write_states(target, rows: list[dict], layer_ids: list[int], batch_size: int, pad_token_id: int,
                 folder: Path, chunk: int = 64) -> None:
    """Every row's target states as speculators' file backend reads them (``hs_<i>.safetensors``, i the row's
    index in ``rows``): ``hidden_states`` ``[T, K + 1, D]`` in bfloat16 (the outputs of draftheads' decoder layers
    ``layer_ids``, the last of them the target's last layer before its final norm, what vLLM's
    ``extract_hidden_states`` captures as id L) and ``token_ids`` ``[T]``; a chunk of rows at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        attach_hidden_states(target, part, batch_size, pad_token_id, show_progress=False, layer_ids=layer_ids,
                             dtype=torch.bfloat16)
        for i, row in enumerate(part, start):
            states = row.pop("target_features")
            save_file({"hidden_states": states.view(len(states), len(layer_ids), -1).contiguous(),
                       "token_ids": row["input_ids"].long().contiguous()}, str(folder / f"hs_{i}.safetensors"))


def write_rows(rows: list[dict], train_rows: list[dict], data: Path) -> None:
    """``rows.safetensors`` (the driver saves it as speculators' dataset) and ``token_freq.pt`` (trained-token
    counts of the training rows, what its ``prepare_data`` writes and its vocabulary mapping reads)."""
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    save_file({"input_ids": torch.cat([r["input_ids"].long() for r in rows]),
               "loss_mask": torch.cat([r["loss_mask"].bool() for r in rows]), "lengths": lengths},
              str(data / "rows.safetensors"))
    trained = torch.cat([r["input_ids"][r["loss_mask"]] for r in train_rows])
    ids, counts = trained.unique(return_counts=True)
    torch.save(dict(zip(ids.tolist(), counts.tolist())), data / "token_freq.pt")


def check_states(vllm_python: Path, target, target_path: str, rows: list[dict], layer_ids: list[int], folder: Path,
                 max_model_len: int) -> dict:
    """The first rows' states recomputed by vLLM's CPU build through ``extract_hidden_states`` (the capture
    speculators' pipeline uses), against the files written: largest absolute difference, and relative to the
    row's largest state."""
    with tempfile.TemporaryDirectory() as tmp:
        source = vllm_states(vllm_python, target, target_path, rows, layer_ids, Path(tmp), max_model_len, {})
        theirs = source(rows)
    worst = {"rows": len(rows), "max_abs_diff": 0.0, "max_rel_diff": 0.0}
    for i, (row, vllm) in enumerate(zip(rows, theirs)):
        ours = load_file(str(folder / f"hs_{i}.safetensors"))["hidden_states"].flatten(1).float()
        diff = (ours - vllm.float()).abs().max().item()
        worst["max_abs_diff"] = max(worst["max_abs_diff"], diff)
        worst["max_rel_diff"] = max(worst["max_rel_diff"], diff / vllm.float().abs().max().item())
    return worst


def prepare(name: str, cfg, work: Path, check_rows: int, vllm_venv: str | None, rows_limit: int = 0) -> dict:
    """Drafter ``name``'s rows as its job makes them (``job_rows``, the recipe's unusable rows left out), their
    states and speculators' data folder (``work/data``), draftheads' optimizer steps, and the sizes speculators
    must be given: draftheads' layer ids, EAGLE-3's draft vocabulary, DFlash's mask token. ``rows_limit`` > 0
    keeps that many training rows (and an eighth as many held-out ones) for speculators: a quick check only."""
    recipe = drafters.get(name)
    job = open_job(cfg)
    train_rows, val_rows, _ = job_rows(job, attach=False, unusable=recipe.unusable)
    conf, target, pad = job.conf, job.target, job.tokenizer.pad_token_id
    t = conf.trainer
    plan = BatchPlan(train_rows, 0, 1, t.batch_size, t.tokens_per_batch, t.seed, True)  # as the spine plans
    steps = plan.total(conf.train.epochs) // t.grad_accum
    steps = min(steps, conf.train.max_steps or steps)
    if rows_limit:  # a check only: speculators then trains on fewer rows than draftheads
        train_rows, val_rows = train_rows[:rows_limit], val_rows[:max(2, rows_limit // 8)]
    layers = list(recipe.drafter_layers(conf, target))
    captured = layers + [target.config.num_hidden_layers - 1]
    data = work / "data"
    rows = train_rows + val_rows
    print(f"{name}: {len(train_rows)} training and {len(val_rows)} held-out rows, states of layers {captured} "
          f"-> {data}", flush=True)
    write_states(target, rows, captured, conf.data.target_batch_size, pad, data / "hidden_states")
    write_rows(rows, train_rows, data)
    check = None
    if check_rows:
        check = check_states(ensure_vllm(vllm_venv), target, job.target_path, rows[:check_rows], captured,
                             data / "hidden_states", conf.data.max_length)
        print(f"{name}: states of {check_rows} rows against vLLM's: max |diff| {check['max_abs_diff']:.3e}, "
              f"relative {check['max_rel_diff']:.3e}", flush=True)
    prepared = {"conf": conf, "steps": steps, "epochs": steps * t.grad_accum / plan.count(0), "layers": layers,
                "target_path": job.target_path, "data": data, "num_train": len(train_rows),
                "num_rows": len(rows), "state_check": check}
    if name == "dflash":
        from draftheads.drafters.dflash.model import choose_mask_token
        prepared["mask_token_id"] = choose_mask_token(job.tokenizer, target.config.vocab_size,
                                                      conf.dflash.mask_token_id)
        prepared["anchors_per_pack"] = anchors_per_pack(train_rows, conf.dflash.max_anchors, t.tokens_per_batch)
    close_job(job, {})
    return prepared


def anchors_per_pack(rows: list[dict], max_anchors: int, tokens: int | None) -> int:
    """Speculators' ``--max-anchors`` that trains as many DFlash blocks per token as draftheads'
    ``dflash.max_anchors``. Draftheads draws its anchors per row (``sample_anchors``: at most ``max_anchors`` of a
    row's ``anchor_candidates``), speculators per packed sequence of up to ``tokens`` tokens
    (``speculators/models/dflash/utils.py`` ``select_anchors``, on its ``[1, total_seq_len]`` loss mask).
    Returns draftheads' blocks per token over ``rows`` times ``tokens`` (1280 if None), rounded."""
    blocks = sum(min(max_anchors, int(anchor_candidates(r["loss_mask"].bool()[None]).sum())) for r in rows)
    return max(1, round(blocks * (tokens or 1280) / sum(len(r["input_ids"]) for r in rows)))


def vllm_ids(layers: list[int]) -> list[str]:
    """Draftheads' layer ids (outputs of decoder layers) as speculators' ``--target-layer-ids`` (vLLM's ids, the
    inputs of decoder layers: each + 1)."""
    return [str(i + 1) for i in layers]


def speculators_argv(name: str, mode: str, prepared: dict, out: Path) -> list[str]:
    """``speculators train`` arguments for drafter ``name`` in ``mode`` (the module docstring)."""
    conf, t = prepared["conf"], prepared["conf"].trainer
    ratio = (prepared["num_train"] + 0.5) / prepared["num_rows"]  # its split: int(rows * ratio) training rows
    argv = ["--speculator-type", name, "--verifier-name-or-path", prepared["target_path"],
            "--data-path", str(prepared["data"]), "--save-path", str(out / "checkpoints"),
            "--log-dir", str(out / "logs"), "--total-seq-len", str(t.tokens_per_batch or 1280),
            "--train-data-ratio", f"{ratio:.6f}", "--num-workers", "0", "--seed", str(t.seed),
            "--num-layers", "1", "--target-layer-ids", *vllm_ids(prepared["layers"])]
    if name == "eagle3":
        e = conf.eagle3
        argv += ["--draft-vocab-size", str(e.draft_vocab_size), "--ttt-steps", str(e.ttt_steps)]
    else:
        d = conf.dflash
        argv += ["--block-size", str(d.block_size), "--mask-token-id", str(prepared["mask_token_id"])]
    if mode == "defaults":
        return argv
    argv += ["--loss-fn", "ce", "--optimizer", conf.trainer.optimizer.value, "--lr", str(t.lr),
             "--weight-decay", str(t.weight_decay), "--scheduler-type", "cosine",
             "--scheduler-warmup-ratio", str(t.warmup_ratio)]
    if name == "eagle3":
        e = conf.eagle3
        argv += ["--ttt-step-loss-decay", str(e.position_decay),
                 "--norm-before-fc" if e.norm_before_fc else "--no-norm-before-fc",
                 "--norm-output" if e.norm_output else "--no-norm-output",
                 "--norm-before-residual" if e.norm_before_residual else "--no-norm-before-residual",
                 *(["--fc-norm"] if e.fc_norm else [])]
    elif d.position_weights == "dpace":
        argv += ["--max-anchors", str(prepared["anchors_per_pack"]), "--per-position-loss-weight", "dpace",
                 "--dpace-alpha", str(d.dpace_floor)]
    else:
        import math
        decay = d.position_decay or math.exp(-1 / {16: 7, 10: 5, 8: 4}.get(d.block_size, 7))
        argv += ["--max-anchors", str(prepared["anchors_per_pack"]),
                 "--per-position-loss-weight", "fixed-exp-decay",
                 "--dflash-decay-gamma", f"{-1 / math.log(decay):.6f}"]
    return argv


def speculators_checkpoint(out: Path) -> Path:
    """The folder of speculators' last checkpoint under ``out/checkpoints`` (its epochs are numbered folders; it
    also links the best one, which the run's last may not be)."""
    epochs = [p for p in (out / "checkpoints").iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()]
    return max(epochs, key=lambda p: int(p.name))


def to_draftheads(name: str, folder: Path, target) -> torch.nn.Module:
    """Speculators' checkpoint ``folder`` as draftheads' drafter of the same weights (float32), built for
    ``target`` by draftheads' own constructor and filled strictly; the layout differs only in names and config:
    EAGLE-3's ``layers.0.`` is vLLM's ``midlayer.``, its ``embed_tokens`` (the target's, frozen) is dropped; its
    layer ids are vLLM's (each - 1 here); its norm flags (``norm_before_residual`` on in speculators' defaults)
    are read as vLLM reads them."""
    config = json.loads((folder / "config.json").read_text())
    tensors = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    if name == "eagle3":
        from draftheads.drafters.eagle3.model import Eagle3DraftModel, norm_flags
        layers = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
        d2t = tensors.pop("d2t").long()
        vocabulary = d2t + torch.arange(len(d2t))
        model = Eagle3DraftModel.for_target(target, layers, vocabulary, **norm_flags(SimpleNamespace(**config)))
        state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                 for k, v in tensors.items() if k not in ("embed_tokens.weight", "t2d")}
        model.load_state_dict({**state, "d2t": model.d2t, "t2d": model.t2d}, strict=True)
        return model
    from draftheads.drafters.dflash.model import DFlashDraftModel
    layers = [i - 1 for i in config["aux_hidden_state_layer_ids"]]
    model = DFlashDraftModel.for_target(target, config["transformer_layer_config"]["num_hidden_layers"],
                                        config["block_size"], layers, config["mask_token_id"])
    model.load_state_dict(tensors, strict=True)
    return model


def shadow_run(run_dir: Path, name: str, folder: Path) -> Path:
    """A run folder of its own for an export: draftheads' run's ``config.yaml`` and ``target.json``, a ledger
    (and a report) that says the save is done, and ``export/<name>`` = ``folder``, so that ``train/evaluate.py``
    and ``train/vllm_parity.py`` measure it as they measure draftheads' own."""
    shadow = folder.parent / f"{folder.name}-run"
    (shadow / "export").mkdir(parents=True, exist_ok=True)
    for entry in ("config.yaml", "target.json"):
        shutil.copy(run_dir / entry, shadow / entry)
    record_finished(shadow, name, ["training", "validation", "save", "export"])
    (shadow / "report.json").write_text(json.dumps({"drafter": name}))
    target = shadow / "export" / name
    if not target.exists():
        target.symlink_to(folder.resolve())
    return shadow


def set_summary(metrics: dict) -> dict:
    """One eval set's acceptance numbers."""
    keys = ("acceptance_length", "acceptance_rate_per_position", "greedy_match", "num_prompts")
    return {k: metrics[k] for k in keys if k in metrics}


def measure(name: str, run_dir: Path, speculators: dict[str, Path], work: Path, parity: bool,
            vllm_venv: str | None) -> dict[str, dict]:
    """Draftheads' run's export and every speculators checkpoint (converted, :func:`to_draftheads`, into a
    shadow run) evaluated alike, the target loaded once; with ``parity`` each export through
    ``train/vllm_parity.py`` too. ``{trainer: {trainable, eval, read_export, parity}}``."""
    run = open_run(run_dir, EVAL)
    recipe, results = run.recipe, {}
    eval_sets = load_eval_sets(run.conf.eval, run.tokenizer)
    exports = {"draftheads": run_dir}
    for mode, out in speculators.items():
        folder = speculators_checkpoint(out)
        entry = results.setdefault(f"speculators {mode}", {})
        try:
            recipe.read_export(folder, run.target)
            entry["read_export"] = "reads it as it is"
        except (FileNotFoundError, ValueError, KeyError, TypeError) as e:  # the finding: what its loader says
            entry["read_export"] = f"{type(e).__name__}: {e}"
        converted = to_draftheads(name, folder, run.target)
        recipe.write_export(converted, work / f"{mode}-export")
        exports[f"speculators {mode}"] = shadow_run(run_dir, name, work / f"{mode}-export")
    for trainer, folder in exports.items():
        entry = results.setdefault(trainer, {})
        trained = recipe.load(folder, run.conf, run.target)
        sets = evaluate_drafter(run.conf, recipe, trained, run.target, run.tokenizer, eval_sets)
        entry |= {"parameters": sum(p.numel() for p in trained.model.parameters()),
                  "eval": {s: set_summary(m) for s, m in sets.items()}, "run": str(folder)}
        if parity:
            command = [sys.executable, "train/vllm_parity.py", str(folder),
                       *([f"vllm_venv={vllm_venv}"] if vllm_venv else [])]
            done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True)
            entry["parity"] = {"ok": done.returncode == 0, "table": done.stdout.strip().splitlines()[-4:]}
    return results


def train_draftheads(name: str, overrides: list[str], out: Path) -> dict:
    """``train/<name>.py`` with ``overrides``, timed (:func:`~bench_reference.timed`), and its optimizer steps;
    written to ``<out>.json`` too (what :func:`earlier_draftheads` reads)."""
    run = timed([sys.executable, f"train/{name}.py", *overrides, f"output_dir={out}"], out.with_suffix(".log"))
    report = json.loads((out / "report.json").read_text())
    measured = {**run, "steps": report["train_curves"][name][-1]["step"]}
    out.with_suffix(".json").write_text(json.dumps(measured, indent=1))
    return measured


def earlier_draftheads(folder: Path, steps: int) -> dict:
    """An earlier benchmark's draftheads run (``draftheads=<its work folder>/<drafter>/draftheads``), measured
    again instead of trained again: its numbers from ``<folder>.json``. Raises ``ValueError`` when it trained
    another number of steps than this benchmark's."""
    measured = json.loads(folder.with_suffix(".json").read_text())
    if measured["steps"] != steps:
        raise ValueError(f"{folder}: {measured['steps']} optimizer steps, this benchmark's are {steps}")
    return measured


def train_speculators(python: Path, name: str, mode: str, prepared: dict, out: Path) -> dict:
    """Speculators' ``train`` in ``mode`` through the driver, timed, with its steps and epochs; written to
    ``<out>/measured.json`` too, so that a run stopped later keeps its trainer's cost."""
    argv = speculators_argv(name, mode, prepared, out)
    if not torch.cuda.is_available():
        argv += CPU_FLAGS
    settings = out.with_suffix(".json")
    out.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"argv": argv, "steps": prepared["steps"], "out": str(out)}, indent=1))
    run = timed([python, DRIVER, settings], out.with_suffix(".log"))
    driver = json.loads((out / "driver.json").read_text())
    measured = {**run, "steps": driver["steps"], "epochs": driver["epochs"], "trained": driver.get("trained"),
                "argv": argv}
    (out / "measured.json").write_text(json.dumps(measured, indent=1))
    return measured


def table_row(name: str, r: dict) -> str:
    """One trainer's line (the chitchat set's numbers; "-" where it was not measured)."""
    chat = r.get("eval", {}).get("chitchat")
    alpha = " ".join(f"{a:.2f}" for a in chat["acceptance_rate_per_position"][:5]) if chat else "-"
    tau, greedy = (f"{chat['acceptance_length']:.3f}", f"{chat['greedy_match']:.2f}") if chat else ("-", "-")
    trainable = f"{r['trained'] / 1e6:.2f}M" if r.get("trained") else "-"
    return (f"{name:<22}{r['steps']:>6}{r['epochs']:>7.2f}{r['cpu_s'] / r['epochs']:>10.1f}"
            f"{r['wall_s'] / r['epochs']:>10.1f}{r['peak_rss_gib']:>9.2f}{trainable:>10}{tau:>7}  {alpha:<26}"
            f"{greedy:>6}")


def print_table(name: str, rows: dict[str, dict], prepared: dict) -> None:
    """Drafter ``name``'s table, then what draftheads' loader said of each speculators folder."""
    conf = prepared["conf"]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"\n{name}: device {device}; {prepared['num_train']} training rows; autocast "
          f"{conf.trainer.mixed_precision}; eval {conf.eval.max_new_tokens} new tokens, greedy chain")
    print(f"{'trainer':<22}{'steps':>6}{'epochs':>7}{'CPU s/ep':>10}{'wall s/ep':>10}{'peak GiB':>9}"
          f"{'trained':>10}{'tau':>7}  {'alpha per position':<26}{'greedy':>6}")
    for trainer, r in rows.items():
        print(table_row(trainer, r))
    for trainer, r in rows.items():
        if "read_export" in r:
            print(f"  {trainer}: draftheads' read_export on its folder: {r['read_export']}")
        if "parity" in r:
            verdict = "holds" if r["parity"]["ok"] else "FAILS"
            print(f"  {trainer}: vLLM parity {verdict}: " + " / ".join(r["parity"]["table"]))


def main(argv: list[str]) -> None:
    options = dict(a.split("=", 1) for a in argv if a.startswith(OPTIONS))
    names = options.get("drafters", "eagle3,dflash").split(",")
    if "draftheads" in options and len(names) != 1:
        raise SystemExit("draftheads=DIR reuses one drafter's run: name that drafter alone (drafters=eagle3)")
    modes = options.get("modes", ",".join(MODES)).split(",")
    check_rows, rows_limit = int(options.get("check_rows", 4)), int(options.get("rows", 0))
    parity = options.get("parity", "false").lower() == "true"
    vllm_venv = options.get("vllm_venv")
    python = ensure_speculators(options.get("speculators_venv"))
    work = Path(tempfile.mkdtemp(prefix="bench-speculators-"))
    print(f"work folder: {work}", flush=True)
    results = {}
    for name in names:
        overrides = [*FIXED, *([f"train.epochs={options['epochs']}"] if "epochs" in options else []),
                     *([f"train.max_steps={options['max_steps']}"] if "max_steps" in options else []),
                     *for_drafter(name, [a for a in argv if not a.startswith(OPTIONS)])]
        home = work / name
        prepared = prepare(name, job_config(name, [*overrides, f"output_dir={home / 'rows'}"]), home, check_rows,
                           vllm_venv, rows_limit)
        rows = {}
        for mode in modes:
            print(f"{name}: speculators ({mode}), {prepared['steps']} steps (log: {home / mode}.log)", flush=True)
            rows[f"speculators {mode}"] = train_speculators(python, name, mode, prepared, home / mode)
        if "draftheads" in options:
            run_dir = Path(options["draftheads"]).resolve()
            draftheads = earlier_draftheads(run_dir, prepared["steps"])
        else:
            run_dir = home / "draftheads"
            print(f"{name}: draftheads, {prepared['steps']} steps (log: {run_dir}.log)", flush=True)
            draftheads = train_draftheads(name, overrides, run_dir)
        rows = {"draftheads": {**draftheads, "epochs": prepared["epochs"]}, **rows}
        measured = measure(name, run_dir, {m: home / m for m in modes}, home, parity, vllm_venv)
        rows = {trainer: {**r, **measured.get(trainer, {})} for trainer, r in rows.items()}
        rows["draftheads"]["trained"] = rows["draftheads"].get("parameters")  # it trains every drafter parameter
        print_table(name, rows, prepared)
        results[name] = {"rows": rows, "state_check": prepared["state_check"], "steps": prepared["steps"]}
    print("RESULTS " + json.dumps(results, default=str))


if __name__ == "__main__":
    main(sys.argv[1:])
