"""What a drafter trains for: the objective at each drafted position, and each position's weight in the loss.

Every drafter's config section extends :class:`Objective`, so the keys are the same everywhere
(``medusa.loss``, ``dflash.loss``, ``eagle3.loss``, ...):

- ``loss``: ``ce`` (cross-entropy on the row's next token: the target's own greedy token on regenerated rows),
  or a distillation objective against the target's distribution ``p`` at that position, or a weighted mix
  written as a mapping (``{ce: 0.1, tv: 0.9}``). With ``q`` the drafter's distribution and
  ``alpha = sum_v min(p_v, q_v)`` (the probability that speculative sampling accepts the draft, Leviathan et
  al. 2023, section 3.5):

  ========== ============================================== ==========================================
  name       per position                                   source
  ========== ============================================== ==========================================
  ce         ``-log q_y``                                   the DFlash, EAGLE-3 and Medusa papers
  kl         ``KL(p || q)``                                 speculators' default (``kl_div``)
  rkl        ``KL(q || p)``                                 speculators ``rkl``
  jsd        ``(KL(p || m) + KL(q || m)) / 2``, m = (p+q)/2  speculators ``jsd``
  tv         ``1 - alpha`` (total variation)                speculators ``tv``; DSpark's loss
  lk_alpha   ``-log alpha``                                 LK losses, arXiv 2602.23881 (speculators ``nla``)
  lk_hybrid  ``lam KL(p || q) + (1 - lam)(1 - alpha)``,     LK losses; ``lam = exp(-3 alpha)``, detached, as
             ``lam = exp(-3 alpha)``                         speculators' ``lk_hybrid``
  ========== ============================================== ==========================================

  ``p`` and ``q`` are both taken at ``loss_temperature`` (alpha at sampling temperature T is the overlap of the
  two distributions at T); ``ce`` ignores it.
- ``position_weights``: ``decay`` (position k of a chain weighs ``position_decay ** k``, k = 1..gamma: Medusa's
  lambda_k, EAGLE-3's step decay, DFlash's ``exp(-(k-1)/d)`` with ``position_decay = exp(-1/d)``) or ``dpace``
  (D-PACE, arXiv 2605.18810: position j weighs ``sum_{m >= j} prod_{i <= m} q_i`` with
  ``q_i = (1 - a) exp(-CE_i) + a``, ``a = dpace_floor``, detached: the expected number of drafts accepted from j
  on, so a position counts as much as it can still be reached).
- ``feature_noise``: std of Gaussian noise added to the target states the drafter reads while training
  (speculators' default 0.05); 0 is off.

The weighted loss is normalised by the weights' sum over every process (:func:`normalise`), so that a step
under DDP/FSDP is the step one process would take on the union of the processes' micro-batches.

Each objective is a short autograd function in :data:`OBJECTIVES` (its reference, usable as it is); those in
:data:`FAST` also have a closed-form gradient (:func:`losses_and_grads`), which training uses whenever every
objective of a mix has one (:func:`objective_and_grads`). Adding an objective is one function and its line in
:data:`OBJECTIVES` (plus, optionally, its term in :func:`losses_and_grads` and its name in :data:`FAST`); the
tests hold every fast path to its reference by iterating over :data:`FAST`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from draftheads.choice import Choice

LK_HYBRID_SCALE = 3.0
"""``lam = exp(-3 alpha)`` in ``lk_hybrid`` (speculators' documented value for its LK hybrid)."""

Reference = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", float], torch.Tensor]
"""``objective(z, labels, z_t, T) -> loss``: the drafter's logits ``z`` ``[N, V]`` float32, the labels ``[N]``
int64, the target's logits ``z_t`` ``[N, V]`` float32 (None for ``ce``), both distributions' temperature ``T``
(``ce`` reads neither); the objective at each position ``[N]`` float32, differentiable in ``z`` by autograd
(a row's loss reads only its row)."""


def _distributions(z: torch.Tensor, z_t: torch.Tensor, T: float):
    """``(log p, log q)`` at temperature ``T``: the target's and the drafter's log-softmaxes ``[N, V]``."""
    return torch.log_softmax(z_t / T, -1), torch.log_softmax(z / T, -1)


def _alpha(z: torch.Tensor, z_t: torch.Tensor, T: float) -> torch.Tensor:
    """``sum_v min(p_v, q_v)`` ``[N]``: the probability that speculative sampling accepts the draft."""
    log_p, log_q = _distributions(z, z_t, T)
    return torch.minimum(log_p.exp(), log_q.exp()).sum(-1)


def ce(z, labels, z_t, T):
    """``-log q_y`` at temperature 1 (the DFlash, EAGLE-3 and Medusa papers)."""
    return F.cross_entropy(z, labels, reduction="none")


def kl(z, labels, z_t, T):
    """``KL(p || q)`` (speculators' ``kl_div``)."""
    log_p, log_q = _distributions(z, z_t, T)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def rkl(z, labels, z_t, T):
    """``KL(q || p)`` (speculators' ``rkl``)."""
    log_p, log_q = _distributions(z, z_t, T)
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(z, labels, z_t, T):
    """``(KL(p || m) + KL(q || m)) / 2``, ``m = (p + q) / 2`` (speculators' ``jsd``)."""
    log_p, log_q = _distributions(z, z_t, T)
    log_m = torch.logaddexp(log_p, log_q) - math.log(2)
    return ((log_p.exp() * (log_p - log_m)).sum(-1) + (log_q.exp() * (log_q - log_m)).sum(-1)) / 2


def tv(z, labels, z_t, T):
    """``1 - alpha``, the total variation distance (speculators' ``tv``; DSpark's loss)."""
    return 1 - _alpha(z, z_t, T)


def lk_alpha(z, labels, z_t, T):
    """``-log alpha`` (LK losses, arXiv 2602.23881; speculators' ``nla``)."""
    return -torch.log(_alpha(z, z_t, T) + 1e-8)


def lk_hybrid(z, labels, z_t, T):
    """``lam KL(p || q) + (1 - lam)(1 - alpha)``, ``lam = exp(-3 alpha)`` detached (speculators' ``lk_hybrid``)."""
    alpha = _alpha(z, z_t, T)
    lam = torch.exp(-LK_HYBRID_SCALE * alpha).detach()
    return lam * kl(z, labels, z_t, T) + (1 - lam) * (1 - alpha)


OBJECTIVES: dict[str, Reference] = {"ce": ce, "kl": kl, "rkl": rkl, "jsd": jsd, "tv": tv, "lk_alpha": lk_alpha,
                                    "lk_hybrid": lk_hybrid}
"""Every per-position objective ``<drafter>.loss`` names (alone, or weighted in a mapping), by name: its reference
function. Anything but ``ce`` reads the target's distribution."""

FAST = frozenset(OBJECTIVES)
"""The objectives :func:`losses_and_grads` makes in closed form (each checked against its reference)."""


class PositionWeights(Choice):
    """How a drafted position weighs in the loss (``<drafter>.position_weights``)."""
    decay = "decay"
    dpace = "dpace"


@dataclass
class Objective:
    """The training objective keys every drafter's config section has (see the module docstring)."""
    loss: Any = "ce"
    """``ce``, ``kl``, ``rkl``, ``jsd``, ``tv``, ``lk_alpha``, ``lk_hybrid``, or a mapping of them to weights
    (``{ce: 0.1, tv: 0.9}``). Anything but ``ce`` alone reads the target's distribution at every drafted
    position: the target's LM head on its last hidden state there (a drafter on chosen target layers also
    caches the last layer's output)."""
    loss_temperature: float = 1.0
    """Temperature both distributions are taken at in a distillation objective (alpha depends on it)."""
    position_weights: PositionWeights = PositionWeights.decay
    """``decay`` (``position_decay ** k``) or ``dpace`` (D-PACE's acceptance-reach weights)."""
    position_decay: float | None = None
    """Base of ``decay``'s weights, position k (1-based) weighing ``position_decay ** k``; each drafter states
    its default."""
    dpace_floor: float = 0.5
    """D-PACE's ``a`` in ``q_i = (1 - a) exp(-CE_i) + a`` (the paper's 0.5)."""
    feature_noise: float = 0.0
    """Std of Gaussian noise on the target states the drafter reads while training; 0 is off."""


def loss_mix(value: Any, where: str) -> dict[str, float]:
    """``<drafter>.loss`` as ``{name: weight}``. Raises ``ValueError`` naming ``where`` (the key) for an unknown
    name, a weight that is not a positive number, or an empty mapping."""
    mix = {value: 1.0} if isinstance(value, str) else dict(value) if hasattr(value, "items") else None
    if not mix:
        raise ValueError(f"{where}={value!r}: give one of {', '.join(OBJECTIVES)} or a mapping of them to weights, "
                         f"e.g. {{ce: 0.1, tv: 0.9}}")
    bad = [k for k in mix if k not in OBJECTIVES]
    if bad:
        raise ValueError(f"{where}: unknown objective {bad} (known: {', '.join(OBJECTIVES)})")
    weights = {}
    for name, weight in mix.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{where}.{name}={weight!r}: a weight must be a number > 0")
        weights[name] = float(weight)
    return weights


def check_objective(settings: Objective, section: str) -> None:
    """Refuse ``<section>``'s objective keys before any work (``ValueError`` naming the key)."""
    loss_mix(settings.loss, f"{section}.loss")
    if not settings.loss_temperature > 0:
        raise ValueError(f"{section}.loss_temperature={settings.loss_temperature} must be > 0")
    if settings.position_decay is not None and not 0 < settings.position_decay <= 1:
        raise ValueError(f"{section}.position_decay={settings.position_decay} must be in (0, 1]")
    if not 0 <= settings.dpace_floor < 1:
        raise ValueError(f"{section}.dpace_floor={settings.dpace_floor} must be in [0, 1)")
    if settings.feature_noise < 0:
        raise ValueError(f"{section}.feature_noise={settings.feature_noise} must be >= 0")


def needs_target(settings: Objective) -> bool:
    """Whether the objective reads the target's distribution (anything but ``ce`` alone)."""
    return set(loss_mix(settings.loss, "loss")) != {"ce"}


def with_last_layer(layer_ids, settings: Objective, num_layers: int) -> tuple[int, ...]:
    """The target layers a drafter on chosen layers reads while training: its own ``layer_ids``, and the last
    decoder layer (id ``num_layers - 1``, appended even when already chosen) when the objective reads the
    target's distribution (:func:`split_last`)."""
    return tuple(layer_ids) + ((num_layers - 1,) if needs_target(settings) else ())


def split_last(features: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., (K+1)*D]`` features read as :func:`with_last_layer` lists them into the drafter's ``[..., K*D]``
    and the target's last hidden states ``[..., D]`` (the last layer's output through its final norm: what the
    LM head reads)."""
    width = target.config.hidden_size
    norm = target.get_decoder().norm
    last = features[..., -width:]
    return features[..., :-width], norm(last.to(norm.weight.dtype))


def add_noise(features: torch.Tensor, std: float) -> torch.Tensor:
    """``features`` plus Gaussian noise of ``std`` (global RNG: checkpointed, a resumed run draws the same)
    while autograd is on (training); unchanged otherwise or at std 0."""
    if not std or not torch.is_grad_enabled():
        return features
    return features + std * torch.randn(features.shape, device=features.device).to(features.dtype)


def position_losses(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
                    mix: dict[str, float], temperature: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The objective ``mix`` at each of ``N`` positions, differentiable in ``logits`` (by
    :func:`objective_and_grads`: the closed-form gradient where it exists, on copies of the inputs).

    Args:
        logits: ``[N, V]`` float32, the drafter's; labels: ``[N]`` int64 (for ``ce``).
        target_logits: ``[N, V]`` float32, the target's over the same vocabulary (None: ``ce`` alone).
        mix: ``{name: weight}`` (:func:`loss_mix`); temperature: both distributions' (not ``ce``'s).
    Returns ``loss`` ``[N]`` and ``alpha`` ``[N]`` (``sum_v min(p_v, q_v)`` at ``temperature``, detached; None
    without ``target_logits``).
    """
    loss, alpha = _PositionLosses.apply(logits, labels, target_logits, mix, temperature)
    return loss, alpha if target_logits is not None else None


