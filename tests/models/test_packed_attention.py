"""Packed rows attending alone: only a packed forward runs ``sdpa`` row by row, and it gives each row's own
attention (every family's layers are checked in ``tests/test_families.py``)."""

import pytest
import torch

from draftheads.models.packed_attention import BY_ROW, row_spans, rows_attend_alone


def test_row_spans_start_where_positions_restart():
    assert row_spans(torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert row_spans(torch.arange(5)[None]) == [(0, 5)]


def test_only_a_packed_forward_attends_row_by_row(tiny):
    """A padded call that passes restarting positions with its mask, one row, or no positions keep ``sdpa`` (its
    mask may let rows see each other); the switch is undone on the way out, an error included."""
    model, _ = tiny
    packed = torch.cat([torch.arange(4), torch.arange(6)])[None]
    with rows_attend_alone(model, None, packed):
        assert model.config._attn_implementation == BY_ROW
    for mask, positions in ((torch.ones(1, 10, dtype=torch.long), packed), (None, torch.arange(10)[None]),
                            (None, None), (None, packed.expand(2, -1))):
        with rows_attend_alone(model, mask, positions):
            assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), rows_attend_alone(model, None, packed):
        raise RuntimeError
    assert model.config._attn_implementation == "sdpa"


def test_a_packed_forward_gives_each_row_what_it_gets_alone(tiny):
    model, _ = tiny
    ids = torch.randint(4, model.config.vocab_size, (1, 21))
    n = [9, 12]
    positions = torch.cat([torch.arange(k) for k in n])[None]
    with torch.no_grad(), rows_attend_alone(model, None, positions):
        packed = model.base_model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    with torch.no_grad():
        alone = [model.base_model(input_ids=row, use_cache=False).last_hidden_state for row in ids.split(n, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), atol=1e-5, rtol=1e-4)
