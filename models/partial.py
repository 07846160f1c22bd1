"""A target without its decoder layers, for training from the offline state cache: the trainer holds what it
trains against, not the model.

With the target's states on disk (``train/cache_hidden_states.py``), Medusa stage 1 needs only the LM head (the
cached state is after the final norm), DFlash and EAGLE-3 the input embedding and the LM head, Medusa stage 2
the last N layers it trains besides (run on the cached output of the layer before them). A partial target
(``model.partial=true``) is the target's module tree with every parameter on the meta device (no memory), and
the input embedding, the final norm and the LM head read from its safetensors checkpoint: its memory is
``(2 V D + D)`` parameters untied (``V D + D`` tied) whatever the depth, against ``~12 L D^2 + 2 V D`` for the
whole model, plus N decoder layers held by :func:`hold_layers` (Medusa stage 2). Anything that would run the other
decoder layers (regeneration, a state forward, the evaluator) is refused with an error that says what to do
instead.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

PARTS = "input embedding, final norm and LM head"
"""What a partial target holds."""


class WeightFiles:
    """The tensors of a safetensors checkpoint folder (``model.safetensors`` or a sharded
    ``model.safetensors.index.json``) by name, each read on demand from its memory-mapped file.

    Raises ``FileNotFoundError`` for a folder with neither."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index, single = self.folder / "model.safetensors.index.json", self.folder / "model.safetensors"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif single.is_file():
            with safe_open(str(single), "pt") as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.folder}: no model.safetensors or model.safetensors.index.json (a partial "
                                    f"target reads a safetensors checkpoint; use model.partial=false)")

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, dtype: torch.dtype, count: int | None = None) -> torch.Tensor:
        """Tensor ``name`` in ``dtype``; with ``count``, its first ``count`` values flattened, reading only the
        leading rows that hold them. Raises ``ValueError`` naming the folder when the checkpoint lacks it (a
        checkpoint whose tensor names are not the model's: transformers renames some architectures' on load)."""
        if name not in self.files:
            raise ValueError(f"{self.folder}: the checkpoint has no tensor {name!r}, which the model names so; a "
                             f"partial target needs the checkpoint's names to be the model's (use model.partial=false)")
        with safe_open(str(self.files[name]), "pt") as f:
            if count is None:
                return f.get_tensor(name).to(dtype)
            part = f.get_slice(name)
            shape = part.get_shape()
            row = math.prod(shape[1:])
            head = part[:-(-count // row)] if shape and row else f.get_tensor(name)
            return head.to(dtype).flatten()[:count]


def part_names(model: PreTrainedModel) -> list[str]:
    """Parameter names of ``model``'s input embedding, final norm (``get_decoder().norm``) and LM head. Raises
    ``ValueError`` for a decoder without a ``norm``."""
    decoder = model.get_decoder()
    if not isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        raise ValueError(f"{type(model).__name__}: its decoder has no final norm module ('norm'); a partial target "
                         f"cannot be made for it (use model.partial=false)")
    modules = {id(m): m for m in (model.get_input_embeddings(), decoder.norm, model.get_output_embeddings())}
    return [f"{name}.{p}" for name, module in model.named_modules() if id(module) in modules
            for p, _ in module.named_parameters(recurse=False)]


def load_partial_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str = "cpu") -> PreTrainedModel:
    """The causal LM of checkpoint ``folder`` with only its :data:`PARTS` loaded (in ``dtype`` on ``device``);
    every other parameter stays on the meta device, buffers (RoPE) are real. Eval mode, frozen; its
    ``generation_config`` is the checkpoint's. Raises ``FileNotFoundError``/``ValueError`` from
    :class:`WeightFiles`."""
    folder = Path(folder)
    files = WeightFiles(folder)
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lm_head = model.get_output_embeddings()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    lm_head_weight = f"{next(n for n, m in model.named_modules() if m is lm_head)}.weight"
    for name in part_names(model):
        if not (tied and name == lm_head_weight and name not in files):  # tied: the embedding's, loaded once
            set_module_tensor_to_device(model, name, device, value=files.read(name, dtype))
    if tied:
        lm_head.weight = model.get_input_embeddings().weight
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:
        model.generation_config = GenerationConfig.from_model_config(config)
    model.eval().requires_grad_(False)
    model.partial_weights = files
    return model


def place(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``model.to(device)`` for a model that may hold meta parameters (a partial target): the loaded tensors
    move, meta ones stay, tied parameters stay one."""
    if not any(p.is_meta for p in model.parameters()):
        return model.to(device)
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is not None and not t.is_meta:
                    if id(t) not in moved:
                        moved[id(t)] = (torch.nn.Parameter(t.data.to(device), requires_grad=t.requires_grad)
                                        if isinstance(t, torch.nn.Parameter) else t.to(device))
                    store[name] = moved[id(t)]
    return model


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's own list of decoder layers (``model.model.layers`` for Llama, Qwen, Mistral...).

    Raises ``ValueError`` when the architecture keeps them elsewhere.
    """
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layer list of {type(model).__name__} "
                     f"(looked for .layers, .h, .blocks on {type(base).__name__})")


def hold_layers(model: PreTrainedModel, indices: Sequence[int]) -> None:
    """Read decoder layers ``indices`` of a partial target from its checkpoint, in the dtype and on the device of
    its loaded ends (Medusa stage 2 trains the last N: the trainer then holds those and the ends). A whole
    target holds them already."""
    if not is_partial(model):
        return
    layers, embedding = decoder_layers(model), model.get_input_embeddings().weight
    prefix = next(n for n, m in model.named_modules() if m is layers)
    for i in indices:
        for name, p in list(layers[i].named_parameters()) + list(layers[i].named_buffers()):
            if p.is_meta:
                full = f"{prefix}.{i}.{name}"
                set_module_tensor_to_device(model, full, embedding.device,
                                            value=model.partial_weights.read(full, embedding.dtype))


def save_partial(model: PreTrainedModel, folder: str | Path) -> Path:
    """Write a partial target as a whole checkpoint into ``folder``: its source checkpoint's files one at a time,
    each tensor the model holds (trained layers, its ends) replacing the checkpoint's (in the checkpoint's dtype),
    every other one copied; the shard index, ``config.json`` and ``generation_config.json`` beside them. Memory
    is one source file. Returns ``folder``."""
    files, folder = model.partial_weights, Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    held = {name: t for name, t in model.state_dict().items() if not t.is_meta}
    for source in sorted(set(files.files.values())):
        tensors = {}
        with safe_open(str(source), "pt") as f:
            metadata = f.metadata()
            for name in f.keys():
                kept = f.get_tensor(name)
                tensors[name] = held[name].detach().to("cpu", kept.dtype).contiguous() if name in held else kept
        save_file(tensors, str(folder / source.name), metadata=metadata)
    for name in ("model.safetensors.index.json", "config.json", "generation_config.json"):
        if (files.folder / name).is_file():
            shutil.copyfile(files.folder / name, folder / name)
    return folder


def is_partial(model) -> bool:
    """Whether ``model`` is a partial target (:func:`load_partial_model`)."""
    return getattr(model, "partial_weights", None) is not None


def refuse_partial(model, what: str, instead: str) -> None:
    """``ValueError`` when ``model`` is a partial target: ``what`` runs its decoder layers; ``instead`` says how."""
    if is_partial(model):
        raise ValueError(f"model.partial=true holds only the target's {PARTS}, and {what} runs its decoder layers: "
                         f"{instead}")


def named_weights(model: torch.nn.Module, count: int | None = None) -> Iterator[tuple[str, torch.Size, torch.Tensor]]:
    """``(name, shape, values)`` for every tensor of ``model.state_dict()``: its values, or with ``count`` its
    first ``count`` values flattened. A partial target's unloaded tensors are read from its checkpoint one at a
    time (in the dtype the model declares), so fingerprints of a partial and a whole target agree."""
    files = getattr(model, "partial_weights", None)
    for name, tensor in model.state_dict().items():
        if tensor.is_meta:
            yield name, tensor.shape, files.read(name, tensor.dtype, count)
        else:
            yield name, tensor.shape, tensor.detach() if count is None else tensor.detach().flatten()[:count]
