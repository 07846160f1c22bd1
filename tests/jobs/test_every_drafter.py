"""What every registered drafter's job does alike: parametrized over the registry (``draftheads.drafters.DRAFTERS``),
never over a list of names, each drafter's job made short by its line of ``tests/helpers.py SHORT``, so a new
drafter is tested here once it has that line (a drafter without one fails, named), never silently absent."""

import math
import re

import pytest
import torch
from safetensors.torch import load_file

from draftheads import drafters
from draftheads.runs.life import train
from draftheads.training import lm_head_loss
from draftheads.training.config import to_schema
from draftheads.training.lm_head_loss import linear_loss
from tests.helpers import short_settings, smoke


@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_every_registered_drafter_has_short_settings_its_job_takes(job):
    """Every registered drafter has its line in ``tests/helpers.py SHORT`` (a new one without fails here, naming
    it) and it composes with the smoke job: unknown keys fail here, before any suite runs it."""
    conf = to_schema(smoke(job, "out", "cache", *short_settings(job)))
    assert conf.drafter == job and conf.eval.peer_runs == []


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_a_bfloat16_target_trains_validates_and_exports_in_its_dtype(job, tmp_path, cache_dir):
    """Drafters train in float32 beside a bf16 target, then are validated, evaluated and exported in the
    target's dtype, as a server runs them (float32 drafters met bf16 target states in validation before)."""
    report = train(job, smoke(job, tmp_path, cache_dir, "model.dtype=bfloat16", "eval.max_new_tokens=8",
                              "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 1}]",
                              *short_settings(job)))
    assert report["dtype"] == "bfloat16" and report["drafter"] == job
    assert report["validation"] and all(math.isfinite(v) for v in report["validation"].values())
    assert report["eval"]["chitchat"]["acceptance_length"] >= 1.0
    recipe = drafters.get(job)  # its methods' names are the ones it declares (what eval.peers is checked against)
    chitchat = report["eval"]["chitchat"]
    own = [n for n in [chitchat["method"], *chitchat.get("peers", {})] if n != "prompt_lookup"]
    assert own and all(any(re.fullmatch(p, n) for p in recipe.spec.methods) for n in own), (own, recipe.spec.methods)
    # what it saves beside its exports and the export vLLM loads: weights in one dtype
    # (EAGLE-3's d2t/t2d vocabulary maps: int64, bool)
    for folder in [*recipe.spec.saved_entries, recipe.spec.vllm_weights]:
        files = list((tmp_path / folder).glob("*.safetensors"))
        dtypes = {t.dtype for f in files for t in load_file(str(f)).values() if t.is_floating_point()}
        assert files and dtypes == {torch.bfloat16}, (folder, dtypes)


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_a_distillation_objective_reads_the_targets_distribution_where_the_drafter_drafts(job, tmp_path, cache_dir,
                                                                                        monkeypatch):
    """``<drafter>.loss=kl`` with D-PACE weights: on rows the target regenerated greedily, the target's
    distribution handed to the loss at each drafted position has the row's token as its argmax (a teacher one
    position off would agree ~1/V of the time), the first stage's loss falls, and validation reports the overlap."""
    agree, total = [], []

    def recording(hidden, weight, labels, bias=None, teacher=None, **kw):
        if teacher is not None:
            logits = teacher[0].float() @ teacher[1].float().t()
            agree.append(int((logits.argmax(-1) == labels).sum()))
            total.append(len(labels))
        return linear_loss(hidden, weight, labels, bias, teacher=teacher, **kw)

    monkeypatch.setattr(lm_head_loss, "linear_loss", recording)
    report = train(job, smoke(job, tmp_path, cache_dir, f"{job}.loss=kl", f"{job}.position_weights=dpace",
                              "eval.max_new_tokens=8", *short_settings(job)))
    assert sum(total) > 100 and sum(agree) / sum(total) > 0.9, (sum(agree), sum(total))
    stage, curve = next(iter(report["train_curves"].items()))  # later stages' few steps start where it ended
    losses = [h[f"{stage}/loss"] for h in curve]
    assert losses[-1] < losses[0], (stage, losses)
    assert any("overlap" in key for key in report["validation"]), report["validation"].keys()
