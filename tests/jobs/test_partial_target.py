"""A partial target (``model.partial=true``): the input embedding, final norm and LM head only (and the last N
layers Medusa's stage 2 trains), read from the checkpoint; runs trained from the state cache with it never load the
whole target, and train exactly what the whole target trains."""

import json

import pytest
import torch
from draftheads.data.state_cache import weights_fingerprint
from draftheads.models.partial import hold_layers, is_partial, load_partial_model, part_names, save_partial
from draftheads.models.target import TargetSpec, decoder_layers, load_target, weights_sample
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from draftheads import drafters
from draftheads.jobs.cache import cache_states
from draftheads.runs.life import train
from tests.helpers import SMOKE_STAGES, launch, run_dflash, run_medusa, short_settings, smoke

pytestmark = pytest.mark.slow  # cache and training jobs of every drafter, a 2-process FSDP2 launch


@pytest.mark.parametrize("family", ["llama", "llama3", "gemma3", "phi3"])
def test_a_partial_target_holds_its_ends_as_the_whole_target_does_and_nothing_else(family, cache_dir):
    """Tied (SmolLM2-like, Gemma 3) and untied (Llama 3, Phi-3) embeddings; the fingerprints that tie caches and
    runs to a target agree with the whole target's."""
    spec = TargetSpec(name_or_path=f"tiny://{family}")
    whole, _, _ = load_target(spec, cache_dir)
    part, _, _ = load_target(TargetSpec(name_or_path=f"tiny://{family}", partial=True), cache_dir)
    assert is_partial(part) and not is_partial(whole)
    held = {n: p for n, p in part.named_parameters(remove_duplicate=False) if not p.is_meta}
    assert sorted(held) == sorted(part_names(part))
    full = dict(whole.named_parameters(remove_duplicate=False))
    for name, p in held.items():
        assert torch.equal(p, full[name]), name
    V, D = whole.config.vocab_size, whole.config.hidden_size
    tied = whole.config.tie_word_embeddings
    assert sum(p.numel() for p in part.parameters() if not p.is_meta) == V * D * (1 if tied else 2) + D
    assert (part.get_output_embeddings().weight is part.get_input_embeddings().weight) == tied
    assert weights_sample(part) == weights_sample(whole) and weights_fingerprint(part) == weights_fingerprint(whole)
    assert part.generation_config.to_dict() == whole.generation_config.to_dict()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(RuntimeError, match="is not on the expected device (meta|cpu)"):  # a decoder layer has no
        part(ids)                                                                     # weights to run (meta)


def _no_whole_target(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the whole target was loaded")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def _job(job, out, cache_dir, hs, *overrides):
    return smoke(job, out, cache_dir, *short_settings(job), "eval.enabled=false", f"data.target_states_dir={hs}",
                 "data.target_states_dtype=float32", *overrides)


def _saved(run) -> list[str]:
    """Every weights file a run saves (its checkpoints aside), relative to the run."""
    return sorted(str(f.relative_to(run)) for f in run.rglob("*.safetensors") if "checkpoints" not in f.parts)


@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_a_run_from_the_cache_on_the_partial_target_trains_what_the_whole_target_trains(
        job, tmp_path, cache_dir, monkeypatch):
    """Every file of weights a run saves is the same from the partial target as from the whole one. Medusa's
    stage 2 holds the last N layers besides the ends, and writes the whole trained target, file by file, as the
    whole target's ``save_pretrained`` writes it."""
    hs = tmp_path / "hs"
    cache_states(_job(job, tmp_path / "cache", cache_dir, hs))
    whole = train(job, _job(job, tmp_path / "whole", cache_dir, hs, "data.target_states=disk"))
    _no_whole_target(monkeypatch)
    part = train(job, _job(job, tmp_path / "part", cache_dir, hs, "data.target_states=disk", "model.partial=true"))
    def curves(report):
        return {stage: [{k: v for k, v in point.items() if not k.startswith("perf/")} for point in curve]
                for stage, curve in report["train_curves"].items()}
    assert [c["step"] for c in next(iter(part["train_curves"].values()))]
    assert curves(part) == curves(whole)
    assert part["validation"] == whole["validation"]
    saved = _saved(tmp_path / "whole")
    assert saved and _saved(tmp_path / "part") == saved
    for file in saved:
        a, b = load_file(tmp_path / "whole" / file), load_file(tmp_path / "part" / file)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), file
    assert json.loads((tmp_path / "part" / "target.json").read_text()) == \
        json.loads((tmp_path / "whole" / "target.json").read_text())


