import pytest
import torch
import torch.nn.functional as F

from draftheads.data.hidden_states import attach_hidden_states
from draftheads.drafters.medusa.heads import MedusaHeads, medusa_loss, medusa_targets
from draftheads.drafters.medusa.training import MedusaStage1, MedusaStage2, split_states, stage2_layers
from draftheads.training.objectives import Objective
from tests.helpers import assert_packed_trains_as_padded


def test_fresh_heads_are_identity_and_predict_like_the_lm_head():
    heads = MedusaHeads(hidden_size=16, vocab_size=40, num_heads=3, num_layers=2)
    lm_head = torch.nn.Linear(16, 40, bias=False)
    h = torch.randn(5, 16)
    logits = heads(h, lm_head=lm_head)
    assert logits.shape == (3, 5, 40)
    for k in range(3):
        torch.testing.assert_close(logits[k], lm_head(h))


def test_every_block_has_its_own_weights():
    heads = MedusaHeads(hidden_size=8, vocab_size=10, num_heads=3, num_layers=2)
    linears = [block.linear for head in heads.blocks for block in head]
    assert len({lin.weight.data_ptr() for lin in linears}) == 6
    with torch.no_grad():
        heads.blocks[0][0].linear.weight.fill_(1.0)
    assert all(float(lin.weight.detach().abs().sum()) == 0.0 for lin in linears[1:])
    assert sum(p.numel() for p in heads.parameters()) == 6 * (8 * 8 + 8)


def test_per_head_lm_heads_start_from_the_target_and_are_independent():
    lm_head = torch.nn.Linear(8, 10, bias=False)
    heads = MedusaHeads(8, 10, num_heads=2, per_head_lm_head=True)
    heads.init_lm_heads_from(lm_head)
    torch.testing.assert_close(heads.lm_heads[1].weight, lm_head.weight)
    assert heads.lm_heads[0].weight.data_ptr() != heads.lm_heads[1].weight.data_ptr() != lm_head.weight.data_ptr()


def test_targets_shift_head_k_by_k_plus_one():
    ids = torch.arange(10)[None]
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, 4:] = True
    labels, valid = medusa_targets(ids, mask, num_heads=2)
    # head 1 (k=1) at position t predicts t + 2; head 2 predicts t + 3
    assert labels[0, 0, :8].tolist() == list(range(2, 10))
    assert labels[1, 0, :7].tolist() == list(range(3, 10))
    assert valid[0, 0].tolist() == [t + 2 >= 4 and t + 2 < 10 for t in range(10)]
    assert valid[1, 0].tolist() == [t + 3 >= 4 and t + 3 < 10 for t in range(10)]


def test_mismatched_target_size_is_a_clear_error():
    heads = MedusaHeads(16, 40)
    try:
        heads.check_target(32, 40, where="Qwen")
    except ValueError as e:
        assert "hidden_size=16" in str(e) and "hidden_size=32" in str(e) and "Qwen" in str(e)
    else:
        raise AssertionError("no error")


def test_heads_learn_future_tokens_well_above_chance():
    """Sequences follow x_{t+1} = (x_t + 3) mod V and the hidden state encodes x_t: head k must learn
    x_{t+k+1} = x_t + 3(k+1). Chance is 1/V."""
    torch.manual_seed(0)
    V, D, K = 32, 48, 3
    emb = torch.randn(V, D)
    lm_head = torch.nn.Linear(D, V, bias=False)
    lm_head.weight.data = emb.clone()
    lm_head.requires_grad_(False)
    heads = MedusaHeads(D, V, num_heads=K, num_layers=1)
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    start = torch.randint(0, V, (16, 1))
    ids = (start + 3 * torch.arange(24)) % V
    mask = torch.ones_like(ids, dtype=torch.bool)
    labels, valid = medusa_targets(ids, mask, K)
    hidden = emb[ids]
    losses = []
    for _ in range(300):
        loss, metrics = medusa_loss(heads, hidden, labels, valid, lm_head, Objective(position_decay=0.8))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    for k in range(1, K + 1):
        assert float(metrics[f"head{k}_top1"]) > 0.9 > 10 / V


def test_loss_is_the_decayed_sum_of_per_head_cross_entropies():
    torch.manual_seed(1)
    heads = MedusaHeads(8, 12, num_heads=2)
    lm_head = torch.nn.Linear(8, 12, bias=False)
    hidden = torch.randn(2, 6, 8)
    ids = torch.randint(0, 12, (2, 6))
    labels, valid = medusa_targets(ids, torch.ones_like(ids, dtype=torch.bool), 2)
    loss, m = medusa_loss(heads, hidden, labels, valid, lm_head, Objective(position_decay=0.5))
    expected = sum(0.5 ** (k + 1) * F.cross_entropy(lm_head(heads.blocks[k](hidden[valid[k]])), labels[k][valid[k]])
                   for k in range(2))
    torch.testing.assert_close(loss, expected)
    assert set(m) == {f"head{k}_{n}" for k in (1, 2) for n in ("loss", "top1", "top5")}


@pytest.mark.parametrize("stage", ["stage1", "stage2"])
def test_a_packed_batch_gives_the_padded_batchs_loss_and_gradients(stage, tiny):
    """Rows packed back to back (no padding, no label or attention across rows) train exactly what the same
    rows padded train: Medusa's labels and the self-distillation positions stop at each row's end."""
    model, _ = tiny
    L = model.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(3, model.config.vocab_size, (n,), generator=g),
             "loss_mask": torch.rand(n, generator=g) > 0.3} for n in (23, 9, 17)]
    attach_hidden_states(model, rows, 8, 0, show_progress=False, layer_ids=stage2_layers(L, 2))
    split_states(rows, model.get_decoder().norm)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.02)
    strategy = (MedusaStage1(heads, model, Objective(position_decay=0.8)) if stage == "stage1" else
                MedusaStage2(heads, model, 2, Objective(position_decay=0.8), kl_weight=1.0, backbone_lr_scale=0.1))
    assert_packed_trains_as_padded(strategy, rows)
    model.requires_grad_(False)
