"""A drafter's objective through an LM head without the ``[tokens, V]`` logits: a chunked, fused linear loss.

A drafter's loss is dominated by its LM head: ``N`` positions x ``V`` tokens of float32 logits, kept by autograd
for the backward pass (16k positions x 128k vocabulary x 4 bytes = 8 GB per head). Here the logits of
``chunk`` positions at a time are made and reduced, in the forward pass, to their loss, top-k and gradients
(``softmax - onehot``, times the per-position weight, through the two products), then dropped: the loss is a
weighted sum whose weights are known up front, so the backward pass only scales the stored gradients (or, for
weights made from the pass's own values, D-PACE's, scales each position's gradient once they are known). Peak
memory grows with the chunk, not with ``N``, and the products are the three autograd would run. The same idea as
liger-kernel's fused linear cross-entropy (in plain PyTorch, so it runs on any device) and Apple's
cut-cross-entropy (Wijmans et al., arXiv 2411.09009).

A distillation objective (:mod:`draftheads.training.objectives`) reads the target's distribution at the same
positions: the target's logits are made chunk by chunk beside the drafter's from the target's LM head and its
last hidden states, and the objective's gradient in the chunk's logits is made there in closed form too
(:func:`~draftheads.training.objectives.losses_and_grads`, in the two logits' storage and one to four more
``[chunk, V]`` tensors; per-chunk autograd made a DFlash step 2.4x slower than ``ce`` on CPUs).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from draftheads.training.objectives import (
    PositionWeights,
    chain_weights,
    logit_buffers,
    loss_mix,
    normalise,
    objective_and_grads,
)

CHUNK_BYTES = 256 * 2 ** 20
"""Float32 ``[chunk, V]`` tensors held at once (256 MiB: for ``ce``, the logits of 1,365 positions of a 49k
vocabulary, 523 of a 128k one; a third to a sixth of that for a distillation objective; smaller chunks ran slower
on CPUs, ``tests/benchmarks/bench_lm_head_loss.py``)."""


class _LinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, side_hidden, side_weight, labels, scale, chunk, k, needs, teacher, mix,
                temperature, per_position):
        n = hidden.shape[0]
        losses, ce = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(2))
        alpha = torch.empty(n if teacher is not None else 0, dtype=torch.float32, device=hidden.device)
        top = torch.empty(n, k, dtype=torch.long, device=hidden.device)
        blocks = [(hidden, weight)] + ([(side_hidden, side_weight)] if side_weight is not None else [])
        # one float32 gradient per input (one rounding, at the end), None where it needs none
        grads = [torch.zeros_like(t, dtype=torch.float32) if need else None
                 for t, need in zip((hidden, weight, bias, side_hidden, side_weight), needs)]
        for s in range(0, n, chunk):
            y, w = labels[s:s + chunk], scale[s:s + chunk, None]
            logits = _logits(hidden[s:s + chunk], weight, bias)
            if side_weight is not None:
                logits += _logits(side_hidden[s:s + chunk], side_weight, None)
            top[s:s + chunk] = logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices
            target = None if teacher is None else _logits(teacher[0][s:s + chunk], *teacher[1:])
            # the objective and its gradient in the logits, in closed form in the logits' place where it has one
            losses[s:s + chunk], ce[s:s + chunk], a, g = objective_and_grads(logits, y, target, mix, temperature,
                                                                             grad=any(needs))
            if teacher is not None:
                alpha[s:s + chunk] = a
            # the position weights scale the [chunk, D] side of each product
            for i, (x, wt) in enumerate(blocks):
                if needs[3 * i]:  # 0: hidden, 3: side_hidden
                    grads[3 * i][s:s + chunk] = (g.to(wt.dtype) @ wt).float() * w
                if needs[3 * i + 1]:  # 1: weight, 4: side_weight
                    grads[3 * i + 1].addmm_(g.t(), x[s:s + chunk].float() * w)
            if needs[2]:
                grads[2].addmv_(g.t(), w[:, 0])
        ctx.save_for_backward(*grads)
        ctx.dtypes = [None if t is None else t.dtype for t in (hidden, weight, bias, side_hidden, side_weight)]
        ctx.mark_non_differentiable(*([] if per_position else [losses]), ce, top, alpha)
        return (losses * scale).sum(), losses, ce, top, alpha

    @staticmethod
    def backward(ctx, grad_loss, grad_losses, *_):
        # the sum's gradient scales every stored one; each position's own (per_position: the stored gradients of
        # the inputs read per position are unweighted, and the weights arrive here) scales its row
        rows = grad_loss + grad_losses[:, None]
        return (*[None if g is None else (g * (rows if i in (0, 3) else grad_loss)).to(dtype)
                  for i, (g, dtype) in enumerate(zip(ctx.saved_tensors, ctx.dtypes))], *[None] * 9)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One chunk's logits in float32, made as the LM head module makes them (its dtype, or autocast's)."""
    logits = hidden @ weight.t()
    return (logits if bias is None else logits + bias).float()


