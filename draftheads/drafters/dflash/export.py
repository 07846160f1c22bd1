"""DFlash drafter to the HF-style folder that vLLM (``method: dflash``), SGLang (``--speculative-algorithm
DFLASH``) and z-lab's reference code load, with a strict loader.

Layout (checked against vLLM's ``qwen3_dflash.py``/``dflash.py``, SGLang's ``models/dflash.py`` and
``speculative/dflash_utils.py``):
- ``config.json``: ``architectures: ["DFlashDraftModel"]``, ``model_type: qwen3`` (the layers vLLM and SGLang
  build for any target), ``block_size``,
  ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids}`` and the decoder fields
  (``num_hidden_layers`` = draft depth, ``vocab_size`` = the target's).
- ``model.safetensors``: ``fc.weight`` ``[D, K*D]``, ``hidden_norm.weight``, ``norm.weight``,
  ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.{q,k}_norm.weight``,
  ``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``layers.{i}.{input,post_attention}_layernorm.weight``; no
  ``model.`` prefix (vLLM adds one), no embedding or LM head (both servers then share the target's).

SGLang skips unknown weight names silently, so names and shapes are checked here on write and on load;
errors name the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedModel

from draftheads.drafters.dflash.model import DFlashDraftModel
from draftheads.models.export import check_tensors, read_folder, write_folder
from draftheads.models.target import check_made_for

WEIGHTS = "model.safetensors"


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout and its shape, from a draft config."""
    D, Di = config.hidden_size, config.intermediate_size
    hd = getattr(config, "head_dim", None) or D // config.num_attention_heads
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    K = len(config.dflash_config["target_layer_ids"])
    shapes = {"fc.weight": (D, K * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (Hkv * hd, D),
                   p + "self_attn.v_proj.weight": (Hkv * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                   p + "mlp.gate_proj.weight": (Di, D), p + "mlp.up_proj.weight": (Di, D),
                   p + "mlp.down_proj.weight": (D, Di),
                   p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return shapes


def server_config(model: DFlashDraftModel) -> dict:
    """The ``config.json`` dict: the draft config with every field the servers read made explicit."""
    c = model.config
    config = c.to_dict()
    for key in ("_name_or_path", "transformers_version", "quantization_config", "auto_map"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    config |= {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": model.block_size,
               "num_target_layers": c.num_target_layers,
               "dflash_config": {"mask_token_id": model.mask_token_id,
                                 "target_layer_ids": list(model.target_layer_ids)},
               "num_hidden_layers": len(model.layers), "hidden_size": c.hidden_size,
               "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
               "head_dim": model.layers[0].self_attn.head_dim, "intermediate_size": c.intermediate_size,
               "rms_norm_eps": c.rms_norm_eps, "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", None)),
               "vocab_size": c.vocab_size, "tie_word_embeddings": False,
               "dtype": str(model.fc.weight.dtype).removeprefix("torch.")}
    return config


def export_dflash(model: DFlashDraftModel, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (atomically, weights first).
    Raises ``ValueError`` when the drafter's tensors do not match the layout."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return write_folder(out_dir, tensors, server_config(model), expected_shapes(model.config), WEIGHTS)


def load_dflash(path: str | Path, target: PreTrainedModel) -> DFlashDraftModel:
    """A drafter from an export folder, bound to ``target``'s embedding and LM head (float32 or the file's
    dtype, on ``target``'s device).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for a config that is not a DFlash draft,
    tensors that do not match the layout, or a drafter made for another target (sizes differ).
    """
    _, tensors = read_folder(path, ("block_size", "num_target_layers", "dflash_config"), "a DFlash draft", WEIGHTS)
    config = AutoConfig.from_pretrained(path)
    check_tensors(tensors, expected_shapes(config), Path(path) / WEIGHTS)
    model = DFlashDraftModel(config, target.get_input_embeddings().weight, target.get_output_embeddings())
    check_made_for(model.config, target.config, f"{path}: DFlash drafter")
    model.load_state_dict(tensors, strict=True)
    return model.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype).eval()
