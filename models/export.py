"""Serving formats for trained drafters (vLLM, SGLang, TGI) and draftheads' own model-only format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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


def write_folder(out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict,
                 expected: dict[str, tuple[int, ...]], weights: str = "model.safetensors") -> Path:
    """A server's HF-style folder: ``weights`` (safetensors) and ``config.json``, each written whole and renamed
    (weights first, so a folder with a config is complete). Raises ``ValueError`` (:func:`check_tensors`) before
    writing anything when the tensors do not match ``expected``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_tensors(tensors, expected, out / weights)
    tmp = out / (weights + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / weights)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True))
    os.replace(tmp, out / "config.json")
    return out


def read_folder(path: str | Path, required: tuple[str, ...], kind: str,
                weights: str = "model.safetensors") -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` (as a dict) and the tensors of a folder :func:`write_folder` wrote. Raises
    ``FileNotFoundError`` naming the missing file, ``ValueError`` naming a ``required`` config field that is
    missing (then the folder is not ``kind``, which carries its article: "an EAGLE-3 draft")."""
    path = Path(path)
    for name in ("config.json", weights):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path}: no {name} ({kind} export holds config.json and {weights})")
    raw = json.loads((path / "config.json").read_text())
    for key in required:
        if key not in raw:
            raise ValueError(f"{path / 'config.json'}: missing field {key!r}; not {kind} config")
    return raw, load_file(str(path / weights))
