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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from draftheads.choice import Choice

LOSSES = ("ce", "kl", "rkl", "jsd", "tv", "lk_alpha", "lk_hybrid")
"""The per-position objectives ``<drafter>.loss`` names (alone, or weighted in a mapping)."""

LK_HYBRID_SCALE = 3.0
"""``lam = exp(-3 alpha)`` in ``lk_hybrid`` (speculators' documented value for its LK hybrid)."""


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
        raise ValueError(f"{where}={value!r}: give one of {', '.join(LOSSES)} or a mapping of them to weights, "
                         f"e.g. {{ce: 0.1, tv: 0.9}}")
    bad = [k for k in mix if k not in LOSSES]
    if bad:
        raise ValueError(f"{where}: unknown objective {bad} (known: {', '.join(LOSSES)})")
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
    """The objective ``mix`` at each of ``N`` positions, differentiable in ``logits``.

    Args:
        logits: ``[N, V]`` float32, the drafter's; labels: ``[N]`` int64 (for ``ce``).
        target_logits: ``[N, V]`` float32, the target's over the same vocabulary (None: ``ce`` alone).
        mix: ``{name: weight}`` (:func:`loss_mix`); temperature: both distributions' (not ``ce``'s).
    Returns ``loss`` ``[N]`` and ``alpha`` ``[N]`` (``sum_v min(p_v, q_v)`` at ``temperature``, detached; None
    without ``target_logits``).
    """
    if target_logits is None:
        return F.cross_entropy(logits, labels, reduction="none"), None
    log_q = F.log_softmax(logits / temperature, -1)
    log_p = F.log_softmax(target_logits / temperature, -1)
    q, p = log_q.exp(), log_p.exp()
    alpha = torch.minimum(p, q).sum(-1)
    kl = lambda: (p * (log_p - log_q)).sum(-1)  # noqa: E731 (each term made only when the mix names it)
    terms = {
        "ce": lambda: F.cross_entropy(logits, labels, reduction="none"),
        "kl": kl,
        "rkl": lambda: (q * (log_q - log_p)).sum(-1),
        "jsd": lambda: _jsd(p, q, log_p, log_q),
        "tv": lambda: 1 - alpha,
        "lk_alpha": lambda: -torch.log(alpha + 1e-8),
        "lk_hybrid": lambda: _lk_hybrid(kl(), alpha),
    }
    loss = sum(weight * terms[name]() for name, weight in mix.items())
    return loss, alpha.detach()


def _jsd(p, q, log_p, log_q):
    log_m = torch.logaddexp(log_p, log_q) - math.log(2)  # finite where p and q underflow together
    return 0.5 * ((p * (log_p - log_m)).sum(-1) + (q * (log_q - log_m)).sum(-1))


def _lk_hybrid(kl, alpha):
    lam = torch.exp(-LK_HYBRID_SCALE * alpha.detach())
    return lam * kl + (1 - lam) * (1 - alpha)


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
