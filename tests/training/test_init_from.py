"""``<drafter>.init_from``: a run starts from a finished run or an export where that one ended, DSpark starts from
DFlash with its own heads fresh, a source made for another target is refused before any work, and a resumed run
ignores the source and ends as the whole run did. Parametrized over the registry (each drafter's job made short by
its recipe's ``short``)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftheads import drafters
from draftheads.runs import life as train_job
from draftheads.runs.life import train
from draftheads.training.config import DrafterConfig, to_schema
from draftheads.training.warm_start import Source, load_source
from tests.helpers import cut_back, short_settings, smoke

STILL = ("trainer.lr=1e-12", "trainer.warmup_ratio=0", "eval.enabled=false")
"""A run whose steps leave the weights where they started (AdamW moves each by about lr): what it saves is what it
started from."""
ONE_STAGE = {"medusa": ("stage2.enabled=false",)}
"""Medusa's heads without stage 2: the held-out numbers are then the heads' alone (stage 2 would train the target's
layers again from the base target's)."""


def short(job: str) -> tuple[str, ...]:
    """The drafter's short settings (``tests/helpers.py SHORT``) for these tests."""
    return (*short_settings(job), *ONE_STAGE.get(job, ()))


def saved_tensors(run: Path, recipe) -> dict[str, torch.Tensor]:
    """Every tensor a run saved of its drafter (its own save and the export vLLM loads), by ``folder/name``."""
    tensors = {}
    for folder in (*recipe.spec.saved_entries, recipe.spec.vllm_weights):
        for f in sorted((run / folder).glob("*.safetensors")):
            tensors |= {f"{folder}/{k}": v for k, v in load_file(str(f)).items()}
    return tensors


def report(run: Path) -> dict:
    return json.loads((run / "report.json").read_text())


@pytest.fixture(scope="module")
def sources(tmp_path_factory, cache_dir):
    """A finished short run of each drafter (trained at the smoke rate: its weights far from random), made once."""
    made = {}

    def source(job: str) -> Path:
        if job not in made:
            out = tmp_path_factory.mktemp(f"source-{job}")
            train(job, smoke(job, out, cache_dir, *short(job), "eval.enabled=false"))
            made[job] = out
        return made[job]
    return source


@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
def test_init_from_is_declared_once_for_every_drafter(job):
    """Every drafter's section is a :class:`DrafterConfig` (none declares ``init_from`` again), null by default."""
    recipe = drafters.get(job)
    section = getattr(to_schema(smoke(job, "out", "cache")), job)
    assert isinstance(section, DrafterConfig) and section.init_from is None
    owners = [c for c in type(section).__mro__ if "init_from" in vars(c).get("__annotations__", {})]
    assert owners == [DrafterConfig], owners
    conf = to_schema(smoke(job, "out", "cache", f"{job}.init_from=runs/x"))
    assert getattr(conf, recipe.spec.name).init_from == "runs/x"


class Drafter(torch.nn.Module):
    """A backbone and, with ``head``, a head that may start fresh."""

    def __init__(self, width: int = 4, head: bool = True):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, 2) if head else None


def test_load_source_copies_every_tensor_leaves_fresh_heads_and_refuses_what_does_not_fit():
    """The backbone is copied exactly; a head matching a ``fresh`` pattern keeps its values when the source lacks it;
    a tensor missing outside those patterns, or of another shape, is refused naming the key, the file and the
    tensor, before anything is copied."""
    source, drafter = Drafter(head=False), Drafter()
    head = drafter.head.weight.detach().clone()
    init = load_source(drafter, Source(Path("runs/a"), "base", "run", source, "x.init_from"), ("head.*",))
    assert torch.equal(drafter.fc.weight, source.fc.weight) and torch.equal(drafter.head.weight, head)
    assert init == {"path": "runs/a", "drafter": "base", "kind": "run", "loaded": 2,
                    "fresh": ["head.bias", "head.weight"], "dropped": []}
    with pytest.raises(ValueError, match=r"x.init_from=runs/a: .*missing \['head.bias', 'head.weight'\]"):
        load_source(Drafter(), Source(Path("runs/a"), "base", "run", source, "x.init_from"), ())
    before = Drafter(width=3)
    kept = before.fc.weight.detach().clone()
    with pytest.raises(ValueError, match=r"shapes differ in .*'fc.weight': \(\(4, 4\), \(3, 3\)\)"):
        load_source(before, Source(Path("runs/a"), "base", "run", Drafter(), "x.init_from"), ())
    assert torch.equal(before.fc.weight, kept)


@pytest.mark.slow
@pytest.mark.parametrize("job", sorted(drafters.DRAFTERS))
@pytest.mark.parametrize("kind", ["run", "export"])
def test_a_warm_start_begins_where_its_source_ended(job, kind, sources, tmp_path, cache_dir):
    """From a finished run (its saved drafter) or from the export vLLM loads: the warm-started run's weights are
    the source's (its steps move nothing), so its held-out loss is the source's; the report says what was loaded."""
    recipe, src = drafters.get(job), sources(job)
    path = src if kind == "run" else src / recipe.spec.vllm_weights
    got = train(job, smoke(job, tmp_path, cache_dir, *short_settings(job), *STILL, f"{job}.init_from={path}"))
    init, mine = got["init_from"], saved_tensors(tmp_path, recipe)
    theirs = saved_tensors(src, recipe)
    assert mine.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], atol=1e-7, rtol=0, msg=k)
    assert init["path"] == str(path) and init["drafter"] == job and init["kind"] == kind and init["fresh"] == []
    dropped = [f"lm_heads.{i}.weight" for i in range(4)] if job == "medusa" and kind == "export" else []
    assert init["dropped"] == dropped  # vLLM's Medusa layout holds per-head LM heads; this config shares the target's
    assert init["loaded"] == len(load_file(str(next((path if kind == "export" else path / (
        recipe.spec.saved_entries or [recipe.spec.vllm_weights])[0]).glob("*.safetensors"))))) - len(dropped)
    source_val = report(src)["validation"]
    for name, value in got["validation"].items():
        assert value == pytest.approx(source_val[name], abs=1e-4), name