@pytest.mark.parametrize("overrides, message", [
    (["data.target_states=memory"], "data.target_states=disk"),
    (["data.target_states=disk", "eval.enabled=true"], "eval.enabled=false"),
])
def test_what_needs_the_decoder_layers_is_refused_before_any_work(overrides, message, tmp_path, cache_dir):
    conf = smoke("medusa", tmp_path / "run", cache_dir, "eval.enabled=false", "stage2.enabled=false",
                 "model.partial=true", *overrides)
    with pytest.raises(ValueError, match=message):
        run_medusa(conf)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_online_features_and_regeneration_are_refused_naming_the_fix(tmp_path, cache_dir):
    with pytest.raises(ValueError, match="data.target_states=online.*use data.target_states=disk"):
        run_dflash(smoke("dflash", tmp_path / "a", cache_dir, "eval.enabled=false", "model.partial=true",
                         "data.target_states=online"))
    with pytest.raises(ValueError, match="regenerate them first"):  # a fresh cache: nothing regenerated yet
        run_medusa(smoke("medusa", tmp_path / "b", tmp_path / "fresh-cache", "eval.enabled=false",
                         "stage2.enabled=false", "model.partial=true", "data.target_states=disk"))
    with pytest.raises(ValueError, match="model.partial=false"):
        cache_states(smoke("medusa", tmp_path / "c", cache_dir, "model.partial=true"))


def test_a_partial_target_trains_under_fsdp2_on_two_processes(tmp_path, cache_dir):
    hs = tmp_path / "hs"
    cache_states(_job("medusa", tmp_path / "cache", cache_dir, hs, "stage2.enabled=false"))  # the runs' layers
    own = [*SMOKE_STAGES, "stage2.enabled=false", "eval.enabled=false", f"data.target_states_dir={hs}",
           "data.target_states_dtype=float32", "data.target_states=disk"]
    part = launch("medusa", tmp_path / "part", cache_dir, *own, "model.partial=true", engine="fsdp")
    whole = launch("medusa", tmp_path / "whole", cache_dir, *own, engine="fsdp")
    losses = [[p["stage1/loss"] for p in r["train_curves"]["stage1"]] for r in (part, whole)]
    assert losses[0] and losses[0] == pytest.approx(losses[1], rel=1e-6)


def test_a_sharded_checkpoint_is_rewritten_whole_with_the_trained_layers(tmp_path, cache_dir):
    """What stage 2 does on a partial target of a sharded checkpoint (a 70B one): the last layer is read, changed,
    and the whole checkpoint written back file by file; transformers loads it as the target with that layer."""
    whole, _, _ = load_target(TargetSpec(name_or_path="tiny://llama3"), cache_dir)
    whole.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    part = load_partial_model(tmp_path / "sharded", torch.float32)
    last = len(decoder_layers(part)) - 1
    hold_layers(part, [last])
    with torch.no_grad():
        for p in decoder_layers(part)[last].parameters():
            p.add_(1.0)
    save_partial(part, tmp_path / "trained")
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    original = dict(whole.named_parameters())
    for name, p in trained.named_parameters():
        changed = f"layers.{last}." in name
        assert torch.equal(p, original[name] + 1.0 if changed else original[name]), name
