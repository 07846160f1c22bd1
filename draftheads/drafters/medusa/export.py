"""Medusa heads to vLLM's and TGI's Medusa formats and draftheads' own format, each with a strict loader.

The servers forgive too much: vLLM's ``Medusa.load_weights`` skips names it does not know, TGI turns Medusa off
without an error when the config has ``architectures``. So writers check every tensor name and shape against
the expected set before writing, loaders check the files the same way, and both raise ``ValueError`` naming the
file and the key. Tensors keep their dtype (servers cast on load); loaders build ``MedusaHeads`` in the dtype of
the first block weight. Each file goes to a temporary name, then ``os.replace``; weights before config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from draftheads.models.export import check_tensors
from draftheads.drafters.medusa.heads import MedusaHeads

VLLM_WEIGHTS = "model.safetensors"
TGI_WEIGHTS = "medusa_lm_head.safetensors"
HEADS_CONFIG, HEADS_WEIGHTS = "medusa_heads.json", "medusa_heads.safetensors"
_HEADS_FIELDS = {"hidden_size": int, "vocab_size": int, "num_heads": int, "num_layers": int, "per_head_lm_head": bool}

# Layouts: file names of block (head i, layer j)'s linear layer and of head i's LM head (L layers per head),
# before ".weight"/".bias"; None when the file holds no LM heads.
VLLM_LAYOUT = ("blocks.{i}.layers.{j}", "lm_heads.{i}")
TGI_LAYOUT = ("{i}.{j}.linear", "{i}.{L}")


def _heads_layout(per_head_lm_head: bool) -> tuple[str, str | None]:
    return "blocks.{i}.{j}.linear", "lm_heads.{i}" if per_head_lm_head else None


def _name_map(K: int, L: int, block: str, lm: str | None) -> dict[str, str]:
    """``{MedusaHeads state_dict key: file key}`` for every tensor of the layout."""
    names = {}
    for i in range(K):
        for j in range(L):
            names |= {f"blocks.{i}.{j}.linear.{p}": f"{block.format(i=i, j=j)}.{p}" for p in ("weight", "bias")}
        if lm is not None:
            names[f"lm_heads.{i}.weight"] = lm.format(i=i, L=L) + ".weight"
    return names


def _check(tensors: dict[str, torch.Tensor], names: dict[str, str], D: int, V: int, where: Path) -> None:
    """``ValueError`` naming ``where`` and the key for a missing, unexpected or wrongly shaped tensor."""
    check_tensors(tensors, {file_key: (V, D) if key.startswith("lm_heads.") else (D, D) if key.endswith("weight")
                            else (D,) for key, file_key in names.items()}, where)


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write(folder: Path, weights_name: str, tensors: dict[str, torch.Tensor], config_name: str, config: dict) -> Path:
    text = json.dumps(config, indent=2) + "\n"  # fails before anything is written
    folder.mkdir(parents=True, exist_ok=True)
    _atomic(folder / weights_name, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    _atomic(folder / config_name, lambda p: p.write_text(text))
    return folder


def _export_tensors(heads: MedusaHeads, lm_head_weight: torch.Tensor | None, layout: tuple[str, str | None],
                    where: Path) -> dict[str, torch.Tensor]:
    """The heads' tensors under the layout's names; with a shared LM head, ``lm_head_weight`` for every head."""
    state = {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()}
    if lm_head_weight is not None:
        if lm_head_weight.ndim != 2:
            raise ValueError(f"lm_head_weight must be [V, D], got shape {tuple(lm_head_weight.shape)}")
        heads.check_target(lm_head_weight.shape[1], lm_head_weight.shape[0], where="lm_head_weight")
        if layout[1] is not None and not heads.per_head_lm_head:
            weight = lm_head_weight.detach().cpu().contiguous()  # cloned: safetensors refuses shared memory
            state |= {f"lm_heads.{i}.weight": weight.clone() for i in range(heads.num_heads)}
    names = _name_map(heads.num_heads, heads.num_layers, *layout)
    tensors = {names.get(k, k): v for k, v in state.items()}
    _check(tensors, names, heads.hidden_size, heads.vocab_size, where)
    return tensors


def _read_config(path: Path, fields: dict[str, type]) -> dict:
    """The JSON object at ``path``; ``ValueError`` naming the file and key if a field is missing or mistyped."""
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    for key, kind in fields.items():
        value = config.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{path}: {key!r} must be {kind.__name__}, got {value!r}")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{path}: missing")
    return load_file(str(path))


def _load_heads(tensors: dict[str, torch.Tensor], path: Path, K: int, L: int, D: int, V: int,
                layout: tuple[str, str | None]) -> MedusaHeads:
    """``MedusaHeads`` (per-head LM heads iff the layout has them) once ``tensors`` are exactly the layout's."""
    with torch.device("meta"):  # no allocation: the parameters become the file's tensors
        heads = MedusaHeads(D, V, K, L, per_head_lm_head=layout[1] is not None)
    names = _name_map(K, L, *layout)
    _check(tensors, names, D, V, path)
    dtype = tensors[names["blocks.0.0.linear.weight"]].dtype
    heads.load_state_dict({key: tensors[file_key].to(dtype) for key, file_key in names.items()}, assign=True)
    return heads


