"""A target's attention over rows packed back to back, run row by row.

Given ``position_ids`` that restart per row and no ``attention_mask`` (:func:`~draftheads.data.batching.pack`),
transformers masks attention block-diagonally, so no row sees another; but with ``sdpa`` it builds the dense
``[N, N]`` mask of the whole packed sequence and computes every score of it: a micro-batch of 8 rows of N/8
tokens costs 8x the attention scores of the same rows padded. flash-attention's varlen kernel, which reads the
same ``position_ids``, and flex attention's block-sparse masks skip the other rows' blocks; this gives ``sdpa`` the
same: inside :func:`rows_attend_alone` the target's implementation is one that calls transformers' own ``sdpa``
once per row, on the diagonal block of the mask transformers built (its causal, sliding-window and per-layer-type
masks unchanged). ``eager`` is left dense.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

BASE = "sdpa"
BY_ROW = "draftheads_sdpa_by_row"
_ROWS: ContextVar[list[tuple[int, int]] | None] = ContextVar("packed_rows", default=None)
"""The packed rows of the forward running inside :func:`rows_attend_alone`, found once for all its layers."""


def row_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each row of a packed sequence from its ``[1, N]`` positions, which restart at each row
    (any position that is not the previous one plus 1 starts a row, as transformers'
    ``find_packed_sequence_indices`` reads them)."""
    starts = (position_ids[0, 1:] != position_ids[0, :-1] + 1).nonzero()[:, 0] + 1
    bounds = [0, *starts.tolist(), position_ids.shape[1]]
    return list(zip(bounds[:-1], bounds[1:]))


def attention_by_row(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention (looked up at call time), once per row of the packed sequence
    :func:`rows_attend_alone` runs (``[1, H, N, hd]`` queries and keys); any other call as is. Returns
    ``[1, N, H, hd]`` as ``sdpa`` does."""
    base = ALL_ATTENTION_FUNCTIONS[BASE]
    rows = _ROWS.get()
    if rows is None or query.shape[0] != 1 or not query.shape[2] == key.shape[2] == rows[-1][1]:
        return base(module, query, key, value, attention_mask, **kwargs)
    out = [base(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                None if attention_mask is None else attention_mask[..., s:e, s:e], **kwargs)[0] for s, e in rows]
    return torch.cat(out, dim=1), None


AttentionInterface.register(BY_ROW, attention_by_row)
AttentionMaskInterface.register(BY_ROW, ALL_MASK_ATTENTION_FUNCTIONS[BASE])


@contextmanager
def rows_attend_alone(model: PreTrainedModel, attention_mask: torch.Tensor | None,
                      position_ids: torch.Tensor | None) -> Iterator[None]:
    """Inside, a forward of ``model`` on one packed sequence (no ``attention_mask``, ``[1, N]`` ``position_ids``
    restarting per row, no cache) attends row by row when ``model`` runs ``sdpa`` (:func:`attention_by_row`);
    anything else (a padded batch, a single row, flash-attention's varlen, flex, eager) runs unchanged."""
    config = model.config
    rows = (row_spans(position_ids) if attention_mask is None and position_ids is not None
            and position_ids.shape[0] == 1 else [])
    if config._attn_implementation != BASE or len(rows) < 2:
        yield
        return
    token = _ROWS.set(rows)
    config._attn_implementation = BY_ROW
    try:
        yield
    finally:
        config._attn_implementation = BASE
        _ROWS.reset(token)
