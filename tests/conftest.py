"""Shared fixtures: a tiny random Llama target built once per session in a temporary cache, and a fresh
accelerate state for every test."""

import pytest
import torch
from accelerate.state import AcceleratorState

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


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """Every in-process job makes its Accelerator as a new process would: accelerate keeps one state per
    process and refuses another mixed precision, so a test that trains in float32 would otherwise break every
    later bf16 job of the session (order-dependent failures)."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
