"""Shared fixtures: a tiny random Llama target built once per session in a temporary cache, and a fresh
accelerate state for every test; under pytest-xdist (README's ``-n 2``) each worker on a core of its own."""

import os

import pytest
import torch
from accelerate.state import AcceleratorState

from draftheads.models.target import TINY, TargetSpec, load_target


def pytest_configure(config):
    """A pytest-xdist worker (``PYTEST_XDIST_WORKER`` gw0, gw1, ...) runs on one core of the session's affinity,
    its index modulo their number, and so does everything it starts: torch on one thread, the jobs it launches (2
    ranks share the core, one thread each: ``draftheads.training.runtime``), vLLM's engine bound there
    (``VLLM_CPU_OMP_THREADS_BIND``; by default it binds cores of its own choosing) and llama-server on the cores of its
    affinity. Two workers on two cores then never oversubscribe them, where two unpinned ones would run their
    threads on both (spinning OpenMP and ggml threads, many times slower). Each worker has its own temporary cache
    (``cache_dir``), and ``--dist loadfile`` keeps a module's fixtures on one worker."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix("gw")) % len(cores)]
    os.sched_setaffinity(0, {core})
    os.environ |= {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)}
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The modules that hold slow tests first, in their own order: ``--dist loadfile`` hands whole modules to the
    workers in the order collected, and the longest ones (``tests/training``, collected last) started last would
    leave one worker running alone at the end while the other has finished."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each part is kept


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
