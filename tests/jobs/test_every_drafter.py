"""What every registered drafter's job does alike: parametrized over the registry (``draftheads.drafters.DRAFTERS``),
never over a list of names, each drafter's own short settings in :data:`OWN`, so a new drafter is tested here or
fails here, never silently absent."""

import math

import pytest
import torch
from safetensors.torch import load_file

from draftheads import drafters
from draftheads.jobs.train import train
from tests.helpers import smoke

OWN = {
    "medusa": ["stage1.epochs=1", "stage2.epochs=0.5"],
    "dflash": ["train.epochs=1", "eval.peer_runs=[]"],
    "eagle3": ["train.epochs=1", "eval.peer_runs=[]", "eagle3.ttt_steps=2"],
}
"""Each drafter's overrides of the smoke job for a short run (its peer runs, which the test does not make, off)."""
SAVED = {"medusa": ["medusa_heads"]}
"""Folders a drafter saves besides its vLLM export (``Recipe.vllm_weights``), held to the same dtype."""


def test_every_registered_drafter_has_its_settings_here():
    assert OWN.keys() == drafters.DRAFTERS.keys()
    assert SAVED.keys() <= drafters.DRAFTERS.keys()


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_a_bfloat16_target_trains_validates_and_exports_in_its_dtype(job, tmp_path, cache_dir):
    """Drafters train in float32 beside a bf16 target, then are validated, evaluated and exported in the
    target's dtype, as a server runs them (float32 drafters met bf16 target states in validation before)."""
    report = train(job, smoke(job, tmp_path, cache_dir, "model.dtype=bfloat16", "eval.max_new_tokens=8",
                              "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 1}]", *OWN[job]))
    assert report["dtype"] == "bfloat16" and report["drafter"] == job
    assert report["validation"] and all(math.isfinite(v) for v in report["validation"].values())
    assert report["eval"]["chitchat"]["acceptance_length"] >= 1.0
    for folder in [*SAVED.get(job, []), drafters.get(job).vllm_weights]:
        files = list((tmp_path / folder).glob("*.safetensors"))
        dtypes = {t.dtype for f in files for t in load_file(str(f)).values()}
        assert files and dtypes == {torch.bfloat16}, (folder, dtypes)