class _PositionLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, target_logits, mix, temperature):
        copy = lambda t: None if t is None else t.detach().to(torch.float32, copy=True)  # noqa: E731
        loss, _, alpha, grad = objective_and_grads(copy(logits), labels, copy(target_logits), mix, temperature,
                                                   grad=ctx.needs_input_grad[0])
        ctx.save_for_backward(grad)
        ctx.dtype = logits.dtype
        alpha = loss.new_empty(0) if alpha is None else alpha
        ctx.mark_non_differentiable(alpha)
        return loss, alpha

    @staticmethod
    def backward(ctx, grad_loss, _):
        (grad,) = ctx.saved_tensors
        return (grad * grad_loss[:, None]).to(ctx.dtype), None, None, None, None


def objective_and_grads(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
                        mix: dict[str, float], temperature: float, grad: bool = True):
    """:func:`losses_and_grads` (closed form, in the inputs' storage) when every objective of ``mix`` is in
    :data:`FAST`, else :func:`reference_losses_and_grads` (autograd on the references); the same arguments and
    returns."""
    fast = set(mix) <= FAST
    return (losses_and_grads if fast else reference_losses_and_grads)(logits, labels, target_logits, mix,
                                                                         temperature, grad)


def reference_losses_and_grads(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
                               mix: dict[str, float], temperature: float, grad: bool = True):
    """:func:`losses_and_grads`' returns (``loss``, ``ce``, ``alpha``, ``grad``) made by autograd through the
    objectives' reference functions (:data:`OBJECTIVES`): any objective, at the memory and time of autograd on
    ``[N, V]`` logits. The inputs are left as they are."""
    z = logits.detach().float().requires_grad_(grad)
    z_t = None if target_logits is None else target_logits.detach().float()
    with torch.enable_grad() if grad else torch.no_grad():
        loss = sum(weight * OBJECTIVES[name](z, labels, z_t, temperature) for name, weight in mix.items())
        g = torch.autograd.grad(loss.sum(), z)[0] if grad else None
    with torch.no_grad():
        alpha = None if z_t is None else _alpha(z, z_t, temperature)
        return loss.detach(), ce(z, labels, None, 1.0), alpha, g