def export_vllm_medusa(heads: MedusaHeads, lm_head_weight: torch.Tensor, folder) -> Path:
    """Write ``heads`` as a vLLM Medusa draft (``--speculative-config '{"method": "medusa", "model": folder}'``).

    Matches vllm-project/vllm ``vllm/transformers_utils/configs/medusa.py`` (``MedusaConfig`` reads
    ``hidden_size``, ``vocab_size``, ``num_heads``, ``num_hidden_layers``, ``max_paths``, ``topk``,
    ``truncated_vocab_size``, and renames any key with "num" and "heads"/"layers", so there is no other such key)
    and ``vllm/model_executor/models/medusa.py`` (``blocks.{i}.layers.{j}``: ``nn.Linear(D, D,
    bias=medusa_fc_bias)`` in ``x + SiLU(W x + b)``; ``lm_heads.{i}``: [V, D] unless ``original_lm_head``;
    ``logit_scale`` 1.0). ``model_type: "medusa"`` selects the method (``vllm/config/speculative.py``).
    With ``truncated_vocab_size < vocab_size`` vLLM would need a ``token_map`` tensor, keep those rows of each LM
    head and scatter logits into a -inf full-vocab tensor; we export the full vocab, ``truncated == vocab_size``.

    Args:
        heads: the trained heads, any float dtype.
        lm_head_weight: the target's LM head weight ``[V, D]``; with shared heads, written as every
            ``lm_heads.{i}.weight`` (K copies on disk and in memory); otherwise only its shape is checked.
        folder: created if needed; must hold no other ``*.safetensors`` (vLLM loads them all).
    Returns:
        ``folder``: ``config.json``, ``model.safetensors`` (``blocks.{i}.layers.{j}.weight`` [D, D], ``.bias`` [D],
        ``lm_heads.{i}.weight`` [V, D]).
    Raises:
        ValueError: wrong ``lm_head_weight`` shape, a name or shape outside the expected set, a stray
            ``*.safetensors`` in ``folder``.
    """
    folder = Path(folder)
    stray = sorted(p.name for p in folder.glob("*.safetensors") if p.name != VLLM_WEIGHTS)
    if stray:
        raise ValueError(f"{folder}: holds {stray}; vLLM would load them with {VLLM_WEIGHTS}")
    tensors = _export_tensors(heads, lm_head_weight, VLLM_LAYOUT, folder / VLLM_WEIGHTS)
    D, V = heads.hidden_size, heads.vocab_size
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": D, "vocab_size": V,
              "truncated_vocab_size": V, "num_heads": heads.num_heads, "num_hidden_layers": heads.num_layers,
              "medusa_fc_bias": True, "original_lm_head": False, "logit_scale": 1.0, "max_paths": 64, "topk": 10}
    return _write(folder, VLLM_WEIGHTS, tensors, "config.json", config)


def load_vllm_medusa(folder) -> MedusaHeads:
    """Read an :func:`export_vllm_medusa` folder back as ``MedusaHeads`` with ``per_head_lm_head=True``.

    Raises ``ValueError`` naming the file and key for a missing or mistyped config field, ``model_type`` not
    "medusa", ``medusa_fc_bias`` false, ``original_lm_head`` true, ``logit_scale`` not 1,
    ``truncated_vocab_size != vocab_size``, or a missing, unexpected or misshaped tensor.
    """
    path = Path(folder) / "config.json"
    sizes = ("num_heads", "num_hidden_layers", "hidden_size", "vocab_size", "truncated_vocab_size")
    config = _read_config(path, {"model_type": str, "medusa_fc_bias": bool, **dict.fromkeys(sizes, int)})
    if (config["model_type"] != "medusa" or not config["medusa_fc_bias"] or config.get("original_lm_head", False)
            or config.get("logit_scale", 1.0) != 1.0):
        raise ValueError(f"{path}: need model_type 'medusa', medusa_fc_bias true, original_lm_head false and "
                         f"logit_scale 1.0")
    if config["truncated_vocab_size"] != config["vocab_size"]:
        raise ValueError(f"{path}: truncated_vocab_size {config['truncated_vocab_size']} != vocab_size "
                         f"{config['vocab_size']} (token_map checkpoints are not supported)")
    weights = Path(folder) / VLLM_WEIGHTS
    K, L, D, V = (config[k] for k in sizes[:4])
    return _load_heads(_read_tensors(weights), weights, K, L, D, V, VLLM_LAYOUT)


