"""The drafter contract: each drafter's declaration (``DrafterSpec``) and the behaviours its recipe must define."""

import dataclasses
import re

import pytest

from draftheads import drafters
from draftheads.drafters.contract import FeatureRecipe, Recipe
from draftheads.drafters.spec import DrafterSpec
from draftheads.serving.matrix import Served
from draftheads.training.config import RunConfig


def test_a_spec_fills_the_defaults_of_a_drafter_on_target_layers_and_keeps_what_it_is_given():
    spec = DrafterSpec("mine", RunConfig, ("mine",))
    assert (spec.stages, spec.vllm_weights, spec.vllm_method) == (("mine",), "export/mine", "mine")
    given = DrafterSpec("mine", RunConfig, ("mine",), stages=("a", "b"), vllm_weights="export/vllm", vllm_method="x")
    assert (given.stages, given.vllm_weights, given.vllm_method) == (("a", "b"), "export/vllm", "x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"


def test_a_spec_refuses_a_name_that_cannot_name_a_job_and_a_serving_row_declared_twice():
    for bad in ("My-Drafter", "Mine", "", "my_drafter", "_mine", "tøy", "class", "1mine"):
        with pytest.raises(ValueError, match=r"\[a-z\]\[a-z0-9\]\*"):
            DrafterSpec(bad, RunConfig, ("x",))
    row = Served("export/mine", "mine", {})
    with pytest.raises(ValueError, match="two serving rows"):
        DrafterSpec("mine", RunConfig, ("mine",), serving=(row, row))
    variant = dataclasses.replace(row, variant="flags")
    spec = DrafterSpec("mine", RunConfig, ("mine",), serving=(row, variant))
    assert spec.served("export/mine", "flags") is variant and spec.served("export/mine", "other") is row
    with pytest.raises(KeyError, match="declares no serving row for export/tgi"):
        spec.served("export/tgi")


@pytest.mark.parametrize("fields, says", [
    ({"schema": dict}, "no RunConfig subclass"),
    ({"methods": ()}, "methods names none"),
    ({"methods": "mine"}, "methods must be a tuple"),
    ({"stages": "stage1"}, "stages must be a tuple"),
    ({"methods": ("mine(",)}, "no regular expression"),
    ({"vllm_weights": "weights/mine"}, "must lie under the run's export/"),
    ({"vllm_weights": "export/../../mine"}, "must lie under the run's export/"),
    ({"serving": (Served("tgi", "mine", {}),)}, "must lie under the run's export/"),
    ({"serving": (Served("export/tgi", "mine", {}),)}, "no serving row for export/mine"),
])
def test_a_spec_refuses_at_once_what_would_break_later(fields, says):
    """A string where a tuple belongs would be read a character at a time; a method that is no pattern would break
    every job's check of ``eval.peers``; an export outside ``export/`` is what an overwriting run refuses as files no
    run writes; vLLM's preflight and parity read the serving row of the folder vLLM loads."""
    with pytest.raises(ValueError, match=says):
        DrafterSpec(**{"name": "mine", "schema": RunConfig, "methods": ("mine",), **fields})


def test_a_recipe_without_a_behaviour_it_must_define_is_refused_where_it_is_built():
    class Half(Recipe):
        spec = DrafterSpec("half", RunConfig, ("half",))

        def train(self, job, rows):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="abstract methods.*chain"):
        Half()

    class Feature(FeatureRecipe):
        spec = DrafterSpec("feature", RunConfig, ("feature",))

    with pytest.raises(TypeError, match="build"):
        Feature()

    class Nameless(type(drafters.get("dflash"))):
        spec = None

    with pytest.raises(TypeError, match="Nameless declares no spec"):
        Nameless()


@pytest.mark.parametrize("name", sorted(drafters.DRAFTERS))
def test_each_registered_spec_names_its_job_config_and_methods(name):
    """The registry's name is the spec's, its schema's ``drafter`` default and the config section it reads; the
    serving rows name the folders it writes, the one vLLM loads among them."""
    spec = drafters.get(name).spec
    assert spec.name == name and spec.schema().drafter == name and hasattr(spec.schema(), name)
    assert spec.methods and all(re.compile(p) for p in spec.methods)
    assert spec.vllm_weights in {row.export for row in spec.serving}
    assert all(row.export.startswith("export/") for row in spec.serving)
