"""Shared fixtures: a tiny random Llama target built once per session in a temporary cache."""

import pytest
import torch

from draftheads.models.target import TINY, TargetSpec, load_target


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("draftheads-cache")


@pytest.fixture(scope="session")
def tiny(cache_dir):
    """``(model, tokenizer)`` of the tiny random Llama (hidden 64, 4 layers, ChatML BPE vocab 512)."""
    torch.manual_seed(0)
    model, tokenizer, _ = load_target(TargetSpec(name_or_path=TINY), cache_dir)
    return model, tokenizer