def losses_and_grads(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
                     mix: dict[str, float], temperature: float, grad: bool = True):
    """The objective ``mix`` at each of ``N`` positions and its gradient in ``logits``, in closed form: no autograd
    graph, few ``[N, V]`` tensors (:func:`logit_buffers`; the inputs' storage is reused).

    Args:
        logits: ``[N, V]`` float32, the drafter's ``z``; overwritten (the gradient is returned in its place or
            beside it).
        labels: ``[N]`` int64 (for ``ce``).
        target_logits: ``[N, V]`` float32, the target's ``z_t`` over the same vocabulary, overwritten; None:
            ``ce`` alone (unweighted, as ``F.cross_entropy``).
        mix: ``{name: weight}`` (:func:`loss_mix`); temperature: ``T``, both distributions' (not ``ce``'s).
        grad: whether to make the gradient.
    Returns ``loss`` ``[N]`` (``sum_name weight * objective``), ``ce`` ``[N]`` (``logsumexp(z) - z_label``,
    whatever the mix), ``alpha`` ``[N]`` (``sum_v min(p_v, q_v)``; None without ``target_logits``), all float32,
    and ``grad`` ``[N, V]`` float32, row ``i`` being ``d loss_i / d z_i`` (None unless ``grad``).

    The gradient. With ``q = softmax(z / T)``, ``p = softmax(z_t / T)``:

    - ``ce``: ``softmax(z) - onehot(label)`` (at temperature 1).
    - ``kl`` ``= sum_v p_v (log p_v - log q_v)``: ``d/d log q = -p``, and through the log-softmax
      ``(q sum_v p_v - p) / T = (q - p) / T``.
    - A function ``f(q)`` of the drafter's distribution with ``g = df/dq`` (``[N, V]``): through the softmax's
      Jacobian ``dq_v/dz_u = q_v (delta_uv - q_u) / T``, ``q * (g - sum_v q_v g_v) / T``; a per-row constant
      added to ``g`` cancels, so each ``g`` below is written up to one:

      - ``rkl`` ``= sum_v q_v (log q_v - log p_v)``: ``g = log q - log p`` (``+ 1``).
      - ``jsd`` ``= (KL(p || m) + KL(q || m)) / 2``, ``m = (p + q) / 2``: ``g = log(q / m) / 2`` (the terms in
        ``dm/dq`` add up to ``-(p + q) / (4 m) = -1/2``, a constant).
      - ``tv`` ``= 1 - sum_v min(p_v, q_v)``: ``g = -[q < p] - [q = p] / 2`` (autograd's ``torch.minimum`` splits
        a tie in halves) ``= sign(q - p) / 2`` (``- 1/2``): the same subgradient as before, ties included.
      - ``lk_alpha`` ``= -log(alpha + 1e-8)``: ``g = sign(q - p) / (2 (alpha + 1e-8))``, the chain rule on
        ``tv``'s.
      - ``lk_hybrid`` ``= lam kl + (1 - lam) tv`` with ``lam = exp(-3 alpha)`` a constant (detached):
        ``lam`` times ``kl``'s gradient plus ``1 - lam`` times ``tv``'s.

    A mix is the weighted sum: with per-row coefficients ``c_kl`` (``kl``, ``lk_hybrid``'s ``lam``) and
    ``G = c_sign sign(q - p) - c_rkl (log p - log q) + c_jsd log(q / m)`` (``[N, V]``),
    ``grad = (c_kl (q - p) + q (G - sum_v q_v G_v)) / T + w_ce (softmax(z) - onehot)``, made in place in one
    buffer (at ``T = 1`` ``softmax(z)`` is ``q`` and ``w_ce`` joins ``G``'s per-row constant).
    """
    z, zt, T = logits, target_logits, temperature
    rows = torch.arange(len(z), device=z.device)
    z_y = z.gather(1, labels[:, None])
    if zt is None:  # ce alone: softmax(z) - onehot
        _, q, lse = _softmax_(z, log=False)
        ce = (lse - z_y)[:, 0]
        if grad:
            q[rows, labels] -= 1
        return ce, ce, None, q if grad else None
    w = {name: mix.get(name, 0.0) for name in FAST}
    q1 = lse = None
    if T != 1:  # ce's own logsumexp and softmax, at temperature 1
        if w["ce"] and grad:
            _, q1, lse = _softmax_(z.clone(), log=False)
        else:
            lse = z.logsumexp(-1, keepdim=True)
        z.div_(T)
        zt.div_(T)
    log = any(w[name] for name in ("kl", "rkl", "jsd", "lk_hybrid"))
    log_q, q, lse_q = _softmax_(z, log)
    log_p, p, _ = _softmax_(zt, log)
    ce = ((lse_q if lse is None else lse) - z_y)[:, 0]
    jsd_g = None
    if w["jsd"]:  # log(q / m), from log-softmaxes: finite where p and q underflow together
        jsd_g = torch.logaddexp(log_p, log_q).sub_(math.log(2)).neg_().add_(log_q)
    d = log_p.sub_(log_q) if log else None  # log p - log q, in log p's place
    scratch = torch.minimum(p, q, out=log_q) if log else torch.minimum(p, q)  # in log q's place once free
    alpha = scratch.sum(-1, keepdim=True)
    dot = lambda a, b: torch.mul(a, b, out=scratch).sum(-1, keepdim=True)  # noqa: E731 (sum_v a_v b_v, [N, 1])
    kl = dot(p, d) if log else None
    lam = torch.exp(-LK_HYBRID_SCALE * alpha)
    terms = {
        "ce": lambda: ce[:, None],
        "kl": lambda: kl,
        "rkl": lambda: -dot(q, d),
        "jsd": lambda: 0.5 * (kl + dot(torch.add(p, q, out=scratch), jsd_g)),
        "tv": lambda: 1 - alpha,
        "lk_alpha": lambda: -torch.log(alpha + 1e-8),
        "lk_hybrid": lambda: lam * kl + (1 - lam) * (1 - alpha),
    }
    loss = sum(weight * terms[name]() for name, weight in mix.items())[:, 0]
    if not grad:
        return loss, ce, alpha[:, 0], None
    c_kl = w["kl"] + w["lk_hybrid"] * lam
    c_sign = 0.5 * (w["tv"] + w["lk_alpha"] / (alpha + 1e-8) + w["lk_hybrid"] * (1 - lam))
    if w["tv"] or w["lk_alpha"] or w["lk_hybrid"]:
        g = torch.sub(q, p, out=scratch).sign_().mul_(c_sign)
    else:
        g = scratch.zero_()
    if w["rkl"]:
        g.add_(d, alpha=-w["rkl"])
    if w["jsd"]:
        g.add_(jsd_g, alpha=0.5 * w["jsd"])
    g.mul_(q)  # q G; then q (G - sum_v q_v G_v) + c_kl q (+ w_ce q at T = 1), then - c_kl p
    g.addcmul_(q, c_kl - g.sum(-1, keepdim=True) + (w["ce"] if T == 1 else 0))
    if w["kl"] or w["lk_hybrid"]:
        g.addcmul_(p, -c_kl)
    if T != 1:
        g.div_(T)
        if q1 is not None:
            g.add_(q1, alpha=w["ce"])
    if w["ce"]:
        g[rows, labels] -= w["ce"]
    return loss, ce, alpha[:, 0], g


