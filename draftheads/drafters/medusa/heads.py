"""Medusa draft heads (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads", arXiv 2401.10774).

Each head is a stack of residual blocks ``x + SiLU(W x + b)`` (paper eq. 1) applied to the target's last
hidden state at position t; head k (1-based) predicts token t+k+1, the target's own LM head predicts t+1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftheads.training.lm_head_loss import LMHead, head_loss
from draftheads.training.objectives import PositionWeights, chain_weights, loss_mix, normalise


class ResBlock(nn.Module):
    """One Medusa residual block, ``x + SiLU(W x + b)``.

    W is zero-initialised so that a fresh block is the identity and a fresh head predicts what the target's
    LM head predicts (Medusa paper, section 2.1.1).

    Args:
        hidden_size: D, the target's hidden size.
    Shapes: ``[..., D] -> [..., D]``, any float dtype.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads of L residual blocks each, every block with its own weights.

    Args:
        hidden_size: D, must equal the target's hidden size.
        vocab_size: V, the target's vocabulary size.
        num_heads: K.
        num_layers: L, residual blocks per head.
        per_head_lm_head: give each head its own LM head (initialised from the target's with
            :meth:`init_lm_heads_from`); otherwise logits go through the target's frozen LM head.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1,
                 per_head_lm_head: bool = False):
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {num_heads}, {num_layers}")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads))
        self.lm_heads = (nn.ModuleList(LMHead(hidden_size, vocab_size, bias=False) for _ in range(num_heads))
                         if per_head_lm_head else None)

    @property
    def per_head_lm_head(self) -> bool:
        return self.lm_heads is not None

    def init_lm_heads_from(self, lm_head: nn.Module) -> None:
        """Copy the target's LM head weight ``[V, D]`` into every per-head LM head."""
        if self.lm_heads is None:
            raise ValueError("init_lm_heads_from needs per_head_lm_head=True")
        with torch.no_grad():
            for head in self.lm_heads:
                head.weight.copy_(lm_head.weight)

    def check_target(self, hidden_size: int, vocab_size: int, where: str = "target") -> None:
        """Raise ``ValueError`` naming both sizes when these heads cannot run on ``where``."""
        if (hidden_size, vocab_size) != (self.hidden_size, self.vocab_size):
            raise ValueError(
                f"Medusa heads have hidden_size={self.hidden_size}, vocab_size={self.vocab_size} but {where} has "
                f"hidden_size={hidden_size}, vocab_size={vocab_size}: they were trained for another model")

    def head_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Residual blocks of every head.

        Args:
            hidden_states: ``[..., D]`` target last-layer hidden states (after the final norm).
        Returns:
            ``[K, ..., D]``.
        """
        return torch.stack([blocks(hidden_states) for blocks in self.blocks])

    def lm_head_of(self, k: int, lm_head: nn.Module | None) -> nn.Module:
        """Head ``k``'s LM head (0-based): its own, or the target's ``lm_head``. Raises ``ValueError`` when the
        heads share the target's and ``lm_head`` is None."""
        if self.lm_heads is not None:
            return self.lm_heads[k]
        if lm_head is None:
            raise ValueError("these Medusa heads share the target's LM head: pass lm_head")
        return lm_head

    def head_logits(self, k: int, head_state: torch.Tensor, lm_head: nn.Module | None) -> torch.Tensor:
        """Logits ``[..., V]`` of head ``k`` (0-based) from its block output ``[..., D]``."""
        return self.lm_head_of(k, lm_head)(head_state)

    def forward(self, hidden_states: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """Logits of all heads.

        Args:
            hidden_states: ``[..., D]``.
            lm_head: the target's LM head (``D -> V``), required unless ``per_head_lm_head``.
        Returns:
            ``[K, ..., V]``, head k's logits for token t+k+2 (0-based k) at every position t.
        """
        states = self.head_states(hidden_states)
        if self.lm_heads is None and lm_head is not None:
            return lm_head(states)  # one GEMM: the V x D weight is read once, not K times (decoding is memory-bound)
        return torch.stack([self.head_logits(k, states[k], lm_head) for k in range(self.num_heads)])


def medusa_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int,
                   documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity for every head at every position.

    Head k (1-based) at position t predicts ``input_ids[t + k + 1]``; the pair counts when that label is an
    assistant token (``loss_mask`` true) of the same row.

    Args:
        input_ids: ``[B, T]`` int64.
        loss_mask: ``[B, T]`` bool, true on tokens the loss covers.
        num_heads: K.
        documents: ``[B, T]`` each token's row in a packed batch (:func:`~draftheads.data.batching.pack`), or
            None (one row per batch line).
    Returns:
        labels ``[K, B, T]`` int64 (0 where invalid) and valid ``[K, B, T]`` bool.
    """
    B, T = input_ids.shape
    labels = input_ids.new_zeros((num_heads, B, T))
    valid = torch.zeros((num_heads, B, T), dtype=torch.bool, device=input_ids.device)
    for k in range(1, num_heads + 1):
        shift = k + 1
        if shift >= T:
            break
        labels[k - 1, :, :-shift] = input_ids[:, shift:]
        valid[k - 1, :, :-shift] = loss_mask[:, shift:]
        if documents is not None:
            valid[k - 1, :, :-shift] &= documents[:, shift:] == documents[:, :-shift]
    return labels, valid


def medusa_loss(heads: MedusaHeads, hidden_states: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                lm_head: nn.Module | None, settings, teacher_states: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The heads' loss and metrics: head k's objective at every position t where its label is valid, the heads
    at t forming a chain of drafts (:mod:`draftheads.training.objectives`). Under ``position_weights: decay``
    it is Medusa-1's ``sum_k position_decay^k * mean_t CE_k`` (paper eq. 2 with lambda_k = decay^k, k 1-based;
    Medusa's code uses 0.8 too).

    Each head runs only at positions where its label is valid: the LM head (V x D per token) is the cost, and its
    ``[positions, V]`` logits are never materialised (:func:`~draftheads.training.lm_head_loss.head_loss`).

    Args:
        heads: the Medusa heads.
        hidden_states: ``[B, T, D]`` float, the last hidden states the heads read (after the final norm).
        labels, valid: ``[K, B, T]`` from :func:`medusa_targets`.
        lm_head: the target's LM head, or None for per-head LM heads.
        settings: ``medusa``'s :class:`~draftheads.training.objectives.Objective`.
        teacher_states: ``[B, T, D]`` the original target's last hidden states, for a distillation objective
            (the target predicts token t+k+1, head k's label, from its state at t+k, through ``lm_head``).
    Returns:
        the scalar loss and detached metrics ``head{k}_loss`` (cross-entropy), ``head{k}_top1``, ``head{k}_top5``
        (1-based k), and ``head{k}_overlap`` (mean ``sum_v min(p_v, q_v)``) under a distillation objective. A head
        without a valid position adds 0 to the loss (still in the graph) and NaN metrics, so every rank has the
        same parameters used and the same metric keys.
    """
    K, B, T = labels.shape
    mix = loss_mix(settings.loss, "medusa.loss")
    states = [heads.blocks[k](hidden_states[valid[k]]) for k in range(K)]
    chains = valid.permute(1, 2, 0)  # [B, T, K]: the heads' drafts at one position
    ce = None
    if settings.position_weights == PositionWeights.dpace:
        ce = torch.zeros(chains.shape, device=hidden_states.device)
        with torch.no_grad():
            for k in range(K):
                ce[..., k][valid[k]] = head_loss(heads.lm_head_of(k, lm_head), states[k], labels[k][valid[k]]).ce
    weights = chain_weights(settings, chains, ce)
    weights = normalise(weights, chains if settings.position_weights == PositionWeights.decay else None)
    total = hidden_states.new_zeros(())
    metrics: dict[str, torch.Tensor] = {}
    for k in range(K):
        positions = valid[k]
        target = labels[k][positions]
        head = heads.lm_head_of(k, lm_head)
        teacher = None
        if teacher_states is not None:
            ahead = (torch.arange(T, device=positions.device) + k + 1).clamp(max=T - 1)
            teacher = (teacher_states[:, ahead][positions], lm_head.weight, lm_head.bias)
        out = head_loss(head, states[k], target, weights=weights[..., k][positions], k=5, teacher=teacher, mix=mix,
                        temperature=settings.loss_temperature)
        # a head without a position adds a zero loss, still in the graph (DDP expects a gradient for every
        # parameter on every rank)
        total = total + out.loss
        if not len(target):
            nan = hidden_states.new_tensor(float("nan"))
            metrics.update({f"head{k + 1}_{m}": nan for m in ("loss", "top1", "top5")})
            continue
        with torch.no_grad():
            metrics[f"head{k + 1}_loss"] = out.ce.mean()
            metrics[f"head{k + 1}_top1"] = (out.top[:, 0] == target).float().mean()
            metrics[f"head{k + 1}_top5"] = (out.top == target[:, None]).any(-1).float().mean()
            if out.alpha is not None:
                metrics[f"head{k + 1}_overlap"] = out.alpha.mean()
    return total, metrics


class MedusaDrafter:
    """Medusa heads as a chain drafter (Medusa paper, section 2.1.2, chain case): head k's distribution is
    the proposal for position k; it ignores ``last_token`` (the heads see the hidden state only)."""
    name = "medusa_chain"
    target_layer_ids = ()

    def __init__(self, heads, lm_head):
        self.heads, self.lm_head = heads, lm_head
        self.gamma = heads.num_heads

    def start(self) -> None:
        pass

    @torch.inference_mode()
    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                    tokens: torch.Tensor | None) -> torch.Tensor:
        return self.heads(hidden_state, lm_head=self.lm_head)
