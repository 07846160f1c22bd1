"""DFlash block-diffusion draft model (Chen, Liang, Liu, "DFlash: Block Diffusion for Flash Speculative
Decoding", arXiv 2602.06036), laid out as vLLM's ``qwen3_dflash.py``, SGLang's ``models/dflash.py`` and the
authors' ``z-lab/dflash`` load it.

- Target features: the outputs of K target decoder layers (``target_layer_ids``), concatenated
  ``[.., K*D]``, projected by ``fc`` (bias-free ``K*D -> D``) and normalised by ``hidden_norm``.
- Draft layers: N Qwen3 decoder layers (per-head ``q_norm``/``k_norm``, SiLU MLP) of the target's width,
  whatever the target's family: what vLLM (``qwen3_dflash.py``, ``DFlashQwen3DecoderLayer``), SGLang and z-lab
  build for a ``DFlashDraftModel``, so an export loads there for any target. The fused features of every context
  token become extra keys/values of every layer through that layer's own ``k_proj``/``v_proj`` (then
  ``k_norm`` and RoPE at their absolute positions); no ``input_layernorm`` on them. Queries come from the
  block only.
- Block of S = block_size tokens at positions ``a..a+S-1`` (B stays the batch size): position 0 holds the last
  verified token (the anchor a), 1..S-1 the mask token. Attention inside a block is bidirectional; a block sees
  context strictly before its anchor. Output: ``norm`` then the target's LM head; positions 1..S-1 propose tokens
  ``a+1..a+S-1``.
- Token embedding and LM head are the target's, frozen and never saved. The embedding is the raw table
  lookup: vLLM shares the target's ``embed_tokens`` module with the drafter, and a family that scales its
  embeddings (Gemma: ``sqrt(D)``) does so outside that module (vLLM ``gemma3.py``: ``embed_input_ids``), so the
  drafter never sees the scale.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from draftheads.models.target import full_attention_rope
from draftheads.training.held_out import chain_estimates
from draftheads.training.lm_head_loss import drafted_loss


def _flex_attention(*args, **kwargs):
    """flex_attention, compiled on GPUs (eager elsewhere: a reference implementation, slow but exact)."""
    global _COMPILED_FLEX
    if not args[0].is_cuda:
        return flex_attention(*args, **kwargs)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX(*args, **kwargs)


_COMPILED_FLEX = None


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """The paper's choice (and z-lab's ``build_target_layer_ids``): ``num_features`` layer ids spaced evenly
    from layer 1 to layer L-3; one feature takes the middle layer. SmolLM2 (L=30): ``[1, 8, 14, 20, 27]``.
    A target too shallow for that gets up to ``num_features`` distinct ids spread over all its layers."""
    if num_features < 1:
        raise ValueError(f"dflash.num_target_features={num_features} must be >= 1")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start < num_features - 1:  # a shallow (test) target: as many distinct layers as it has, 0..L-1
        start, end = 0, num_target_layers - 1
        num_features = min(num_features, num_target_layers)
    return [int(round(start + i * (end - start) / (num_features - 1))) for i in range(num_features)]


def choose_mask_token(tokenizer: PreTrainedTokenizerBase, vocab_size: int, configured: int | None = None) -> int:
    """The id DFlash puts at block positions 1..S-1 (S = block size).

    In order: ``configured``; the tokenizer's mask token; an added token whose text contains "mask", "reserved"
    or "unused" (lowest id); else the highest-id added special token that is not BOS/EOS/PAD/UNK and does not
    occur in the chat template (SmolLM2: ``<empty_output>``, 16). It must index the target's embedding, so no
    token is added (that would resize the target).
    Raises ``ValueError`` when none qualifies or the id is outside ``0..vocab_size-1``.
    """
    if configured is None:
        configured = tokenizer.mask_token_id
    if configured is None:
        added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if i < vocab_size}
        named = [i for i, s in added.items() if any(w in s.lower() for w in ("mask", "reserved", "unused"))]
        used = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
        template = str(tokenizer.chat_template or "")
        spare = [i for i, s in added.items() if i not in used and s not in template]
        configured = min(named) if named else max(spare) if spare else None
    if configured is None:
        raise ValueError("the tokenizer has no mask, reserved or spare special token for DFlash's mask; set "
                         "dflash.mask_token_id to an id the target never generates")
    if not 0 <= configured < vocab_size:
        raise ValueError(f"dflash.mask_token_id={configured} is outside the target's vocabulary 0..{vocab_size - 1}")
    return int(configured)


def draft_config(target_config, num_layers: int, block_size: int, target_layer_ids: list[int],
                 mask_token_id: int) -> Qwen3Config:
    """The draft model's config: a Qwen3 config of the target's width (hidden, heads, KV heads, head_dim, MLP,
    RMSNorm eps, the RoPE of its full-attention layers, vocabulary), ``num_layers`` deep, plus DFlash's
    fields."""
    t = target_config.get_text_config(decoder=True)
    config = Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps,
        rope_parameters=full_attention_rope(target_config), attention_bias=False, tie_word_embeddings=False,
        initializer_range=getattr(t, "initializer_range", 0.02))
    config.num_target_layers = t.num_hidden_layers
    config.block_size = block_size
    config.dflash_config = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    config.architectures = ["DFlashDraftModel"]
    return config


class DFlashDraftModel(nn.Module):
    """The DFlash drafter: ``fc``, ``hidden_norm``, ``layers.{i}`` (Qwen3 decoder layers), ``norm``; the
    target's embedding table and LM head are held, frozen and unregistered.

    Args:
        config: from :func:`draft_config` (``block_size``, ``dflash_config``, decoder sizes).
        embed_weight: the target's ``[V, D]`` input embedding table (the drafter looks tokens up in it).
        lm_head: the target's LM head, ``[.., D] -> [.., V]``.
    Raises ``ValueError`` when the feature layer ids are outside the target's layers.
    """

    def __init__(self, config, embed_weight: torch.Tensor, lm_head: nn.Module):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.block_size = config.block_size
        self.target_layer_ids = tuple(config.dflash_config["target_layer_ids"])
        self.mask_token_id = config.dflash_config["mask_token_id"]
        bad = [i for i in self.target_layer_ids if not 0 <= i < config.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ValueError(f"dflash target_layer_ids {list(self.target_layer_ids)} must be non-empty ids in "
                             f"0..{config.num_target_layers - 1}")
        if self.block_size < 2:
            raise ValueError(f"dflash.block_size={self.block_size} must be >= 2 (the anchor plus drafts)")
        self.fc = nn.Linear(len(self.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = qwen3.Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(qwen3.Qwen3DecoderLayer(config, layer_idx=i)
                                    for i in range(config.num_hidden_layers))
        self.norm = qwen3.Qwen3RMSNorm(D, eps=config.rms_norm_eps)
        self.rotary_emb = qwen3.Qwen3RotaryEmbedding(config=config)
        self.frozen = (embed_weight, lm_head)  # a tuple hides them from registration: not trained, not saved
        self.attention = "flex" if torch.cuda.is_available() else "sdpa"
        """Training attention: ``flex`` (flex_attention with a block-sparse mask; compiled on GPUs) or ``sdpa``
        (a dense boolean mask; what CPUs run)."""
        self._init_weights(config.initializer_range)

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_layers: int, block_size: int, target_layer_ids: list[int],
                   mask_token_id: int) -> "DFlashDraftModel":
        """A fresh drafter of ``target``'s width (dtype float32, on ``target``'s device): linear weights
        ~ N(0, initializer_range), norms at one (copying the target's final norm measured worse: its weights fit
        the target's last hidden states, and the first losses on SmolLM2 rose from ~30 to ~100)."""
        config = draft_config(target.config, num_layers, block_size, target_layer_ids, mask_token_id)
        model = cls(config, target.get_input_embeddings().weight, target.get_output_embeddings())
        return model.to(next(target.parameters()).device)

    def _init_weights(self, std: float) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    # --- the pieces shared by training and drafting -------------------------------------------------------

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[.., T, K*D]`` target features -> ``[.., T, D]`` context (``hidden_norm(fc(x))``)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _heads(self, attn, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return proj(x).view(*x.shape[:-1], -1, attn.head_dim)

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values for context tokens: ``[B, T, D]`` fused features at ``[B, T]`` absolute
        positions -> per layer ``(k, v)`` each ``[B, H_kv, T, head_dim]`` (k normed and rotated)."""
        cos, sin = self.rotary_emb(fused, positions)
        kv = []
        for layer in self.layers:
            attn = layer.self_attn
            k = self._heads(attn, attn.k_proj, fused)
            k = attn.k_norm(k)
            k = qwen3.apply_rotary_pos_emb(k.transpose(1, 2), k.transpose(1, 2), cos, sin)[0]
            kv.append((k, self._heads(attn, attn.v_proj, fused).transpose(1, 2)))
        return kv

    def blocks(self, block_ids: torch.Tensor, positions: torch.Tensor, context: list[tuple[torch.Tensor, torch.Tensor]],
               mask: torch.Tensor | None) -> torch.Tensor:
        """Run the draft layers over block tokens.

        Args:
            block_ids: ``[B, Q]`` int64 (anchor and mask tokens of one or many blocks).
            positions: ``[B, Q]`` their absolute positions.
            context: :meth:`context_kv` of the context the blocks may see.
            mask: over context then block tokens: ``[B, 1, Q, T + Q]`` bool (True: may attend) or a flex
                ``BlockMask`` (:func:`block_attention_mask`), or None for one block that sees the whole context
                and itself.
        Returns:
            ``[B, Q, D]`` hidden states after the final ``norm`` (the LM head's input).
        """
        x = self.embed(block_ids)
        rope = self.rotary_emb(x, positions)
        for layer, kv in zip(self.layers, context):
            x = self.layer_forward(layer, x, kv, rope, mask)
        return self.norm(x)

    def embed(self, block_ids: torch.Tensor) -> torch.Tensor:
        """``[B, Q]`` ids -> ``[B, Q, D]``: the target's embedding table, looked up raw (module docstring)."""
        return F.embedding(block_ids, self.frozen[0]).to(self.fc.weight.dtype)

    def layer_forward(self, layer: nn.Module, x: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
                      rope: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """One draft decoder layer over the block tokens ``x`` ``[B, Q, D]`` (pre-norm attention, then MLP, each
        added to the residual), its context keys/values and the blocks' RoPE; a drafter that wraps the sublayers
        (DFlash 2) overrides this."""
        x = x + self.attend(layer, layer.input_layernorm(x), context, rope, mask)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def attend(self, layer: nn.Module, h: torch.Tensor, context: tuple[torch.Tensor, torch.Tensor],
               rope: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        """The layer's attention (``o_proj`` included) of the normed block tokens ``h`` ``[B, Q, D]`` over the
        context's keys/values then the blocks' own, under ``mask`` (:meth:`blocks`)."""
        attn, (ctx_k, ctx_v), (cos, sin) = layer.self_attn, context, rope
        q, k, v = (self._heads(attn, p, h) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = qwen3.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        k = torch.cat([ctx_k.to(k.dtype), k], dim=2)
        v = torch.cat([ctx_v.to(k.dtype), v.transpose(1, 2)], dim=2)
        if isinstance(mask, BlockMask):
            out = _flex_attention(q, k, v, block_mask=mask, scale=attn.scaling, enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
        return attn.o_proj(out.transpose(1, 2).flatten(2))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on draft hidden states: ``[.., D] -> [.., V]``."""
        return self.frozen[1](hidden)

    # --- training: every block of a batch in one pass ---------------------------------------------------

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                anchors: torch.Tensor) -> torch.Tensor:
        """Hidden states of many blocks per sequence in one pass (training).

        Args:
            features: ``[B, T, K*D]`` target layer outputs; input_ids, attention_mask: ``[B, T]``.
            anchors: ``[B, A]`` int64 anchor positions, -1 for padding (from :func:`sample_anchors`).
        Returns:
            ``[B, A, block_size, D]``. Block b sees the context at positions < its anchor (not padding) and its
            own block; never another block. A padding block sees only itself (its loss is masked).
        """
        B, T = input_ids.shape
        A, S = anchors.shape[1], self.block_size
        start = anchors.clamp(min=0)  # padding blocks sit at 0 and see no context
        block_ids = torch.full((B, A, S), self.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[..., 0] = input_ids.gather(1, start)
        offsets = torch.arange(S, device=input_ids.device)
        positions = (start[..., None] + offsets).view(B, A * S)
        context = self.context_kv(self.fuse(features), torch.arange(T, device=input_ids.device).expand(B, T))
        mask = block_attention_mask(start, attention_mask.bool(), S, self.attention)
        hidden = self.blocks(block_ids.view(B, A * S), positions, context, mask)
        return hidden.view(B, A, S, -1)


def block_attention_mask(anchors: torch.Tensor, context_valid: torch.Tensor, block_size: int, kind: str = "sdpa"):
    """Who sees what when A blocks per sequence train in one pass.

    Query j of block b (``Q = A * block_size`` queries) may attend to context position t iff
    ``t < anchors[b]`` and ``context_valid[t]``, and to every token of its own block; never to another block.
    A padding block (anchor 0) sees only itself.

    Args:
        anchors: ``[B, A]`` int64 anchor positions (>= 0); context_valid: ``[B, T]`` bool (not padding).
        kind: ``sdpa`` -> dense ``[B, 1, Q, T + Q]`` bool; ``flex`` -> a flex_attention ``BlockMask`` (same
            pattern, block-sparse: memory grows with the blocks, not with ``Q * (T + Q)``).
    """
    B, T = context_valid.shape
    A = anchors.shape[1]
    device = anchors.device
    anchor_of_query = anchors.repeat_interleave(block_size, dim=1)  # [B, Q]
    block_of = torch.arange(A, device=device).repeat_interleave(block_size)  # [Q]
    if kind == "flex":
        def mask_mod(b, h, q, kv):
            in_context = kv < T
            sees_context = (kv < anchor_of_query[b, q]) & context_valid[b, kv.clamp(max=T - 1)]
            same_block = block_of[q] == block_of[(kv - T).clamp(min=0)]
            return (in_context & sees_context) | (~in_context & same_block)
        return create_block_mask(mask_mod, B, None, A * block_size, T + A * block_size, device=device)
    if kind != "sdpa":
        raise ValueError(f"DFlash attention {kind!r} must be sdpa or flex")
    before_anchor = torch.arange(T, device=device)[None, None, :] < anchor_of_query[..., None]
    sees_context = before_anchor & context_valid[:, None, :]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(B, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a block may start at: response tokens whose next token is a response token too.

    Args:
        loss_mask: ``[B, T]`` bool, True on response (trainable) tokens.
    Returns:
        ``[B, T]`` bool (the last position never: it has no next token).
    """
    candidates = loss_mask.clone()
    candidates[:, :-1] &= loss_mask[:, 1:]
    candidates[:, -1] = False
    return candidates


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random anchor positions among :func:`anchor_candidates`.

    Args:
        loss_mask: ``[B, T]`` bool, True on response (trainable) tokens.
        max_anchors: at most this many per sequence (without replacement).
    Returns:
        ``[B, A]`` int64 sorted positions, -1 padding; A = the largest count in the batch (>= 1).
    """
    candidates = anchor_candidates(loss_mask)
    scores = torch.rand(loss_mask.shape, generator=generator).to(loss_mask.device).masked_fill(~candidates, -1.0)
    A = max(1, min(max_anchors, int(candidates.sum(1).max())))
    top, index = scores.topk(A, dim=1)
    anchors = torch.where(top >= 0, index, -1)
    return anchors.sort(dim=1).values  # ascending, padding (-1) first


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of block positions k = 1..S-1 (S = block size): ``token[anchor + k]``, valid where that token
    is a response token.

    Returns ``(labels, valid)``, both ``[B, A, block_size - 1]`` (int64, bool)."""
    T = input_ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, block_size, device=anchors.device)
    inside = (anchors[..., None] >= 0) & (pos < T)
    pos = pos.clamp(0, T - 1)
    flat = pos.flatten(1)
    labels = input_ids.gather(1, flat).view(pos.shape)
    valid = inside & loss_mask.gather(1, flat).view(pos.shape)
    return labels, valid


def paper_decay(block_size: int) -> float:
    """The paper's position decay for its block sizes as ``position_decay`` (sec. 3: position k weighs
    ``exp(-(k-1)/d)``, d = 7, 5, 4 for 16, 10, 8: ``position_decay = exp(-1/d)``). Raises ``ValueError`` for
    another size (set ``dflash.position_decay``)."""
    paper = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size not in paper:
        raise ValueError(f"no paper position decay for block_size={block_size} (known: {sorted(paper)}); "
                         f"set dflash.position_decay")
    return math.exp(-1 / paper[block_size])


def block_states(states: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, A, S-1, D]``: ``states`` ``[B, T, D]`` at ``anchor + k - 1`` for block positions k = 1..S-1 (the
    target's states from which it predicts the token position k drafts)."""
    B, T = states.shape[:2]
    pos = (anchors[..., None] + torch.arange(block_size - 1, device=anchors.device)).clamp(0, T - 1)
    return states[torch.arange(B, device=states.device)[:, None, None], pos]


def dflash_loss(model: DFlashDraftModel, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                settings, teacher_states: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective over block positions 1..S-1, and training-time acceptance estimates.

    Args:
        hidden: ``[B, A, S, D]`` from :meth:`DFlashDraftModel.forward`; labels, valid: ``[B, A, S-1]``.
        settings: ``dflash``'s :class:`~draftheads.training.objectives.Objective` (``position_decay`` set).
        teacher_states: ``[B, A, S-1, D]`` the target's last hidden states that predict each position's token
            (:func:`block_states`), for a distillation objective; None for ``ce``.
    Returns:
        ``(loss, metrics)``; metrics: :func:`~draftheads.training.held_out.chain_estimates` of the blocks
        (``acc_pos{k}``, ``alpha_pos{k}``, ``tau_estimate``), and ``overlap`` (mean ``sum_v min(p_v, q_v)``)
        under a distillation objective.
    The target's LM head runs chunked, its ``[targets, V]`` logits never materialised
    (:func:`~draftheads.training.lm_head_loss.drafted_loss`).
    Raises ``ValueError`` when no target is valid (a batch without response tokens).
    """
    if not valid.any():
        raise ValueError("a DFlash batch has no valid block target: no response token follows any anchor")
    head = model.frozen[1]
    teacher = None if teacher_states is None else (teacher_states[valid], head.weight, head.bias)
    out = drafted_loss(head, hidden[:, :, 1:][valid], labels[valid], valid, settings, teacher)
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = out.top[:, 0] == labels[valid]
    metrics = chain_estimates(correct, valid)
    if out.alpha is not None:
        metrics["overlap"] = out.alpha.mean()
    return out.loss, metrics


class DFlashDrafter:
    """A trained :class:`DFlashDraftModel` as the evaluator's chain drafter.

    Each call adds the newly verified tokens' target features to the drafter's context K/V cache (kept
    across steps; the block's own K/V never enter it) and drafts one block ``[last_token, mask * (S-1)]``
    at the next positions: draft length gamma = S-1.

    ``denoise_steps`` > 1 is iterative denoising (not in the paper): after each pass the most confident masked
    positions (an even share of those left, plus any above ``confidence``) are fixed to their argmax and the
    block is run again; it stops early once every position left reaches ``confidence``. A position's logits
    are those of the pass that fixed it. Greedy verification only: a later pass conditions earlier positions
    on later tokens, so the proposal is not a left-to-right distribution that lossless sampling needs.
    """

    def __init__(self, model: DFlashDraftModel, denoise_steps: int = 1, confidence: float = 0.9):
        if denoise_steps < 1:
            raise ValueError(f"denoise_steps={denoise_steps} must be >= 1")
        self.model, self.denoise_steps, self.confidence = model.eval(), denoise_steps, confidence
        self.name = "dflash" if denoise_steps == 1 else f"dflash_denoise{denoise_steps}"
        self.gamma = model.block_size - 1
        self.target_layer_ids = model.target_layer_ids
        self.start()

    def start(self) -> None:
        self._context: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._length = 0

    def _extend(self, features: torch.Tensor) -> None:
        m = features.shape[0]
        device = self.model.fc.weight.device
        positions = torch.arange(self._length, self._length + m, device=device)[None]
        new = self.model.context_kv(self.model.fuse(features[None].to(device)), positions)
        self._context = new if self._context is None else [
            (torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self._context, new)]
        self._length += m

    def _block(self, last_token: int, features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The newly verified tokens' ``features`` added to the context, then the next block: ids ``[1, S]``
        (``last_token``, then the mask token) and their positions ``[1, S]``. ``RuntimeError`` when no context was
        ever given (the first call must carry the prompt's features)."""
        if features is not None and len(features):
            self._extend(features)
        if self._context is None:
            raise RuntimeError(f"{self.name} drafts from target features: the first call must carry the prompt's")
        model, S = self.model, self.model.block_size
        device = model.fc.weight.device
        ids = torch.full((1, S), model.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = last_token
        return ids, torch.arange(self._length, self._length + S, device=device)[None]

    @torch.inference_mode()
    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                    tokens: torch.Tensor | None) -> torch.Tensor:
        ids, positions = self._block(last_token, features)
        model, S, device = self.model, self.model.block_size, ids.device
        fixed = torch.zeros(S - 1, dtype=torch.bool, device=device)
        out = None
        for step in range(self.denoise_steps):
            logits = model.logits(model.blocks(ids, positions, self._context, None))[0, 1:].float()
            out = logits if out is None else torch.where(fixed[:, None], out, logits)
            if step == self.denoise_steps - 1:
                break
            confidence, tokens = logits.softmax(-1).max(-1)
            open_ = ~fixed
            if bool((confidence[open_] >= self.confidence).all()):
                break
            share = math.ceil(int(open_.sum()) / (self.denoise_steps - step))
            ranked = confidence.masked_fill(fixed, -1.0).argsort(descending=True)[:share]
            newly = torch.zeros_like(fixed)
            newly[ranked] = True
            newly |= open_ & (confidence >= self.confidence)
            fixed |= newly
            ids[0, 1:] = torch.where(newly, tokens, ids[0, 1:])
        return out