def export_tgi_medusa(heads: MedusaHeads, lm_head_weight: torch.Tensor, folder, base_model_name_or_path: str) -> Path:
    """Write ``heads`` in the FasterDecoding/Medusa layout TGI serves (``text-generation-launcher --model-id folder``).

    Matches huggingface/text-generation-inference ``server/text_generation_server/``: ``models/__init__.py``
    (``get_model``: Medusa iff the config has ``medusa_num_heads``, also the speculation depth; serves
    ``base_model_name_or_path``; reads ``medusa_lm_head.safetensors``), ``layers/speculative.py`` (any
    ``architectures`` key silently turns Medusa off), ``layers/medusa.py`` (``MedusaHeadV1``: ``{i}.{j}.linear``
    with bias for j < L = ``medusa_num_layers``, then ``{i}.{L}`` [V, D] without bias, always required; the
    ``MedusaHeadV2`` fallback needs L == 1). FasterDecoding/Medusa ``medusa/model/medusa_model.py`` uses the same
    config keys and names (head = ``nn.Sequential(L ResBlocks, nn.Linear(D, V, bias=False))``), but its own
    loader reads ``medusa_lm_head.pt`` (not written) and repeats one ResBlock L times: exact only for L == 1.

    Args:
        heads: the trained heads, any float dtype.
        lm_head_weight: the target's LM head weight ``[V, D]``; with shared heads, written as every
            ``{i}.{L}.weight`` (TGI requires it); otherwise only its shape is checked.
        folder: created if needed.
        base_model_name_or_path: the target TGI serves with these heads: a hub id or a path. TGI reads a
            relative path from the server's working directory, not from this folder: whoever serves a relative
            one (``../target``, the stage-2 target beside a run's ``export/tgi``) sets it to where the target lies.
    Returns:
        ``folder``: ``config.json`` (no ``architectures``), ``medusa_lm_head.safetensors`` (``{i}.{j}.linear.weight``
        [D, D], ``.bias`` [D], ``{i}.{L}.weight`` [V, D]).
    Raises:
        ValueError: wrong ``lm_head_weight`` shape, a name or shape outside the expected set.
    """
    folder = Path(folder)
    tensors = _export_tensors(heads, lm_head_weight, TGI_LAYOUT, folder / TGI_WEIGHTS)
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers,
              "base_model_name_or_path": base_model_name_or_path}
    return _write(folder, TGI_WEIGHTS, tensors, "config.json", config)


def load_tgi_medusa(folder, vocab_size: int | None = None) -> MedusaHeads:
    """Read a TGI Medusa folder as ``MedusaHeads``, in either layout TGI serves (``layers/medusa.py``: it tries
    ``MedusaHeadV1``, then ``MedusaHeadV2``):

    - V1, what :func:`export_tgi_medusa` writes: ``{i}.{j}.linear`` blocks and a per-head LM head ``{i}.{L}``
      (``per_head_lm_head=True``; D and V from ``0.0.linear.weight`` and ``0.{L}.weight``);
    - V2, what FasterDecoding/Medusa's current trainer writes (``config.json`` ``"version": "2"``): the blocks only,
      ``medusa_num_layers`` 1, logits through the target's own LM head (``per_head_lm_head=False``); the file has
      no vocabulary size, so ``vocab_size`` (the target's) is required.

    Raises ``ValueError`` naming the file and key for a missing or mistyped config field, an ``architectures``
    key, a V2 folder without ``vocab_size`` or with more than one layer, or a missing, unexpected or misshaped
    tensor.
    """
    path = Path(folder) / "config.json"
    config = _read_config(path, {"medusa_num_heads": int, "medusa_num_layers": int, "base_model_name_or_path": str})
    if "architectures" in config:
        raise ValueError(f"{path}: has 'architectures', which makes TGI ignore the Medusa heads")
    K, L = config["medusa_num_heads"], config["medusa_num_layers"]
    weights = Path(folder) / TGI_WEIGHTS
    tensors = _read_tensors(weights)
    if "0.0.linear.weight" not in tensors:
        raise ValueError(f"{weights}: missing tensor '0.0.linear.weight'")
    D = tensors["0.0.linear.weight"].shape[-1]
    if f"0.{L}.weight" in tensors:
        return _load_heads(tensors, weights, K, L, D, tensors[f"0.{L}.weight"].shape[0], TGI_LAYOUT)
    if L != 1:
        raise ValueError(f"{weights}: no per-head LM head '0.{L}.weight', and the MLP-only layout TGI reads "
                         f"(MedusaHeadV2) has medusa_num_layers 1, but {path} says {L}")
    if vocab_size is None:
        raise ValueError(f"{weights}: MLP-only heads (no '0.{L}.weight'; config version {config.get('version')!r}) "
                         f"use the target's LM head: pass the target's vocab_size to read them")
    return _load_heads(tensors, weights, K, L, D, vocab_size, (TGI_LAYOUT[0], None))


