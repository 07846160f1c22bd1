"""The chunked linear cross-entropy equals cross-entropy on the full logits: loss, gradients and top-k."""

import pytest
import torch
import torch.nn.functional as F

from draftheads.training.lm_head_loss import linear_loss


def _inputs(N=37, D=24, V=301, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=g) * 0.3).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, bias, labels


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_bytes", [4 * 301 * 5, 2 ** 30])  # 5 positions per chunk, or all at once
def test_loss_gradients_and_top_k_equal_the_full_logits(with_bias, chunk_bytes):
    hidden, weight, bias, labels = _inputs()
    bias = bias if with_bias else None
    scale = torch.rand(len(labels))  # a weighted loss, as DFlash and EAGLE-3 weight positions
    loss, _, ce, top, _ = linear_loss(hidden, weight, labels, bias, scale, k=5, chunk_bytes=chunk_bytes)
    (2 * loss).backward()
    ours = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    logits = F.linear(hidden, weight, bias).float()
    ref = F.cross_entropy(logits, labels, reduction="none")
    (2 * (ref * scale).sum()).backward()
    theirs = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])
    torch.testing.assert_close(ce, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, (ref * scale).sum(), atol=1e-5, rtol=1e-5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert torch.equal(top, logits.topk(5, dim=-1).indices)
    assert not top.requires_grad and not ce.requires_grad


def test_a_frozen_head_gets_no_gradient_and_bf16_autocast_matches():
    hidden, weight, _, labels = _inputs()
    weight.requires_grad_(False)
    mean = torch.full((len(labels),), 1 / len(labels))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, ce, _, _ = linear_loss(hidden, weight, labels, weights=mean, chunk_bytes=4 * 301 * 7)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), labels, reduction="none")
    torch.testing.assert_close(ce, ref, atol=1e-3, rtol=1e-3)  # both from bf16 products
    loss.backward()
    ours = hidden.grad.clone()
    hidden.grad = None
    ref.mean().backward()
    torch.testing.assert_close(ours, hidden.grad, atol=2e-3, rtol=2e-2)
    assert weight.grad is None


@pytest.mark.parametrize("mix", [{"ce": 1.0}, {"ce": 0.1, "tv": 1.8}])
def test_a_side_map_adds_to_the_logits_and_only_the_trained_blocks_get_gradients(mix):
    """DSpark's Markov bias: ``hidden @ W.T + side @ W2.T`` with the LM head W frozen equals the loss of the full
    logits; hidden, side and W2 get autograd's gradients, W none (no ``[V, D]`` gradient product is made)."""
    hidden, weight, bias, labels = _inputs()
    weight.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    side = torch.randn(len(labels), 8, generator=g).requires_grad_()
    side_weight = (torch.randn(301, 8, generator=g) * 0.3).requires_grad_()
    teacher = (torch.randn(len(labels), 24, generator=g), torch.randn(301, 24, generator=g) * 0.3, None)
    scale = torch.rand(len(labels))
    out = linear_loss(hidden, weight, labels, bias, scale, teacher=teacher if "tv" in mix else None, mix=mix,
                      chunk_bytes=4 * 301 * 5, side=(side, side_weight))
    out.loss.backward()
    ours = [t.grad.clone() for t in (hidden, side, side_weight, bias)]
    assert weight.grad is None
    for t in (hidden, side, side_weight, bias):
        t.grad = None
    logits = (F.linear(hidden, weight, bias) + side @ side_weight.t()).float()
    ref = F.cross_entropy(logits, labels, reduction="none") * mix["ce"]
    if "tv" in mix:
        p = F.linear(teacher[0], teacher[1]).softmax(-1)
        ref = ref + mix["tv"] * (1 - torch.minimum(p, logits.softmax(-1)).sum(-1))
    (ref * scale).sum().backward()
    torch.testing.assert_close(out.loss, (ref * scale).sum(), atol=1e-5, rtol=1e-5)
    for a, t in zip(ours, (hidden, side, side_weight, bias)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-4)


def test_without_gradients_nothing_is_kept_for_backward():
    hidden, weight, _, labels = _inputs()
    with torch.no_grad():
        loss, _, ce, top, _ = linear_loss(hidden, weight, labels, chunk_bytes=4 * 301 * 7)
    assert not loss.requires_grad and torch.isfinite(ce).all() and top.shape == (len(labels), 5)


def test_labels_outside_the_vocabulary_are_refused():
    hidden, weight, _, labels = _inputs()
    with pytest.raises(ValueError, match="labels must lie in 0..300"):
        linear_loss(hidden, weight, labels + 301)
