"""Cross-entropy through an LM head without the ``[tokens, V]`` logits: a chunked, fused linear cross-entropy.

A drafter's loss is dominated by its LM head: ``N`` positions x ``V`` tokens of float32 logits, kept by autograd
for the backward pass (16k positions x 128k vocabulary x 4 bytes = 8 GB per head). Here the logits of
``chunk`` positions at a time are made and reduced, in the forward pass, to their loss, top-k and gradients
(``softmax - onehot``, times the per-position weight, through the two products), then dropped: the loss is a
weighted sum whose weights are known up front, so the backward pass only scales the stored gradients. Peak
memory grows with the chunk, not with ``N``, and the products are the three autograd would run. The same idea as
liger-kernel's fused linear cross-entropy (in plain PyTorch, so it runs on any device) and Apple's
cut-cross-entropy (Wijmans et al., arXiv 2411.09009).
"""

from __future__ import annotations

import torch
from torch import nn

CHUNK_BYTES = 256 * 2 ** 20
"""Float32 logits made at once (256 MiB: 1,365 positions of a 49k vocabulary, 523 of a 128k one; smaller chunks
ran slower on CPUs, ``tests/benchmarks/bench_lm_head_loss.py``)."""


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, scale, chunk, k, needs):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        top = torch.empty(n, k, dtype=torch.long, device=hidden.device)
        grad_h = torch.zeros_like(hidden, dtype=torch.float32) if needs[0] else None  # one rounding, at the end
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if needs[1] else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if needs[2] else None
        for s in range(0, n, chunk):
            h, y = hidden[s:s + chunk], labels[s:s + chunk]
            logits = _logits(h, weight, bias)
            lse = logits.logsumexp(-1, keepdim=True)
            ce[s:s + chunk] = (lse - logits.gather(1, y[:, None]))[:, 0]
            top[s:s + chunk] = logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
            if any(needs):
                # d ce / d logits = softmax - onehot(label); the weight scales the [chunk, D] side of each product
                g = logits.sub_(lse).exp_()
                g[torch.arange(len(h), device=g.device), y] -= 1
                w = scale[s:s + chunk, None]
                if needs[0]:
                    grad_h[s:s + chunk] = (g.to(weight.dtype) @ weight).float() * w
                if needs[1]:
                    grad_w.addmm_(g.t(), h.float() * w)
                if needs[2]:
                    grad_b += (g * w).sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        ctx.mark_non_differentiable(ce, top)
        return (ce * scale).sum(), ce, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_top):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (None if grad_h is None else (grad_h * grad_loss).to(ctx.dtypes[0]),
                None if grad_w is None else (grad_w * grad_loss).to(ctx.dtypes[1]),
                None if grad_b is None else (grad_b * grad_loss).to(ctx.dtypes[2]),
                None, None, None, None, None)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in float32, made as the LM head module makes them (its dtype, or autocast's)."""
    logits = hidden @ weight.t()
    return (logits if bias is None else logits + bias).float()


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         bias: torch.Tensor | None = None, weights: torch.Tensor | None = None, k: int = 5,
                         chunk_bytes: int = CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weighted cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, per-position losses and
    the top-k tokens, without materialising the logits.

    Args:
        hidden: ``[N, D]`` LM-head inputs (any float dtype; differentiable).
        weight: ``[V, D]`` the LM head's weight (differentiable when it trains, as EAGLE-3's own head);
            bias: ``[V]`` or None.
        labels: ``[N]`` int64 in ``0..V-1``.
        weights: ``[N]`` each position's weight in the loss (constants; default 1: the sum), e.g. ``1/N`` for
            the mean.
        k: top-k tokens returned per position (for top-1/top-5 accuracy), at most V.
        chunk_bytes: float32 logits made at once.
    Returns:
        ``loss`` (float32 scalar, ``sum(weights * ce)``, differentiable), ``ce`` ``[N]`` float32 per position
        (``logsumexp(logits) - logits[label]``, as ``F.cross_entropy(reduction="none")`` on float32 logits; not
        differentiable) and ``top`` ``[N, k]`` int64.
    Raises ``ValueError`` for a label outside the vocabulary.
    """
    V = weight.shape[0]
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < V:
        raise ValueError(f"labels must lie in 0..{V - 1}; got {int(labels.min())}..{int(labels.max())}")
    scale = (torch.ones(len(labels), device=hidden.device) if weights is None
             else weights.detach().to(hidden.device, torch.float32))
    grad = torch.is_grad_enabled()
    needs = (grad and hidden.requires_grad, grad and weight.requires_grad,
             grad and bias is not None and bias.requires_grad)
    chunk = max(1, chunk_bytes // (4 * V))
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, scale, chunk, min(k, V), needs)


class LMHead(nn.Linear):
    """A drafter's own trainable LM head (EAGLE-3's, Medusa's per-head ones): an ``nn.Linear`` (same parameters
    and names) whose forward, given ``labels``, returns :func:`linear_cross_entropy` instead of logits. The loss
    runs inside the module's own forward so that sharding engines gather its weight there (ZeRO-3 and FSDP
    gather a module's parameters for its forward; reading ``.weight`` outside it would see a shard)."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, k: int = 5):
        if labels is None:
            return super().forward(hidden)
        return linear_cross_entropy(hidden, self.weight, labels, self.bias, weights, k)


def head_cross_entropy(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
                       k: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`linear_cross_entropy` through ``head``: a drafter's :class:`LMHead` (inside its forward), or a
    target's frozen ``nn.Linear`` LM head (its weight read directly: the target stays outside the engines)."""
    if isinstance(head, LMHead):
        return head(hidden, labels, weights, k)
    return linear_cross_entropy(hidden, head.weight, labels, head.bias, weights, k)