def logit_buffers(mix: dict[str, float], temperature: float, target: bool) -> int:
    """How many ``[N, V]`` float32 tensors :func:`losses_and_grads` holds at once, its inputs included: 1 for
    ``ce`` alone; with the target's logits ``q``, ``p`` and a scratch tensor (the gradient), the log-softmaxes'
    difference for ``kl``, ``rkl``, ``jsd`` and ``lk_hybrid``, ``log(q / m)`` for ``jsd``, and ``softmax(z)`` for
    ``ce`` at a temperature other than 1; autograd through the references (a mix outside :data:`FAST`) holds
    about two per objective besides the inputs and the gradient."""
    if not set(mix) <= FAST:
        return 3 + 2 * len(mix)
    if not target:
        return 1
    log = any(name in mix for name in ("kl", "rkl", "jsd", "lk_hybrid"))
    return 3 + log + ("jsd" in mix) + ("ce" in mix and temperature != 1)


def _softmax_(x: torch.Tensor, log: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``x`` ``[N, V]`` float32 overwritten by its log-softmax (``log``; its softmax then in a new tensor) or by its
    softmax (one exp either way). Returns ``(log_softmax or None, softmax, logsumexp [N, 1])``."""
    lse = x.amax(-1, keepdim=True)
    x.sub_(lse)
    e = x.exp() if log else x.exp_()
    s = e.sum(-1, keepdim=True)
    e.div_(s)
    s.log_()
    if log:
        x.sub_(s)
    return (x if log else None), e, lse.add_(s)


def chain_weights(settings: Objective, valid: torch.Tensor, ce: torch.Tensor | None = None) -> torch.Tensor:
    """Unnormalised weights ``[..., G]`` of chains of drafts (the last dimension: drafted positions 1..G),
    0 where ``valid`` ``[..., G]`` is false: ``position_decay ** k``, or D-PACE's from ``ce`` ``[..., G]`` (each
    position's cross-entropy, detached). A position after an invalid one is unreachable: D-PACE gives it 0."""
    G = valid.shape[-1]
    if settings.position_weights == PositionWeights.decay:
        k = torch.arange(1, G + 1, device=valid.device, dtype=torch.float32)
        return settings.position_decay ** k * valid
    a = settings.dpace_floor
    q = ((1 - a) * torch.exp(-ce.detach().float()) + a) * valid
    reach = q.cumprod(-1)  # prod_{i <= m} q_i
    return reach.flip(-1).cumsum(-1).flip(-1) * valid  # sum_{m >= j}


def normalise(weights: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``weights`` ``[..., G]`` scaled so the loss ``sum(weights * loss)`` is their weighted mean over every
    process: ``weights * R / (their sum over all R processes)`` (DDP averages gradients over ranks, so each rank's
    share carries R). With ``valid`` ``[..., G]``, each position k is instead divided by its count of valid
    entries over every process (Medusa's loss: each head's mean, weighted by ``position_decay ** k``). The sums
    are all-reduced while autograd is on (training, where every rank runs every micro-batch); held-out metrics on
    one process use their own."""
    sums = weights.sum().reshape(1) if valid is None else valid.flatten(0, -2).sum(0).float()
    world = 1
    if torch.is_grad_enabled() and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        dist.all_reduce(sums)
    return weights * world / sums.clamp_min(1e-30)