@pytest.mark.slow
def test_dspark_starts_from_a_dflash_run_with_its_own_heads_fresh(sources, tmp_path, cache_dir):
    """``dspark.init_from=<DFlash run>``: DFlash's tensors load into DSpark's DFlash part, exactly; the Markov and
    confidence heads start fresh, and the report and the log say so."""
    src = sources("dflash")
    got = train("dspark", smoke("dspark", tmp_path, cache_dir, *short("dspark"), *STILL,
                                f"dspark.init_from={src}"))
    dflash = load_file(str(src / "export" / "dflash" / "model.safetensors"))
    dspark = load_file(str(tmp_path / "export" / "dspark" / "model.safetensors"))
    fresh = sorted(dspark.keys() - dflash.keys())
    assert fresh == ["confidence_head.proj.bias", "confidence_head.proj.weight", "markov_head.markov_w1.weight",
                     "markov_head.markov_w2.weight"]
    for k in dflash:
        torch.testing.assert_close(dspark[k], dflash[k], atol=1e-7, rtol=0, msg=k)
    assert got["init_from"] == {"path": str(src), "drafter": "dflash", "kind": "run", "loaded": len(dflash),
                                "fresh": fresh, "dropped": []}


def no_work(*args, **kwargs):
    raise AssertionError("the rows and target states were reached: the source should have been refused before")


@pytest.mark.slow
@pytest.mark.parametrize("job, overrides, said", [
    ("dflash", ["model.tiny.hidden_size=128"], "'hidden_size': (64, 128)"),
    ("dflash", ["model.tiny.vocab_size=640"], "'vocab_size': (512, 640)"),
    ("dflash", ["dflash.target_layer_ids=[1,2]"], "dflash.target_layer_ids: {src} has [0, 1, 2, 3], this run [1, 2]"),
    ("dflash", ["dflash.num_layers=2"], "dflash.num_layers: {src} has 1, this run 2"),
    ("dspark", ["dspark.target_layer_ids=[1,2]"], "dspark.target_layer_ids: {src} has [0, 1, 2, 3], this run [1, 2]"),
    ("medusa", ["medusa.num_heads=3"], "medusa.num_heads: {src} has 4, this run 3"),
    ("medusa", ["model.tiny.hidden_size=128"], "hidden_size=64, vocab_size=512 but this run's target has "
                                               "hidden_size=128"),
    ("eagle3", ["eagle3.draft_vocab_size=128"], "eagle3.draft_vocab_size: {src} has 256, this run 128"),
    ("dspark", ["dspark.init_from={medusa}"], "a run of drafter 'medusa'; dspark starts from runs or exports of "
                                              "['dflash', 'dspark']"),
])
def test_a_source_made_for_another_target_or_drafter_is_refused_before_any_work(job, overrides, said, sources,
                                                                                 tmp_path, cache_dir, monkeypatch):
    """Checked when the job opens: the error names the key (or the target's field), the file and both values,
    and neither the rows nor the target states are reached (nor a report written)."""
    src = sources("dflash" if job == "dspark" else job)
    overrides = [o.format(medusa=sources("medusa")) for o in overrides]
    source_key = [] if any(".init_from=" in o for o in overrides) else [f"{job}.init_from={src}"]
    monkeypatch.setattr(train_job, "job_rows", no_work)
    with pytest.raises(ValueError) as error:
        train(job, smoke(job, tmp_path, cache_dir, *short(job), *source_key, *overrides))
    message = str(error.value)
    assert f"{job}.init_from=" in message and said.format(src=src) in message, message
    assert not (tmp_path / "report.json").exists() and not (tmp_path / "hidden_states").exists()


@pytest.mark.slow
def test_a_resumed_warm_start_ignores_the_source_and_ends_as_the_whole_run(sources, tmp_path, cache_dir):
    """``resume=true`` takes precedence over ``init_from``: a warm-started run cut back to a checkpoint resumes
    from it (even with the source gone) and ends with the drafter the whole run ended with, bit for bit; its report
    still says where the weights began (the checkpoint carries it)."""
    src = sources("dflash")
    args = (*short("dflash"), "train.epochs=2", "eval.enabled=false", "trainer.keep_last=100")
    whole = train("dflash", smoke("dflash", tmp_path / "whole", cache_dir, *args, f"dflash.init_from={src}"))
    cut = cut_back(tmp_path / "whole", "dflash-step000005", tmp_path / "cut")
    resumed = train("dflash", smoke("dflash", cut, cache_dir, *args, "resume=true",
                                    f"dflash.init_from={tmp_path / 'gone'}"))
    assert resumed["resumed_from"] == str(cut / "checkpoints" / "dflash-step000005")
    assert resumed["init_from"] == whole["init_from"] and whole["init_from"]["path"] == str(src)
    a, b = (load_file(str(d / "export" / "dflash" / "model.safetensors")) for d in (tmp_path / "whole", cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
