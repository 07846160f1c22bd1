"""DSpark draft model (DeepSeek, "DSpark: Confidence-Scheduled Speculative Decoding with Semi-Autoregressive
Generation", arXiv 2607.05147), laid out as vLLM's ``qwen3_dspark.py`` loads it and drafting as vLLM's
``v1/worker/gpu/spec_decode/dspark/speculator.py`` drafts.

- Backbone: DFlash's (:class:`~draftheads.drafters.dflash.model.DFlashDraftModel`, as vLLM's
  ``Qwen3DSparkModel`` extends ``DFlashQwen3Model``): ``fc`` + ``hidden_norm`` on K target layers' outputs, N Qwen3
  decoder layers that take them as extra keys/values, ``norm``; the target's embedding table and LM head, frozen.
- Block ("anchor as first prediction", vLLM's ``sample_from_anchor``): S = block_size positions ``a..a+S-1``
  holding ``[anchor, noise x (S-1)]``, bidirectional inside, seeing the context strictly before the anchor; the
  output at position k drafts token ``a+k+1``, so a block drafts gamma = S tokens (DFlash's position k drafts
  token ``a+k``, S-1 of them).
- Markov head (the sequential stage): ``markov_w1`` (``V x r`` embedding) and ``markov_w2`` (``r -> V``, no
  bias). Position k's logits are ``lm_head(h_k) + markov_w2(markov_w1[x])`` with x the token before it: the
  anchor at k = 0, else the token drafted at k-1 (its argmax when drafting greedily; the true token in training).
- Markov head forms (``markov_head_type``, DeepSpec's ``markov_head.py``): ``vanilla`` above, the only one vLLM
  builds; ``gated`` scales the embedding by ``sigmoid(gate_proj([h_k; markov_w1[x]]))`` before ``markov_w2``;
  ``rnn`` (recurrent) carries a state along the block, ``s_k = g * s_{k-1} + (1 - g) * c`` with
  ``[g; c; o] = joint_proj([s_{k-1}; markov_w1[x]; h_k])`` (sigmoid, tanh), and biases by ``markov_w2(tanh(o))``.
- Confidence head: ``proj`` (``D + r -> 1`` with bias) on ``[h_k; markov_w1[x]]``; its sigmoid predicts that
  position k's draft is accepted given the ones before it were (vLLM multiplies them along the block into
  survival probabilities, ``adaptive_verification.py``), trained against the acceptance probability
  ``alpha_k = sum_v min(p_v, q_v)`` as DeepSpec trains it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from draftheads.drafters.dflash.model import DFlashDraftModel, DFlashDrafter, block_labels
from draftheads.drafters.dflash.model import draft_config as dflash_draft_config
from draftheads.training.held_out import chain_estimates
from draftheads.training.lm_head_loss import drafted_loss
from draftheads.training.objectives import chain_weights, normalise


def draft_config(target_config, num_layers: int, block_size: int, target_layer_ids: list[int], mask_token_id: int,
                 markov_rank: int, confidence: bool, confidence_with_markov: bool = True,
                 markov_head_type: str = "vanilla"):
    """The draft config as ``config.json`` holds it: DFlash's Qwen3 decoder of the target's width, with DSpark's
    keys where vLLM and DeepSpec read them (top level: ``block_size``, ``target_layer_ids``, ``mask_token_id``,
    ``markov_rank``, ``markov_head_type`` (DeepSpec's word: ``vanilla``, ``gated`` or ``rnn``),
    ``enable_confidence_head``, ``confidence_head_with_markov``, ``sample_from_anchor``)."""
    config = dflash_draft_config(target_config, num_layers, block_size, target_layer_ids, mask_token_id)
    del config.dflash_config
    config.architectures = ["Qwen3DSparkModel"]
    config.target_layer_ids = list(target_layer_ids)
    config.mask_token_id = mask_token_id
    config.markov_rank = markov_rank
    config.markov_head_type = markov_head_type
    config.enable_confidence_head = bool(confidence)
    config.confidence_head_with_markov = bool(confidence and confidence_with_markov)
    config.sample_from_anchor = True
    return config


def dflash_view(config):
    """A copy of a DSpark config that DFlash's backbone reads (its ``dflash_config``); the original is left as
    exported."""
    view = copy.copy(config)
    view.dflash_config = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    return view


class MarkovProjection(nn.Linear):
    """``markov_w2``: ``[.., r] -> [.., V]``, bias-free. Given ``labels`` its forward returns the drafted loss
    (:func:`~draftheads.training.lm_head_loss.drafted_loss`) of the logits ``lm_head(hidden) + markov_w2(embed)``,
    made chunk by chunk with ``markov_w2`` as the LM-head loss's second map (no ``[N, V]`` logits, and no gradient
    made for the frozen LM head), its weight read inside its own forward, where sharding engines gather it
    (ZeRO-3)."""

    def forward(self, embed: torch.Tensor, hidden: torch.Tensor | None = None, lm_head: nn.Module | None = None,
                labels: torch.Tensor | None = None, **loss):
        if labels is None:
            return super().forward(embed)
        return drafted_loss(lm_head, hidden, labels, side=(embed, self.weight), **loss)


class DSparkMarkovHead(nn.Module):
    """vLLM's ``DSparkMarkovHead`` (DeepSpec's ``VanillaMarkov``, ``markov_head.py:8-90``): ``markov_w1``
    (``nn.Embedding(V, r)``) and ``markov_w2`` (``r -> V``); position k's bias is ``markov_w2(z_k)`` with the latent
    ``z_k`` = ``markov_w1[x]`` of the token before it. The other forms change only the latent
    (:meth:`latent`); ``hidden_size`` is unused here."""
    kind = "vanilla"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int = 0):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = MarkovProjection(rank, vocab_size, bias=False)

    def latent(self, embed: torch.Tensor, hidden: torch.Tensor | None,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block position: ``[.., r]`` embedding ``markov_w1[x]`` of the previous token and ``[.., D]`` the
        position's hidden state (after the backbone's norm) -> ``([.., r]`` latent, the state for the next
        position``)``; ``state`` None at a block's first position."""
        return embed, state

    def block_latent(self, embed: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """Every position of blocks at once (teacher-forced: the true previous tokens): ``[.., S, r]`` embeddings
        and ``[.., S, D]`` hidden states -> ``[.., S, r]`` latents. Position-wise forms take any shape."""
        return self.latent(embed, hidden)[0]

    def forward(self, prev: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """``[.., S]`` previous token ids (int64) and, for the gated and recurrent forms, ``[.., S, D]`` hidden
        states -> ``[.., S, V]`` logit bias (the vanilla form takes ids of any shape and no hidden states)."""
        return self.markov_w2(self.block_latent(self.markov_w1(prev), hidden))


class GatedMarkovHead(DSparkMarkovHead):
    """DeepSpec's ``GatedMarkovHead`` (``markov_head.py:93-122``): the latent is ``markov_w1[x]`` scaled per
    dimension by ``sigmoid(gate_proj([h_k; markov_w1[x]]))``, ``gate_proj``: ``D + r -> r`` with a bias. Not served
    by vLLM 0.32 (``qwen3_dspark.py`` builds the vanilla head only)."""
    kind = "gated"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def latent(self, embed, hidden, state=None):
        w = self.gate_proj.weight
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(w.dtype), embed.to(w.dtype)], dim=-1)))
        return gate.to(embed.dtype) * embed, state