class LinearLoss(NamedTuple):
    """What :func:`linear_loss` returns."""
    loss: torch.Tensor
    """float32 scalar ``sum(weights * losses)``, differentiable."""
    losses: torch.Tensor
    """``[N]`` float32, the objective at each position (the cross-entropy for ``ce``); differentiable only under
    ``per_position``."""
    ce: torch.Tensor
    """``[N]`` float32 cross-entropy on the labels (``logsumexp(logits) - logits[label]``, as
    ``F.cross_entropy(reduction="none")`` on float32 logits), whatever the objective; not differentiable."""
    top: torch.Tensor
    """``[N, k]`` int64, the top-k tokens."""
    alpha: torch.Tensor | None
    """``[N]`` float32 ``sum_v min(p_v, q_v)`` at the objective's temperature (None without a teacher)."""


def linear_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, k: int = 5, teacher: tuple | None = None,
                mix: dict[str, float] | None = None, temperature: float = 1.0,
                chunk_bytes: int = CHUNK_BYTES, side: tuple | None = None, per_position: bool = False) -> LinearLoss:
    """The weighted objective of the logits ``hidden @ weight.T (+ bias) (+ side_hidden @ side_weight.T)`` at
    ``N`` positions, per-position values and top-k tokens, without materialising the logits.

    Args:
        hidden: ``[N, D]`` LM-head inputs (any float dtype; differentiable).
        weight: ``[V, D]`` the LM head's weight (differentiable when it trains, as EAGLE-3's own head);
            bias: ``[V]`` or None.
        labels: ``[N]`` int64 in ``0..V-1``.
        weights: ``[N]`` each position's weight in the loss (constants; default 1: the sum), e.g. ``1/N`` for
            the mean.
        k: top-k tokens returned per position (for top-1/top-5 accuracy), at most V.
        teacher: ``(hidden [N, Dt], weight [V, Dt], bias [V] or None)``, the target's LM head and its inputs at
            the same positions, over the same V tokens (constants); None: ``mix`` is ``ce`` alone.
        mix: the objective ``{name: weight}`` (:func:`~draftheads.training.objectives.loss_mix`; default ``ce``).
        temperature: both distributions' in a distillation objective.
        side: ``(side_hidden [N, r], side_weight [V, r])``, a second linear map added to the logits (DSpark's
            Markov bias beside a frozen LM head: only the blocks that train get a weight gradient, where one
            ``[V, D + r]`` map of ``[hidden; side_hidden]`` would make the frozen head's too), or None.
        chunk_bytes: float32 ``[chunk, V]`` tensors held at once, all of them: the chunk is this over
            ``4 V`` times the objective's count (:func:`~draftheads.training.objectives.logit_buffers`: 1 for
            ``ce``, 3 to 6 for a distillation objective).
        per_position: the returned ``losses`` are differentiable, so weights made from this pass's own values
            (D-PACE's, from ``ce``) apply after it, ``(out.losses * w).sum()``, in one pass through the head. Only
            for gradients read per position (``hidden``, ``side_hidden``); ``weights`` must be None.
    Returns :class:`LinearLoss`. Gradients are made chunk by chunk in the forward pass, in closed form
    (:func:`~draftheads.training.objectives.losses_and_grads`), so neither model's ``[N, V]`` logits ever exist
    at once.
    Raises ``ValueError`` for a label outside the vocabulary, a distillation objective without a teacher, or
    ``per_position`` with ``weights`` or with a trainable ``weight``, ``bias`` or ``side_weight`` (their
    gradients sum over positions inside the pass).
    """
    V = weight.shape[0]
    if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < V:
        raise ValueError(f"labels must lie in 0..{V - 1}; got {int(labels.min())}..{int(labels.max())}")
    mix = mix or {"ce": 1.0}
    if teacher is None and set(mix) != {"ce"}:
        raise ValueError(f"the objective {mix} reads the target's distribution: give its LM head and states")
    if teacher is not None:
        teacher = tuple(None if t is None else t.detach() for t in teacher)
    scale = (torch.ones(len(labels), device=hidden.device) if weights is None
             else weights.detach().to(hidden.device, torch.float32))
    side_hidden, side_weight = side if side is not None else (None, None)
    grad = torch.is_grad_enabled()
    needs = tuple(grad and t is not None and t.requires_grad for t in (hidden, weight, bias, side_hidden, side_weight))
    if per_position and (weights is not None or needs[1] or needs[2] or needs[4]):
        raise ValueError("per_position: the weights apply after the pass, so neither weights nor a trainable weight, "
                         "bias or side_weight (whose gradients sum over positions in it) can be given")
    chunk = max(1, chunk_bytes // (4 * V * logit_buffers(mix, temperature, teacher is not None)))
    out = _LinearLoss.apply(hidden, weight, bias, side_hidden, side_weight, labels, scale, chunk, min(k, V), needs,
                            teacher, mix, temperature, per_position)
    return LinearLoss(*out[:4], out[4] if teacher is not None else None)


class LMHead(nn.Linear):
    """A drafter's own trainable LM head (EAGLE-3's, Medusa's per-head ones): an ``nn.Linear`` (same parameters
    and names) whose forward, given ``labels``, returns :func:`linear_loss` instead of logits. The loss runs
    inside the module's own forward so that sharding engines gather its weight there (ZeRO-3 and FSDP gather a
    module's parameters for its forward; reading ``.weight`` outside it would see a shard)."""

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None, **loss):
        if labels is None:
            return super().forward(hidden)
        return linear_loss(hidden, self.weight, labels, self.bias, **loss)


