"""DFlash 2 drafter to the HF-style folder vLLM loads (``method: dflash`` with ``architectures:
["DFlash2DraftModel"]``: ``model_executor/models/registry.py:636`` -> ``qwen3_dflash2.py``'s
``DFlash2Qwen3ForCausalLM``), with a strict loader.

Layout (checked against vLLM 0.32's ``qwen3_dflash2.py``, its ``qwen3_dflash.py`` loader and speculators 0.9.0's
``dflash2`` model, whose config its ``update_dflash2`` converts to this one):
- ``config.json``: DFlash's (:mod:`draftheads.drafters.dflash.export`) with ``architectures:
  ["DFlash2DraftModel"]`` and, in ``dflash_config``, ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
  ``selector_top_k`` (``qwen3_dflash2.py:253-254``, :385-386); vLLM's optional ``input_embedding_scale``,
  ``output_multiplier`` and ``final_logit_softcapping`` are left out (their defaults: 1, 1, none).
- ``model.safetensors``: DFlash's tensors, then per layer ``layers.{i}.{attention,mlp}_conv.base_kernel``
  ``[2, taps, D]`` and ``layers.{i}.{attention,mlp}_conv.kernel_projection.weight`` ``[2 * taps * D / group, D]``,
  and ``candidate_selector.{predecessor,successor}_codebook`` ``[V, r]``,
  ``candidate_selector.hidden_projection.weight`` ``[r, D]``; no ``model.`` prefix (vLLM's DFlash loader adds one,
  ``qwen3_dflash.py:901-902``).
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedModel

from draftheads.drafters.dflash.export import expected_shapes as dflash_shapes
from draftheads.drafters.dflash.export import server_config as dflash_server_config
from draftheads.drafters.dflash2.model import DFlash2DraftModel
from draftheads.models.export import check_tensors, read_folder, write_folder
from draftheads.models.target import check_made_for

WEIGHTS = "model.safetensors"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""DFlash 2's keys of ``dflash_config`` (beside DFlash's), each required on load."""


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout and its shape, from a draft config."""
    d, D, V = config.dflash_config, config.hidden_size, config.vocab_size
    taps, groups, r = int(d["conv_kernel_size"]), D // int(d["conv_group_size"]), int(d["selector_rank"])
    shapes = dflash_shapes(config)
    for i in range(config.num_hidden_layers):
        for conv in ("attention_conv", "mlp_conv"):
            p = f"layers.{i}.{conv}."
            shapes |= {p + "base_kernel": (2, taps, D), p + "kernel_projection.weight": (2 * taps * groups, D)}
    return shapes | {"candidate_selector.predecessor_codebook": (V, r), "candidate_selector.successor_codebook": (V, r),
                     "candidate_selector.hidden_projection.weight": (r, D)}


def server_config(model: DFlash2DraftModel) -> dict:
    """The ``config.json`` dict: DFlash's, DFlash 2's architecture and keys."""
    config = dflash_server_config(model)
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] |= {key: int(model.config.dflash_config[key]) for key in KEYS}
    return config


def export_dflash2(model: DFlash2DraftModel, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (atomically, weights first). Raises
    ``ValueError`` when the drafter's tensors do not match the layout."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return write_folder(out_dir, tensors, server_config(model), expected_shapes(model.config), WEIGHTS)


def load_dflash2(path: str | Path, target: PreTrainedModel) -> DFlash2DraftModel:
    """A drafter from an export folder, bound to ``target``'s embedding and LM head (the file's dtype, on
    ``target``'s device).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for a config that is not a DFlash 2 draft
    (another architecture, a key of ``dflash_config`` missing), tensors that do not match the layout, or a drafter
    made for another target.
    """
    raw, tensors = read_folder(path, ("block_size", "num_target_layers", "dflash_config"), "a DFlash 2 draft", WEIGHTS)
    missing = [key for key in KEYS if key not in raw["dflash_config"]]
    if raw.get("architectures") != ["DFlash2DraftModel"] or missing:
        raise ValueError(f"{Path(path) / 'config.json'}: not a DFlash 2 draft (architectures "
                         f"{raw.get('architectures')}; dflash_config lacks {missing})")
    config = AutoConfig.from_pretrained(path)
    check_tensors(tensors, expected_shapes(config), Path(path) / WEIGHTS)
    model = DFlash2DraftModel(config, target.get_input_embeddings().weight, target.get_output_embeddings())
    check_made_for(model.config, target.config, f"{path}: DFlash 2 drafter")
    model.load_state_dict(tensors, strict=True)
    return model.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype).eval()