class RecurrentMarkovHead(DSparkMarkovHead):
    """DeepSpec's ``RNNHead`` (``markov_head.py:125-284``, ``markov_head_type: rnn``): a GRU-like state ``s``
    (``[.., r]``, zero at a block's first position) carried along the block, so position k reads every token drafted
    before it in the block: ``[g; c; o] = joint_proj([s_{k-1}; markov_w1[x]; h_k])`` (``joint_proj``:
    ``2r + D -> 3r`` with a bias), ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``, latent ``tanh(o)``.
    Not served by vLLM 0.32."""
    kind = "rnn"

    def __init__(self, vocab_size: int, rank: int, hidden_size: int):
        super().__init__(vocab_size, rank)
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def latent(self, embed, hidden, state=None):
        w = self.joint_proj.weight
        state = torch.zeros(embed.shape, dtype=w.dtype, device=embed.device) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat([state, embed.to(w.dtype), hidden.to(w.dtype)],
                                                            dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(output).to(embed.dtype), state

    def block_latent(self, embed, hidden):
        out, state = [], None
        for k in range(embed.shape[-2]):  # sequential along the block, as DeepSpec's apply_block_logits
            z, state = self.latent(embed[..., k, :], hidden[..., k, :], state)
            out.append(z)
        return torch.stack(out, dim=-2)


MARKOV_HEADS = {head.kind: head for head in (DSparkMarkovHead, GatedMarkovHead, RecurrentMarkovHead)}
"""``markov_head_type`` (DeepSpec's words, as ``config.json`` holds them) -> the head's class."""


class DSparkConfidenceHead(nn.Module):
    """vLLM's ``DSparkConfidenceHead``: ``proj`` (``input_dim -> 1``, with bias) on the position's hidden state,
    beside the previous token's Markov embedding when ``with_markov``; returns logits (float32)."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor | None = None) -> torch.Tensor:
        x = hidden if markov_embed is None else torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1)
        return self.proj(x.to(self.proj.weight.dtype)).squeeze(-1).float()


class DSparkDraftModel(DFlashDraftModel):
    """The DSpark drafter: DFlash's ``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``, plus ``markov_head`` and
    (when the config enables it) ``confidence_head``; the target's embedding table and LM head are held, frozen
    and unregistered.

    Args:
        config: from :func:`draft_config`.
        embed_weight, lm_head: the target's ``[V, D]`` input embedding table and its LM head.
    Raises ``ValueError`` for feature layers outside the target, a block under 2 positions (the DFlash
    backbone's), a Markov rank under 1 or a ``markov_head_type`` outside :data:`MARKOV_HEADS`.
    """

    def __init__(self, config, embed_weight: torch.Tensor, lm_head: nn.Module):
        super().__init__(dflash_view(config), embed_weight, lm_head)
        self.config = config
        rank = config.markov_rank
        if config.markov_head_type not in MARKOV_HEADS or rank < 1:
            raise ValueError(f"DSpark's Markov head is one of {sorted(MARKOV_HEADS)} with rank >= 1; got "
                             f"{config.markov_head_type!r} of rank {rank}")
        self.markov_head = MARKOV_HEADS[config.markov_head_type](config.vocab_size, rank, config.hidden_size)
        self.confidence_with_markov = bool(config.confidence_head_with_markov)
        self.confidence_head = None
        if config.enable_confidence_head:
            self.confidence_head = DSparkConfidenceHead(config.hidden_size + (rank if self.confidence_with_markov
                                                                              else 0))
        std = config.initializer_range  # as DeepSpec's post_init: N(0, std) weights, zero biases
        nn.init.normal_(self.markov_head.markov_w1.weight, std=std)
        nn.init.normal_(self.markov_head.markov_w2.weight, std=std)
        for proj in (getattr(self.markov_head, name, None) for name in ("gate_proj", "joint_proj")):
            if proj is not None:
                nn.init.normal_(proj.weight, std=std)
                nn.init.zeros_(proj.bias)
        if self.confidence_head is not None:
            nn.init.normal_(self.confidence_head.proj.weight, std=std)
            nn.init.zeros_(self.confidence_head.proj.bias)

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_layers: int, block_size: int, target_layer_ids: list[int],
                   mask_token_id: int, markov_rank: int = 256, confidence: bool = True,
                   confidence_with_markov: bool = True, markov_head_type: str = "vanilla") -> "DSparkDraftModel":
        """A fresh drafter of ``target``'s width (float32, on ``target``'s device); ``markov_head_type`` one of
        :data:`MARKOV_HEADS` (``ValueError`` otherwise)."""
        config = draft_config(target.config, num_layers, block_size, target_layer_ids, mask_token_id, markov_rank,
                              confidence, confidence_with_markov, markov_head_type)
        model = cls(config, target.get_input_embeddings().weight, target.get_output_embeddings())
        return model.to(next(target.parameters()).device)

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """``[.., D]`` hidden states and ``[..]`` previous tokens -> ``[..]`` confidence logits (float32)."""
        embed = self.markov_head.markov_w1(prev) if self.confidence_with_markov else None
        return self.confidence_head(hidden, embed)


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What block position k = 0..S-1 trains on (S = block size): ``(labels, valid, prev)``, each ``[B, A, S]``.
    ``labels`` = ``token[anchor + k + 1]``; ``valid`` where that is a response token inside the row and so is every
    earlier position's (DeepSpec's contiguous ``eval_mask``); ``prev`` = ``token[anchor + k]``, the token the
    Markov head reads (the anchor at k = 0; teacher-forced)."""
    labels, valid = block_labels(input_ids, loss_mask, anchors, block_size + 1)
    valid = valid.long().cumprod(-1).bool()
    T = input_ids.shape[1]
    pos = (anchors.clamp(min=0)[..., None] + torch.arange(block_size, device=anchors.device)).clamp(max=T - 1)
    prev = input_ids.gather(1, pos.flatten(1)).view(pos.shape)
    return labels, valid, prev


def dspark_loss(model: DSparkDraftModel, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                prev: torch.Tensor, settings, confidence_weight: float,
                teacher_states: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective over block positions with the Markov bias, plus the confidence head's binary
    cross-entropy.

    Args:
        hidden: ``[B, A, S, D]`` from :meth:`DSparkDraftModel.forward`; labels, valid, prev: ``[B, A, S]``
            (:func:`block_targets`).
        settings: ``dspark``'s :class:`~draftheads.training.objectives.Objective` (``position_decay`` set).
        confidence_weight: the BCE's weight (0: the confidence head, if any, does not train).
        teacher_states: ``[B, A, S, D]`` the target's last hidden states that predict each position's token
            (:func:`~draftheads.drafters.dflash.model.block_states` at S + 1); needed by a distillation objective
            and by the confidence head (its target is ``alpha``).
    Returns ``(loss, metrics)``: ``loss`` = the objective's weighted mean + ``confidence_weight`` x the BCE's (the
    same position weights); metrics :func:`~draftheads.training.held_out.chain_estimates` (``acc_pos{k}``,
    ``alpha_pos{k}``, ``tau_estimate``), ``overlap`` (mean alpha) with a teacher, and with a trained confidence
    head ``confidence_bce``, ``confidence_abs_error`` and ``confidence_bias`` (mean ``sigmoid - alpha``).
    Raises ``ValueError`` when no target is valid, or a trained confidence head has no teacher.
    """
    if not valid.any():
        raise ValueError("a DSpark batch has no valid block target: no response token follows any anchor")
    train_confidence = model.confidence_head is not None and confidence_weight > 0
    if train_confidence and teacher_states is None:
        raise ValueError("the DSpark confidence head trains against the target's acceptance probability: give "
                         "the target's last hidden states")
    head, markov = model.frozen[1], model.markov_head
    h, y = hidden[valid], labels[valid]
    if markov.kind == "vanilla":  # the latent is the embedding: looked up at the valid positions only
        embed = latent = markov.markov_w1(prev[valid])
    else:  # the gated and recurrent latents read the block (the recurrent one in order): made whole, then selected
        embed_all = markov.markov_w1(prev)
        embed, latent = embed_all[valid], markov.block_latent(embed_all, hidden)[valid]
    teacher = None if teacher_states is None else (teacher_states[valid], head.weight, head.bias)
    out = markov.markov_w2(latent, h, head, y, valid=valid, settings=settings, teacher=teacher)
    loss = out.loss
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = out.top[:, 0] == y
    metrics = chain_estimates(correct, valid)
    if out.alpha is not None:
        metrics["overlap"] = out.alpha.mean()
    if train_confidence:
        ce = torch.zeros(valid.shape, device=hidden.device)
        ce[valid] = out.ce
        weights = normalise(chain_weights(settings, valid, ce))[valid]
        logits = model.confidence_head(h, embed if model.confidence_with_markov else None)
        bce = F.binary_cross_entropy_with_logits(logits, out.alpha, reduction="none")
        loss = loss + confidence_weight * (bce * weights).sum()
        with torch.no_grad():
            error = logits.sigmoid() - out.alpha
            metrics |= {"confidence_bce": bce.mean(), "confidence_abs_error": error.abs().mean(),
                        "confidence_bias": error.mean()}
    return loss, metrics


class DSparkDrafter(DFlashDrafter):
    """A trained :class:`DSparkDraftModel` as the evaluator's chain drafter, drafting as vLLM's
    ``DSparkSpeculator`` does: one backbone pass over ``[last_token, noise x (S-1)]`` at the next S positions
    (the context K/V of verified tokens kept across steps, as :class:`DFlashDrafter` keeps it), the base logits of
    every position at once, then left to right: position k's logits are its base logits plus the Markov bias of
    the token before it (``last_token`` at k = 0, position k-1's argmax after), gamma = S.

    At temperature > 0 with ``eval.proposal=sample`` each position's draft is drawn from its q while the chain of
    Markov biases continues from q's argmax, as EAGLE-3 here: lossless (every draft is drawn from the q it is
    verified against), but not vLLM's ``draft_sample_method=probabilistic``, which continues from the sampled
    token; vLLM's default (greedy drafting, one-hot q) is ``eval.proposal=argmax``, exactly.
    ``acceptance`` holds the confidence head's per-position estimates of the last block (None without a head):
    what vLLM's adaptive verification ranks; this drafter has every draft verified, its adaptive peer
    (:class:`~draftheads.drafters.dspark.adaptive.AdaptiveDSparkDrafter`) fewer. The gated and recurrent Markov
    heads draft the same way, their bias read from each position's hidden state (the recurrent one's state
    carried from position to position).
    """

    def __init__(self, model: DSparkDraftModel):
        super().__init__(model)
        self.name, self.gamma = "dspark", model.block_size
        self.acceptance: torch.Tensor | None = None

    @torch.inference_mode()
    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                     tokens: torch.Tensor | None) -> torch.Tensor:
        ids, positions = self._block(last_token, features)
        model, S = self.model, self.model.block_size
        hidden = model.blocks(ids, positions, self._context, None)[0]
        base = model.logits(hidden)
        markov, prev, state = model.markov_head, ids[0, :1], None
        out, prevs = [], []
        for k in range(S):
            prevs.append(prev)
            latent, state = markov.latent(markov.markov_w1(prev), hidden[k:k + 1], state)
            out.append(base[k] + markov.markov_w2(latent)[0])
            prev = out[-1].argmax(-1, keepdim=True)
        if model.confidence_head is not None:
            self.acceptance = model.confidence_logits(hidden, torch.cat(prevs)).sigmoid()
        return torch.stack(out)