def head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **loss) -> LinearLoss:
    """:func:`linear_loss` (``loss``: its keyword arguments) through ``head``: a drafter's :class:`LMHead`
    (inside its forward), or a target's frozen ``nn.Linear`` LM head (its weight read directly: the target stays
    outside the engines)."""
    if isinstance(head, LMHead):
        return head(hidden, labels, **loss)
    return linear_loss(hidden, head.weight, labels, head.bias, **loss)


def drafted_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, settings,
                 teacher: tuple | None = None, k: int = 1, side: tuple | None = None) -> LinearLoss:
    """A drafter's loss over chains of drafted positions: ``settings``' objective at each valid position,
    weighted by its position weights (:mod:`draftheads.training.objectives`) and normalised over every process.

    Args:
        head: the LM head the drafter proposes through (:func:`head_loss`).
        hidden: ``[N, D]`` its inputs at the valid positions, in ``valid``'s flattened order; labels: ``[N]``.
        valid: ``[..., G]`` bool, chains of G drafted positions (the last dimension), N of them true.
        settings: the drafter's :class:`~draftheads.training.objectives.Objective` (``position_decay`` set).
        teacher: ``(hidden [N, Dt], weight [V, Dt], bias)``: the target's LM head and last hidden states at the
            same positions, for a distillation objective (None for ``ce``).
        k: top-k tokens returned.
        side: ``(side_hidden [N, r], side_weight [V, r])`` added to the logits (:func:`linear_loss`), or None.
    D-PACE's weights need each position's cross-entropy, which the pass itself makes: through a frozen head (DFlash's,
    the target's) they apply after it (``per_position``: one ``[N, V]`` product each way, as ``decay``); a head or
    side map that trains sums its gradient over positions inside the pass, so a no-grad pass makes the
    cross-entropy first (one more product, chunked).
    """
    mix, temperature = loss_mix(settings.loss, "loss"), settings.loss_temperature
    dpace = settings.position_weights == PositionWeights.dpace
    ce = torch.zeros(valid.shape, device=hidden.device) if dpace else None  # D-PACE's input, [..., G]
    params = (head.weight, getattr(head, "bias", None), None if side is None else side[1])
    trains = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in params)
    if dpace and not trains:
        out = head_loss(head, hidden, labels, k=k, teacher=teacher, side=side, mix=mix, temperature=temperature,
                        per_position=True)
        ce[valid] = out.ce
        return out._replace(loss=(out.losses * normalise(chain_weights(settings, valid, ce))[valid]).sum())
    if dpace:
        with torch.no_grad():
            ce[valid] = head_loss(head, hidden, labels, k=1, side=side).ce
    weights = normalise(chain_weights(settings, valid, ce))[valid]
    return head_loss(head, hidden, labels, weights=weights, k=k, teacher=teacher, side=side, mix=mix,
                     temperature=temperature)
