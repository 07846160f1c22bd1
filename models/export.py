"""Serving formats for trained drafters (vLLM, SGLang, TGI) and draftheads' own model-only format."""

from __future__ import annotations

from pathlib import Path

import torch


def check_tensors(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: Path) -> None:
    """``ValueError`` naming ``where`` and the key for a missing, unexpected or wrongly shaped tensor (servers
    skip or mis-load such tensors silently, so every writer and loader checks against its full layout)."""
    missing, unexpected = sorted(expected.keys() - tensors.keys()), sorted(tensors.keys() - expected.keys())
    if missing:
        raise ValueError(f"{where}: missing tensors {missing}")
    if unexpected:
        raise ValueError(f"{where}: unexpected tensors {unexpected}")
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(tensors[key].shape)}, expected {shape}")