def save_heads(heads: MedusaHeads, folder, extra_config: dict) -> Path:
    """Save trained heads in draftheads' model-only format (what :func:`load_heads` reads).

    Args:
        heads: the heads, any float dtype.
        folder: created if needed.
        extra_config: JSON-serialisable fields stored beside the sizes, e.g. the target's identity; may not
            reuse a size field name.
    Returns:
        ``folder`` with ``medusa_heads.json`` (``hidden_size``, ``vocab_size``, ``num_heads``, ``num_layers``,
        ``per_head_lm_head`` and ``extra_config``) and ``medusa_heads.safetensors`` (``heads.state_dict()``:
        ``blocks.{i}.{j}.linear.weight`` [D, D], ``.bias`` [D], and ``lm_heads.{i}.weight`` [V, D] only with
        per-head LM heads; a shared LM head stays with the target).
    Raises:
        ValueError: ``extra_config`` reuses a size field, or a tensor name or shape outside the expected set.
    """
    folder = Path(folder)
    clash = sorted(_HEADS_FIELDS.keys() & extra_config.keys())
    if clash:
        raise ValueError(f"extra_config may not set {clash}")
    tensors = _export_tensors(heads, None, _heads_layout(heads.per_head_lm_head), folder / HEADS_WEIGHTS)
    config = {"hidden_size": heads.hidden_size, "vocab_size": heads.vocab_size, "num_heads": heads.num_heads,
              "num_layers": heads.num_layers, "per_head_lm_head": heads.per_head_lm_head, **extra_config}
    return _write(folder, HEADS_WEIGHTS, tensors, HEADS_CONFIG, config)


def load_heads(folder) -> tuple[MedusaHeads, dict]:
    """Read a :func:`save_heads` folder: ``(heads, extra_config)``. Raises ``ValueError`` naming the file and key
    for a missing or mistyped size field, or a missing, unexpected or misshaped tensor."""
    folder = Path(folder)
    config = _read_config(folder / HEADS_CONFIG, _HEADS_FIELDS)
    weights = folder / HEADS_WEIGHTS
    K, L, D, V = (config[k] for k in ("num_heads", "num_layers", "hidden_size", "vocab_size"))
    heads = _load_heads(_read_tensors(weights), weights, K, L, D, V, _heads_layout(config["per_head_lm_head"]))
    return heads, _extra(config)


def saved_fields(folder) -> dict:
    """The fields a :func:`save_heads` folder stores beside the sizes (``extra_config``), without reading its
    weights. Raises ``ValueError`` naming the file and key for a missing or mistyped size field."""
    return _extra(_read_config(Path(folder) / HEADS_CONFIG, _HEADS_FIELDS))


def _extra(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in _HEADS_FIELDS}


def load_any_heads(folder, vocab_size: int | None = None) -> MedusaHeads:
    """Heads from a folder in any format written here, told apart by its files: draftheads' own
    (``medusa_heads.json``), TGI's (``medusa_lm_head.safetensors``, either layout: :func:`load_tgi_medusa`, which
    takes the target's ``vocab_size``) or vLLM's (``model.safetensors``), each read by its strict loader. Raises
    ``FileNotFoundError`` for a folder in none of them."""
    folder = Path(folder)
    if (folder / HEADS_CONFIG).exists():
        return load_heads(folder)[0]
    if (folder / TGI_WEIGHTS).exists():
        return load_tgi_medusa(folder, vocab_size)
    if (folder / VLLM_WEIGHTS).exists():
        return load_vllm_medusa(folder)
    raise FileNotFoundError(f"{folder} holds no Medusa heads ({HEADS_CONFIG}, {TGI_WEIGHTS} or {VLLM_WEIGHTS} "
                            f"expected)")
