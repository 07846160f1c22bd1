"""``auto`` precision: bf16 where the hardware has it, float32 where bf16 would be emulated (issue 56), read from
cpuinfo's flags (monkeypatched here) and oneDNN's ISA cap; explicit settings kept, with a warning where emulated."""

import pytest
import torch

from draftheads.models import precision
from draftheads.models.precision import auto_dtype, choose_precision, native

NO_BF16 = {"avx2": True, "avx512_f": True, "avx512_bf16": False, "amx_bf16": False}
"""An AVX-512 CPU without bf16 (Skylake-X, Zen 3 has no AVX-512 at all)."""
AMX = {"avx2": True, "avx512_f": True, "avx512_bf16": True, "amx_bf16": True}


@pytest.fixture
def cpu(monkeypatch):
    """Set the CPU's flags; no ISA cap unless a test sets one."""
    for cap in precision.ISA_CAPS:
        monkeypatch.delenv(cap, raising=False)

    def flags(caps: dict):
        monkeypatch.setattr(precision, "_cpu_capabilities", lambda: dict(caps))
    return flags


def test_auto_chooses_float32_where_bf16_is_emulated(cpu):
    cpu(NO_BF16)
    chosen = choose_precision("auto", "cpu")
    assert chosen.value == "no" and not chosen.emulated
    assert "float32" in chosen.line and "avx512_bf16" in chosen.line
    assert auto_dtype("cpu")[0] == torch.float32


def test_auto_chooses_bf16_where_it_is_native(cpu):
    cpu(AMX)
    chosen = choose_precision("auto", "cpu")
    assert chosen.value == "bf16" and "bf16 autocast" in chosen.line and "amx_bf16" in chosen.line
    assert auto_dtype("cpu")[0] == torch.bfloat16
    cpu({"architecture": "arm64", "bf16": True})  # Arm's BF16 extension (Graviton 3, Apple M2+)
    assert choose_precision("auto", "cpu").value == "bf16"


@pytest.mark.parametrize("cap, value", [("AVX2", "no"), ("avx512_core", "no"), ("AVX512_CORE_VNNI", "no"),
                                        ("AVX512_CORE_BF16", "bf16"), ("AVX512_CORE_AMX", "bf16"), ("ALL", "bf16")])
def test_onednn_cap_below_bf16_counts_as_emulated(cpu, monkeypatch, cap, value):
    """``ONEDNN_MAX_CPU_ISA=AVX2`` makes oneDNN emulate bf16 on an AMX CPU (how CI reproduces an ordinary CPU)."""
    cpu(AMX)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    chosen = choose_precision("auto", "cpu")
    assert chosen.value == value
    if value == "no":
        assert f"ONEDNN_MAX_CPU_ISA={cap}" in chosen.line


def test_explicit_settings_are_kept_and_warned_where_emulated(cpu):
    cpu(NO_BF16)
    bf16 = choose_precision("bf16", "cpu")
    assert bf16.value == "bf16" and bf16.emulated and bf16.line.startswith("WARNING")
    assert choose_precision("no", "cpu").value == "no"
    cpu(AMX)
    assert not choose_precision("bf16", "cpu").emulated


def test_other_accelerators_keep_bf16(cpu):
    """On a GPU nothing changes: auto is bf16, as the default was (CUDA asks the device; others are taken as
    native)."""
    cpu(NO_BF16)
    assert native(torch.bfloat16, "xpu").native and choose_precision("auto", "mps").value == "bf16"
