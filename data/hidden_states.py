"""Target states for training rows, computed once without autograd and reused every epoch.

- ``hidden_states`` ``[T, D]``: the last hidden states after the final norm. Medusa stage 1 trains heads on
  them; stage 2 uses them as the frozen original target's next-token distribution (self-distillation).
- ``target_features`` ``[T, K*D]``: the outputs of decoder layers ``layer_ids``, concatenated (DFlash's
  context features, see :func:`models.target.record_layer_outputs` for the layer-id convention).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from draftheads.data.batching import collate
from draftheads.models.packed_attention import rows_attend_alone
from draftheads.models.target import record_layer_outputs


@torch.inference_mode()
def last_hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, D]`` hidden states after the final norm (what the LM head reads), for ``[B, T]`` ids."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


@torch.no_grad()  # not inference_mode: online DFlash training feeds the result to autograd
def layer_features(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: Sequence[int], position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, K*D]`` outputs of decoder layers ``layer_ids`` (in that order) for ``[B, T]`` ids, padded
    (``attention_mask``) or packed (``position_ids`` restarting per row, no mask). Raises ``ValueError`` for a
    layer id outside the model."""
    with record_layer_outputs(model, layer_ids) as outputs, rows_attend_alone(model, attention_mask, position_ids):
        model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False)  # with a cache transformers ignores packing
    return torch.cat([outputs[i] for i in layer_ids], dim=-1)


def batch_features(batch: dict, model: PreTrainedModel, layer_ids: Sequence[int]) -> torch.Tensor:
    """A batch's ``target_features`` ``[B, T, K*D]``: cached in the batch (precomputed), else from a forward of
    the frozen ``model`` without autograd (online), padded or packed."""
    features = batch.get("target_features")
    if features is None:
        features = layer_features(model, batch["input_ids"], batch.get("attention_mask"), layer_ids,
                                  batch.get("position_ids"))
    return features


def attach_hidden_states(model: PreTrainedModel, rows: list[dict], batch_size: int, pad_token_id: int,
                         show_progress: bool = True, layer_ids: Sequence[int] | None = None,
                         dtype: torch.dtype | None = None) -> None:
    """Add ``row["hidden_states"]`` (or, with ``layer_ids``, ``row["target_features"]``) to every row, in
    place, on the CPU in ``dtype`` (default: the model's).

    Rows are run sorted by length to keep padding small; right padding leaves positions unchanged.
    """
    key = "hidden_states" if layer_ids is None else "target_features"
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    device = next(model.parameters()).device
    desc = "target hidden states" if layer_ids is None else "target layer features"
    for s in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch", disable=not show_progress):
        chunk = [rows[i] for i in order[s:s + batch_size]]
        batch = collate(chunk, pad_token_id)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        states = (last_hidden_states(model, ids, mask) if layer_ids is None
                  else layer_features(model, ids, mask, layer_ids)).to("cpu", dtype)
        for j, r in enumerate(chunk):
            r[key] = states[j, :len(r["input_ids"])].clone()
