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


import hydra
from omegaconf import DictConfig

from models.medusa import MedusaHeads
from train.config import MedusaRunConfig, register_configs
from train.finish import finish_run
from train.job import close_job, job_rows, open_job
from train.spine import fit
from train.strategies import MedusaStage1, MedusaStage2, check_unfreeze

register_configs()


def run(cfg: DictConfig) -> dict:
    """The whole job for a composed config; returns the report (main process) or {}."""
    job = open_job(cfg, stages=("stage1", "stage2"))
    conf: MedusaRunConfig = job.conf
    accelerator, target, out = job.accelerator, job.target, str(job.out)
    check_unfreeze(target, conf.stage2)
    resume, resume_stage = job.resume, job.resume[1]["stage"] if job.resume else None
    train_rows, val_rows, data_report = job_rows(job)
    pad = job.tokenizer.pad_token_id

    heads = MedusaHeads(job.identity["hidden_size"], job.identity["vocab_size"], conf.medusa.num_heads,
                        conf.medusa.num_layers, conf.medusa.per_head_lm_head).to(accelerator.device)
    if heads.per_head_lm_head:
        heads.init_lm_heads_from(target.get_output_embeddings())

    meta = {"model": job.identity, "step_offset": 0}
    curves = {}
    if conf.stage1.enabled and resume_stage != "stage2":
        strategy = MedusaStage1(heads, target, conf.medusa.decay)
        state = fit(accelerator, strategy, train_rows, conf.trainer, conf.stage1, out, pad, meta,
                    resume_from=str(resume[0]) if resume else None)
        heads = strategy.module.heads  # the trained heads (a plain copy after FSDP/DeepSpeed)
        meta["step_offset"], curves["stage1"] = state.step, state.history
    elif resume_stage == "stage2":
        meta["step_offset"] = resume[1]["step_offset"]
    if conf.stage2.enabled:
        s2 = conf.stage2
        strategy = MedusaStage2(heads, target, s2.unfreeze_last_n_layers, conf.medusa.decay, s2.kl_weight,
                                s2.backbone_lr_scale)
        state = fit(accelerator, strategy, train_rows, conf.trainer, s2, out, pad, meta,
                    resume_from=str(resume[0]) if resume_stage == "stage2" else None)
        curves["stage2"] = state.history
        heads = strategy.module.heads
        meta["step_offset"] += state.step
        target.requires_grad_(False)

    report = {}
    if accelerator.is_main_process:
        report = finish_run(conf, accelerator, target, job.tokenizer, heads, job.target_path, job.identity, val_rows,
                            job.eval_sets, meta["step_offset"],
                            {"data": data_report.as_dict(), "train_curves": curves})
    return close_job(job, report)


@hydra.main(config_path="../conf", config_name="medusa", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
