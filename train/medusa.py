"""Train Medusa heads for a target model in two stages, evaluate them speculatively, export them.

    accelerate launch train/medusa.py                                  # SmolLM2-135M-Instruct, chitchat
    accelerate launch train/medusa.py +experiment=smoke                # tiny random Llama, < 1 minute
    accelerate launch train/medusa.py medusa.num_heads=3 stage2.unfreeze_last_n_layers=2 trainer.lr=1e-3
    accelerate launch --multi_gpu --num_processes 2 train/medusa.py    # DDP (gloo on CPU, NCCL on GPUs)
    accelerate launch train/medusa.py resume=true                      # continue an interrupted run

Flow: target -> self-distilled rows -> cached hidden states -> stage 1 (heads) -> stage 2 (heads + last N
layers, KL to the original) -> validation and drift -> speculative evaluation -> export. Rank 0 alone
validates, evaluates and exports.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from data.batching import rank_shard
from data.hidden_states import attach_hidden_states
from data.pipeline import describe, self_distilled_rows
from models.medusa import MedusaHeads
from models.target import load_target, model_identity
from train.checkpoint import latest_checkpoint
from train.config import MedusaRunConfig, register_configs, to_schema
from train.finish import finish_run, load_eval_sets
from train.runtime import make_accelerator, print0
from train.spine import fit
from train.strategies import MedusaStage1, MedusaStage2, check_unfreeze

register_configs()


def run(cfg: DictConfig) -> dict:
    """The whole job for a composed config; returns the report (main process) or {}."""
    conf: MedusaRunConfig = to_schema(cfg)
    accelerator = make_accelerator(cfg, run_name=Path(conf.output_dir).name)
    out = Path(conf.output_dir)
    eval_sets = load_eval_sets(conf.eval)  # a bad eval file fails now, not after training

    with accelerator.main_process_first():  # rank 0 converts/downloads; the others then read its cache
        target, tokenizer, target_path = load_target(conf.model, conf.cache_dir)
    target.to(accelerator.device)
    identity = model_identity(target, conf.model)
    print0(accelerator, f"target: {target_path} ({identity['num_hidden_layers']} layers, "
                        f"hidden {identity['hidden_size']}, vocab {identity['vocab_size']})")
    check_unfreeze(target, conf.stage2)
    resume = latest_checkpoint(out, identity) if conf.resume else None  # refuse another model's before any work
    resume_stage = resume[1]["stage"] if resume else None
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out / "config.yaml", resolve=True)

    with accelerator.main_process_first():  # rank 0 regenerates; the others read its cache
        train_rows, val_rows, data_report = self_distilled_rows(conf.data, target, tokenizer, identity,
                                                                conf.cache_dir, accelerator.is_main_process)
    print0(accelerator, f"data: {describe(data_report)}")

    pad = tokenizer.pad_token_id
    bs = conf.trainer.hidden_states_batch_size
    attach_hidden_states(target, rank_shard(train_rows, accelerator.process_index, accelerator.num_processes),
                         bs, pad, accelerator.is_main_process)
    if accelerator.is_main_process:
        attach_hidden_states(target, val_rows, bs, pad, show_progress=False)

    heads = MedusaHeads(identity["hidden_size"], identity["vocab_size"], conf.medusa.num_heads,
                        conf.medusa.num_layers, conf.medusa.per_head_lm_head).to(accelerator.device)
    if heads.per_head_lm_head:
        heads.init_lm_heads_from(target.get_output_embeddings())

    meta = {"model": identity, "step_offset": 0}
    curves = {}
    if conf.stage1.enabled and resume_stage != "stage2":
        state = fit(accelerator, MedusaStage1(heads, target, conf.medusa.decay), train_rows, conf.trainer,
                    conf.stage1, str(out), pad, meta, resume_from=str(resume[0]) if resume else None)
        meta["step_offset"], curves["stage1"] = state.step, state.history
    elif resume_stage == "stage2":
        meta["step_offset"] = resume[1]["step_offset"]
    if conf.stage2.enabled:
        s2 = conf.stage2
        strategy = MedusaStage2(heads, target, s2.unfreeze_last_n_layers, conf.medusa.decay, s2.kl_weight,
                                s2.backbone_lr_scale)
        state = fit(accelerator, strategy, train_rows, conf.trainer, s2, str(out), pad, meta,
                    resume_from=str(resume[0]) if resume_stage == "stage2" else None)
        curves["stage2"] = state.history
        meta["step_offset"] += state.step
        target.requires_grad_(False)

    report = {}
    if accelerator.is_main_process:
        report = finish_run(conf, accelerator, target, tokenizer, heads, target_path, identity, val_rows, eval_sets,
                            meta["step_offset"], {"data": asdict(data_report), "train_curves": curves})
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return report


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
