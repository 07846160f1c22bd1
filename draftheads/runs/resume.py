"""What ``resume=true`` may change: a resumed run continues the run its folder holds, so every setting that decided
its weights so far (the drafter, its objective and optimizer, the data and batch plan, the stages) is the one in
its ``config.yaml``; only settings that shape what happens after training, or how the run is watched, may differ.

Checked when the job opens, before the accelerator, the target or any row, and before ``config.yaml`` is
rewritten: a changed setting is refused naming each key with both values (not ignored while the record says it was
in effect, issue 52), as the checkpoint's batch plan is refused (:func:`~draftheads.training.checkpoint.check_plan`).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from draftheads.run_folder import CONFIG

MAY_CHANGE = ("eval", "tracker", "serving", "vllm", "export", "resume", "overwrite", "output_dir", "cache_dir",
              "trainer.log_every", "trainer.checkpoint_every", "trainer.keep_last", "trainer.collective_timeout_min",
              "trainer.mixed_precision", "trainer.count_flops", "trainer.nonfinite", "data.target_batch_size")
"""Keys (and key prefixes) a resumed run may set otherwise than its run did: the evaluation, tracking, serving
preflight and export after training; logging and the checkpoint policy; where the run and the caches live (a moved
run); the precision, which ``auto`` settles per machine; the target's batch for computing states."""


AUTO = ("trainer.optimizer",)
"""Keys whose ``auto`` a resumed run settles to the value its run recorded (never re-decided on another machine)."""


def changed_settings(saved: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """``{key: (saved value, this run's)}`` for every key of ``saved`` whose value differs in ``now`` (nested
    dicts walked). A key ``saved`` lacks is not compared: the run was made by a version without it, which did what
    its default does."""
    out = {}
    for key in sorted(saved):
        a, b, name = saved.get(key), now.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out |= changed_settings(a, b, name + ".")
        elif a != b:
            out[name] = (a, b)
    return out


def check_resume(out: Path, cfg: DictConfig) -> None:
    """``ValueError`` when ``resume=true`` would continue the run in ``out`` with settings other than its
    ``config.yaml`` records, outside :data:`MAY_CHANGE`: each key with the run's value and this one's, and the two
    ways on. Nothing to compare in a folder without ``config.yaml`` (no run to continue)."""
    record = Path(out) / CONFIG
    if not record.is_file():
        return
    saved = OmegaConf.to_container(OmegaConf.load(record), resolve=False)
    now = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    changed = {k: v for k, v in changed_settings(saved, now).items()
               if not any(k == m or k.startswith(m + ".") for m in MAY_CHANGE)
               and not (k in AUTO and v[1] == "auto")}
    if changed:
        said = "; ".join(f"{k}: the run has {a!r}, this command {b!r}" for k, (a, b) in changed.items())
        raise ValueError(f"resume=true continues the run in {out} with the settings it was started with ({record}), "
                         f"and these differ: {said}. Drop those overrides to resume it, or start a new run with them "
                         f"(overwrite=true, or another output_dir)")
