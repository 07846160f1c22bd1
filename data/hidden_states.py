"""The target's last-layer hidden states for training rows, computed once without autograd and reused
every epoch (Medusa stage 1 trains heads on them; stage 2 uses them as the frozen original target's
next-token distribution for its self-distillation term)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from data.batching import collate


@torch.inference_mode()
def last_hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, D]`` hidden states after the final norm (what the LM head reads), for ``[B, T]`` ids."""
    return model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def attach_hidden_states(model: PreTrainedModel, rows: list[dict], batch_size: int, pad_token_id: int,
                         show_progress: bool = True) -> None:
    """Add ``row["hidden_states"]`` ``[T, D]`` (model dtype, CPU) to every row, in place.

    Rows are run sorted by length to keep padding small; right padding leaves positions unchanged.
    """
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))
    device = next(model.parameters()).device
    for s in tqdm(range(0, len(order), batch_size), desc="target hidden states", unit="batch",
                  disable=not show_progress):
        chunk = [rows[i] for i in order[s:s + batch_size]]
        batch = collate(chunk, pad_token_id)
        h = last_hidden_states(model, batch["input_ids"].to(device), batch["attention_mask"].to(device)).cpu()
        for j, r in enumerate(chunk):
            r["hidden_states"] = h[j, :len(r["input_ids"])].clone()
