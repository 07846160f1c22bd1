"""EAGLE-3 drafter to the folder vLLM (``method: eagle3``, ``LlamaForCausalLMEagle3`` ->
``Eagle3LlamaForCausalLM``) and SGLang (``--speculative-algorithm EAGLE3``, ``LlamaForCausalLMEagle3``) load,
with a strict loader.

Layout (checked against vLLM 0.32's ``model_executor/models/llama_eagle3.py``: ``load_weights`` and its
``midlayer.`` -> ``layers.0.`` mapping, ``compute_logits``, ``combine_hidden_states``):
- ``config.json``: a one-layer Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``vocab_size`` (the target's), ``draft_vocab_size``, ``target_hidden_size``,
  ``eagle_config: {use_aux_hidden_state[, eagle_aux_hidden_state_layer_ids]}`` and ``num_target_layers``. The
  layer ids are left out when they are the servers' default (vLLM and SGLang then read the same layers), else
  written as vLLM's ids (the *input* of decoder layer i: draftheads id + 1), which SGLang reads as the output of
  layer i, one layer later (:func:`~draftheads.drafters.eagle3.model.draft_config`). The norm flags as
  top-level bools, always written: EAGLE-3.1's ``fc_norm`` (``llama_eagle3.py:231``), ``norm_before_fc``
  (:184-188, which also reads ``eagle_config``) and ``norm_output`` (:252), and ``norm_before_residual`` (:101),
  so that no server default decides them.
- ``model.safetensors``: with ``norm_before_fc``, ``input_norm.weight`` ``[3D]``; with ``fc_norm``,
  ``fc_norm.{0,1,2}.weight`` ``[D]`` each (vLLM prefixes ``model.``: its ``LlamaModel.input_norm`` and
  ``fc_norm`` ModuleList, :224 and :233; it drops ``input_norm.`` without ``norm_before_fc``, :464). Then
  ``fc.weight`` ``[D, 3D]``, ``midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight`` ``[D]``, ``midlayer.self_attn.{q,k,v}_proj.weight`` ``[heads*hd, 2D]``,
  ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``,
  ``lm_head.weight`` ``[V_draft, D]``; with a draft vocabulary smaller than the target's, ``d2t`` ``[V_draft]``
  int64 (target id - draft id) and ``t2d`` ``[V]`` bool (vLLM reads ``d2t`` and skips ``t2d``; with equal
  vocabularies vLLM has no mapping to load, so neither is written). No embedding: both servers then share the
  target's.

Errors name the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, PreTrainedModel

from draftheads.drafters.eagle3.model import Eagle3DraftModel, layer_ids_of, norm_flags
from draftheads.models.export import check_tensors, read_folder, write_folder
from draftheads.models.target import check_made_for

WEIGHTS = "model.safetensors"


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout and its shape, from a draft config (its EAGLE-3.1 flags included:
    :func:`~draftheads.drafters.eagle3.model.norm_flags`, whose ``ValueError`` it raises)."""
    D, Di, hd = config.hidden_size, config.intermediate_size, config.head_dim
    H, Hkv = config.num_attention_heads, config.num_key_value_heads
    V, Vd = config.vocab_size, config.draft_vocab_size
    K = len(layer_ids_of(config))
    m = "midlayer."
    shapes = {"fc.weight": (D, K * config.target_hidden_size), "norm.weight": (D,), "lm_head.weight": (Vd, D),
              m + "input_layernorm.weight": (D,), m + "hidden_norm.weight": (D,),
              m + "post_attention_layernorm.weight": (D,),
              m + "self_attn.q_proj.weight": (H * hd, 2 * D), m + "self_attn.k_proj.weight": (Hkv * hd, 2 * D),
              m + "self_attn.v_proj.weight": (Hkv * hd, 2 * D), m + "self_attn.o_proj.weight": (D, H * hd),
              m + "mlp.gate_proj.weight": (Di, D), m + "mlp.up_proj.weight": (Di, D),
              m + "mlp.down_proj.weight": (D, Di)}
    if Vd != V:
        shapes |= {"d2t": (Vd,), "t2d": (V,)}
    flags, Dt = norm_flags(config), config.target_hidden_size
    if flags["norm_before_fc"]:
        shapes["input_norm.weight"] = (K * Dt,)
    if flags["fc_norm"]:
        shapes |= {f"fc_norm.{k}.weight": (Dt,) for k in range(K)}
    return shapes


def server_config(model: Eagle3DraftModel) -> dict:
    """The ``config.json`` dict: the draft config with every field the servers read made explicit."""
    c = model.config
    config = c.to_dict()
    for key in ("_name_or_path", "transformers_version", "quantization_config", "auto_map"):
        config.pop(key, None)
    rope = config.get("rope_parameters") or {}
    config |= {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
               "draft_vocab_size": len(model.d2t), "vocab_size": len(model.t2d),
               "target_hidden_size": c.target_hidden_size, "num_target_layers": c.num_target_layers,
               "eagle_config": dict(c.eagle_config),
               "head_dim": c.head_dim, "rope_theta": rope.get("rope_theta", getattr(c, "rope_theta", None)),
               "tie_word_embeddings": False, "dtype": str(model.fc.weight.dtype).removeprefix("torch."),
               **norm_flags(c)}
    return config


def export_eagle3(model: Eagle3DraftModel, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (atomically, weights first).
    Raises ``ValueError`` when the drafter's tensors do not match the layout."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if len(model.d2t) == len(model.t2d):
        tensors = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    return write_folder(out_dir, tensors, server_config(model), expected_shapes(model.config), WEIGHTS)


def load_eagle3(path: str | Path, target: PreTrainedModel) -> Eagle3DraftModel:
    """A drafter from an export folder, bound to ``target``'s embedding (the file's dtype, on ``target``'s
    device).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for a config that is not an EAGLE-3 draft,
    norm flags that are not bools, tensors that do not match the layout its flags make (a norm's weight missing,
    or present with its flag off), a ``d2t`` that is not a sorted vocabulary, or a drafter made for another target
    (sizes differ).
    """
    where = Path(path) / WEIGHTS
    _, tensors = read_folder(path, ("draft_vocab_size", "target_hidden_size", "num_target_layers", "eagle_config"),
                             "an EAGLE-3 draft", WEIGHTS)
    config = AutoConfig.from_pretrained(path)
    try:
        norm_flags(config)
    except ValueError as e:
        raise ValueError(f"{Path(path) / 'config.json'}: {e}") from None
    check_tensors(tensors, expected_shapes(config), where)
    model = Eagle3DraftModel(config, target.get_input_embeddings().weight)
    check_made_for({**config.to_dict(), "hidden_size": config.target_hidden_size}, target.config,
                   f"{path}: EAGLE-3 drafter")
    if "d2t" in tensors:
        try:
            model.set_vocabulary(tensors["d2t"] + torch.arange(len(tensors["d2t"])))
        except ValueError as e:
            raise ValueError(f"{where}: d2t: {e}") from None
        if not bool((model.t2d == tensors["t2d"]).all()):
            raise ValueError(f"{where}: t2d does not mark the tokens d2t maps to")
    model.load_state_dict({**model.state_dict(), **tensors}, strict=True)
    return model.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype).eval()
