"""Train a DFlash block-diffusion drafter for a target model, evaluate it speculatively, export it.

    accelerate launch train/dflash.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/dflash.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/dflash.py dflash.block_size=8 dflash.num_layers=3 trainer.lr=1e-3
    accelerate launch --multi_gpu --num_processes 2 train/dflash.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/dflash.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows (the same cache as Medusa's) -> target features of K layers (offline) ->
training (random blocks per sequence, one pass each) -> held-out validation -> export/dflash -> speculative
evaluation beside plain decoding, iterative denoising, a Medusa run's heads and prompt lookup. Rank 0 alone
validates, exports and evaluates.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from models.dflash import DFlashDraftModel, DFlashDrafter, choose_mask_token, default_decay, default_target_layer_ids
from models.export.dflash import export_dflash
from models.speculative import Sampling, speculative_decode
from models.target import load_target
from train.config import DFlashRunConfig, register_configs
from train.evaluation import format_table, hardware, log_eval, write_report
from train.finish import evaluate_methods, medusa_peers, medusa_tree, prompt_lookup_peer
from train.job import close_job, job_rows, open_job
from train.runtime import distributed, print0
from train.spine import fit
from train.strategies import DFlashTraining
from train.validation import validate_dflash

register_configs()


def target_layer_ids(conf: DFlashRunConfig, target) -> list[int]:
    """The target layers the drafter reads: ``dflash.target_layer_ids``, else K spaced from 1 to L-3."""
    d = conf.dflash
    return d.target_layer_ids or default_target_layer_ids(target.config.num_hidden_layers, d.num_target_features)


def build_drafter(conf: DFlashRunConfig, target, tokenizer) -> DFlashDraftModel:
    """A fresh drafter for ``target`` from ``conf.dflash`` (layer ids and mask token resolved)."""
    d = conf.dflash
    layer_ids = target_layer_ids(conf, target)
    mask = choose_mask_token(tokenizer, target.config.vocab_size, d.mask_token_id)
    if d.attention not in ("auto", "flex", "sdpa"):
        raise ValueError(f"dflash.attention={d.attention!r} must be auto, flex or sdpa")
    drafter = DFlashDraftModel.for_target(target, d.num_layers, d.block_size, layer_ids, mask, d.qk_norm)
    if d.attention != "auto":
        drafter.attention = d.attention
    return drafter


def load_medusa_peer(run_dir: str | None, identity: dict):
    """``(heads, rank_accuracy, note)`` of a finished Medusa run for the same target, or ``(None, None, note)``
    when ``run_dir`` is unset or holds no finished run. Raises ``ValueError`` when it was trained for another
    target."""
    from models.export.medusa import load_heads
    if not run_dir:
        return None, None, "no dflash.medusa_run"
    folder = Path(run_dir)
    if not (folder / "medusa_heads").exists():
        return None, None, f"no finished Medusa run at {folder} (run train/medusa.py first to compare)"
    heads, extra = load_heads(folder / "medusa_heads")
    theirs = extra.get("target", {})
    wrong = {k: (theirs.get(k), v) for k, v in identity.items() if theirs.get(k) != v}
    if wrong:
        raise ValueError(f"dflash.medusa_run={run_dir}: its heads were trained for another target; "
                         f"(medusa run, this run) differ in {wrong}")
    report = folder / "report.json"
    rank_accuracy = json.loads(report.read_text()).get("head_rank_accuracy") if report.exists() else None
    stage2 = OmegaConf.load(folder / "config.yaml").stage2.enabled if (folder / "config.yaml").exists() else False
    note = f"Medusa heads of {folder}" + (" (trained with stage 2; evaluated on the original target)" if stage2 else "")
    return heads, rank_accuracy, note


def evaluate_dflash(conf: DFlashRunConfig, eval_sets: dict, target, tokenizer, drafter: DFlashDraftModel,
                    medusa=(None, None, "")) -> dict:
    """DFlash (one pass per block) beside iterative denoising (greedy), a Medusa run's heads (chain and
    tree) and prompt lookup, on every eval set and temperature."""
    d, n, eos = conf.dflash, conf.eval.max_new_tokens, tokenizer.eos_token_id
    heads, rank_accuracy, _ = medusa
    tree = medusa_tree(conf.eval, heads.num_heads, rank_accuracy) if heads is not None and conf.eval.tree and (
        rank_accuracy or conf.eval.medusa_choices) else None
    if heads is not None:
        heads = heads.to(next(target.parameters()).device)

    def peers_at(sampling: Sampling) -> dict:
        peers = {}
        if d.denoise_steps > 1 and sampling.greedy:
            denoiser = DFlashDrafter(drafter, d.denoise_steps, d.denoise_confidence)
            peers[denoiser.name] = lambda ids, gen: speculative_decode(target, denoiser, ids, n, eos, sampling, gen)
        if heads is not None:
            peers |= medusa_peers(conf.eval, target, tokenizer, heads, tree, sampling, chain=True)
        return peers | prompt_lookup_peer(conf.eval, target, tokenizer, sampling)

    return evaluate_methods(conf.eval, eval_sets, target, tokenizer, DFlashDrafter(drafter), peers_at)


def load_saved_run(output_dir: str | Path, overrides: list[str] = (), drafter: str | Path | None = None):
    """A finished DFlash run's config (with ``key=value`` overrides), target, tokenizer and drafter, read by
    the strict loader from its export (or from ``drafter``, a DFlash export folder relative to ``output_dir``
    or absolute). Raises ``FileNotFoundError`` when ``output_dir`` holds no finished DFlash run, ``ValueError``
    when the export does not fit the target."""
    from models.export.dflash import load_dflash
    out = Path(output_dir)
    if not (out / "config.yaml").exists() or not (out / "export" / "dflash" / "config.json").exists():
        raise FileNotFoundError(f"{out} holds no finished DFlash run (config.yaml and export/dflash/ expected)")
    cfg = OmegaConf.merge(OmegaConf.structured(DFlashRunConfig), OmegaConf.load(out / "config.yaml"),
                          OmegaConf.from_dotlist(list(overrides)))
    conf: DFlashRunConfig = OmegaConf.to_object(cfg)
    target, tokenizer, _ = load_target(conf.model, conf.cache_dir)
    return conf, target, tokenizer, load_dflash(out / (drafter or "export/dflash"), target)


def run(cfg: DictConfig) -> dict:
    """The whole job for a composed config; returns the report (main process) or {}."""
    job = open_job(cfg, stages=("dflash",))
    conf: DFlashRunConfig = job.conf
    d, accelerator, target = conf.dflash, job.accelerator, job.target
    if d.features not in ("offline", "online"):
        raise ValueError(f"dflash.features={d.features!r} must be offline or online")
    drafter = build_drafter(conf, target, job.tokenizer)
    decay = d.loss_decay or default_decay(d.block_size)
    print0(accelerator, f"drafter: {d.num_layers} layers, block {d.block_size}, target layers "
                        f"{list(drafter.target_layer_ids)}, mask token {drafter.mask_token_id}")
    medusa = load_medusa_peer(d.medusa_run, job.identity) if accelerator.is_main_process else (None, None, "")
    train_rows, val_rows, data_report = job_rows(job, drafter.target_layer_ids, attach=d.features == "offline")
    pad = job.tokenizer.pad_token_id

    strategy = DFlashTraining(drafter, target, d.max_anchors, decay, online=d.features == "online")
    state = fit(accelerator, strategy, train_rows, conf.trainer, conf.train, str(job.out), pad,
                {"model": job.identity, "step_offset": 0}, resume_from=str(job.resume[0]) if job.resume else None)
    # the trained drafter (a plain copy after FSDP/DeepSpeed), in the target's dtype as a server runs it
    drafter = strategy.module.drafter.to(target.dtype)

    report = {}
    if accelerator.is_main_process:
        val = validate_dflash(strategy.module, val_rows, conf.trainer.hidden_states_batch_size, pad, conf.trainer.seed)
        accelerator.log(val, step=state.step)
        print("validation (held-out rows): " + ", ".join(f"{k}={v:.4f}" for k, v in sorted(val.items())
                                                         if "pos" not in k or k.endswith(("pos1", "pos2"))), flush=True)
        export = export_dflash(drafter.eval(), job.out / "export" / "dflash")
        report = {"config": json.loads(json.dumps(asdict(conf), default=str)), "target": job.target_path,
                  "hardware": hardware(), "distributed": distributed(accelerator), "dtype": conf.model.dtype,
                  "validation": val,
                  "drafter": {"block_size": d.block_size, "num_layers": d.num_layers,
                              "target_layer_ids": list(drafter.target_layer_ids),
                              "mask_token_id": drafter.mask_token_id, "loss_decay": decay},
                  "data": data_report.as_dict(), "train_curves": {"dflash": state.history},
                  "exports": {"dflash": str(export)}, "medusa_peer": medusa[2],
                  "notes": "acceptance_length counts the bonus token; alpha is conditional on earlier positions; "
                           "tau_estimate (validation) is teacher-forced, the eval's acceptance_length is measured"}
        if conf.eval.enabled:
            report["eval"] = evaluate_dflash(conf, job.eval_sets, target, job.tokenizer, drafter, medusa)
            print(format_table(report["eval"]), flush=True)
        print(f"report: {write_report(report, job.out)}", flush=True)
        if conf.eval.enabled:
            log_eval(accelerator, report["eval"], job.out / "acceptance.png", state.step)
    return close_job(job, report)


@hydra.main(config_path="../conf", config_name="dflash", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
