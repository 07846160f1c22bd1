"""EAGLE-3 draft model (Li, Wei, Zhang, Zhang, "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test", arXiv 2503.01840), laid out as vLLM's ``llama_eagle3.py``
(``Eagle3LlamaForCausalLM``, architecture ``LlamaForCausalLMEagle3``) and SGLang's ``llama_eagle3.py`` load it.

- Features: the outputs of three target decoder layers (low, middle, high; ``target_layer_ids``, id i = output
  of decoder layer i), concatenated ``[.., 3D]`` and fused by ``fc`` (bias-free ``3D -> D``; no norm after it,
  as vLLM's ``combine_hidden_states``). EAGLE-3.1 (arXiv 2605.09992) options, off by default
  (:func:`norm_flags`): ``norm_before_fc``, one RMSNorm ``input_norm`` over the concatenation, then ``fc_norm``,
  one RMSNorm per feature (``fc_norm.{k}``), both before ``fc`` (vLLM 0.32 ``combine_hidden_states``).
- One decoder layer (``midlayer``): attention reads ``[input_layernorm(embed(x)), hidden_norm(h)]``, 2D wide
  (``q/k/v_proj`` take 2D); the residual stream starts at ``h`` itself, or at ``hidden_norm(h)`` with
  ``norm_before_residual`` (speculators' default; vLLM 0.32 ``llama_eagle3.py:101-122``); a SiLU MLP. Then
  ``norm`` and the drafter's own LM head over ``draft_vocab_size`` tokens. The residual sum before ``norm`` is the
  hidden state the next draft step is fed (vLLM's ``hidden_prenorm``); with EAGLE-3.1's ``norm_output``, the sum after
  ``norm`` (vLLM's ``aux_output``), in training-time test and drafting alike (:meth:`Eagle3DraftModel.carry`).
- Row s pairs the fused feature of position s with the embedding of token s+1 and predicts token s+2, at
  RoPE position s (vLLM's EAGLE input: token ids shifted left by one beside the target's hidden states).
- Training-time test (the paper's section 3.2): step j (0-based) of row s is fed row s's hidden state of step
  j-1 and token s+1+j, sits at position s+j and predicts token s+2+j; it attends to step 0's rows t <= s
  (features the target made) and to row s of steps 1..j (what the drafter made itself): exactly what draft
  j+1 sees when decoding from a context that ends at s (:func:`ttt_attention`).
- Draft vocabulary: ``d2t[i]`` = target id of draft token i minus i (vLLM and SGLang add ``arange``), ``t2d`` a
  ``[V]`` bool mask of the target tokens the drafter can propose.
- Token embedding: the target's table, a raw lookup, frozen and never saved (vLLM shares the target's
  ``embed_tokens`` with a drafter whose checkpoint has none; Gemma's ``sqrt(D)`` scale is outside that module).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama import modeling_llama as llama

from draftheads.models.target import full_attention_rope
from draftheads.training.held_out import chain_estimates
from draftheads.training.lm_head_loss import LMHead, drafted_loss


def default_layer_ids(num_target_layers: int) -> list[int]:
    """``[1, L//2 - 1, L - 4]`` (draftheads ids): the layers vLLM and SGLang read when a drafter names none (both
    capture the residual stream entering layers ``(2, L//2, L-3)``: :func:`servers_default`). SmolLM2 (L=30):
    ``[1, 14, 26]``; Llama-3.1-8B (L=32): ``[1, 15, 28]``. A target under 8 layers: ``[0, L//2, L-1]``."""
    L = num_target_layers
    return servers_default(L) if L >= 8 else sorted({0, L // 2, L - 1})


def servers_default(num_target_layers: int) -> list[int]:
    """The layers vLLM (``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``) and SGLang
    (``set_eagle3_layers_to_capture(None)``) read for a drafter whose config names none, as draftheads ids
    (outputs of decoder layers): the inputs of layers ``2, L//2, L-3``."""
    L = num_target_layers
    return [1, L // 2 - 1, L - 4]


def draft_vocabulary(rows: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` target ids the drafter's LM head covers: the most frequent trained tokens of ``rows`` (ties
    and never-trained fill by lowest id), sorted by id as ``d2t`` lists them (``[size]`` int64).
    Raises ``ValueError`` for a size outside 1..vocab_size."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"eagle3.draft_vocab_size={size} must be in 1..{vocab_size} (the target's vocabulary)")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(r["input_ids"][r["loss_mask"]], minlength=vocab_size)
    order = torch.argsort(-counts, stable=True)  # most frequent first, lowest id first among equals
    return order[:size].sort().values


def draft_config(target_config, target_layer_ids: list[int], draft_vocab_size: int, fc_norm: bool = False,
                 norm_before_fc: bool = False, norm_output: bool = False,
                 norm_before_residual: bool = False) -> LlamaConfig:
    """The drafter's config: a one-layer Llama config of the target's width (heads, KV heads, head_dim, MLP,
    RMSNorm eps, the RoPE of its full-attention layers, vocabulary) plus EAGLE-3's fields as the servers read
    them: ``draft_vocab_size``, ``target_hidden_size``, ``num_target_layers`` and ``eagle_config``, and the
    EAGLE-3.1 flags and ``norm_before_residual`` as top-level bools (:func:`norm_flags`).

    The servers read ``eagle_config.eagle_aux_hidden_state_layer_ids`` differently: vLLM's id i is the input of
    decoder layer i (``llama.py``: ``_maybe_add_hidden_state(aux, idx + 1, ..)`` after layer idx), SGLang's the
    output of layer i (``llama.py``: ``layers_to_capture = [val + 1 for val in layer_ids]``, captured entering
    layer val + 1). Layers equal to :func:`servers_default` are therefore left unnamed, which both read alike;
    other layers are written as vLLM's ids (draftheads id + 1), which SGLang reads one layer later."""
    t = target_config.get_text_config(decoder=True)
    config = LlamaConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=1, num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        max_position_embeddings=t.max_position_embeddings, rms_norm_eps=t.rms_norm_eps, hidden_act="silu",
        rope_parameters=full_attention_rope(target_config), attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, initializer_range=getattr(t, "initializer_range", 0.02))
    config.draft_vocab_size = draft_vocab_size
    config.target_hidden_size = t.hidden_size
    config.num_target_layers = t.num_hidden_layers
    config.eagle_config = {"use_aux_hidden_state": True}
    if list(target_layer_ids) != servers_default(t.num_hidden_layers):
        config.eagle_config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in target_layer_ids]
    config.fc_norm, config.norm_before_fc, config.norm_output = bool(fc_norm), bool(norm_before_fc), bool(norm_output)
    config.norm_before_residual = bool(norm_before_residual)
    config.architectures = ["LlamaForCausalLMEagle3"]
    return config


NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")
"""The drafter's norm switches, under the names vLLM 0.32's ``llama_eagle3.py`` reads from a draft config:
EAGLE-3.1's three and ``norm_before_residual``."""


def norm_flags(config) -> dict[str, bool]:
    """The norm flags of a draft config, read as vLLM 0.32's ``llama_eagle3.py`` reads them (absent: off):
    ``norm_before_fc`` from ``eagle_config`` first, else the top level (:184-188); ``fc_norm`` (:231),
    ``norm_output`` (:252) and ``norm_before_residual`` (:101) from the top level. Returns ``{name: bool}`` for
    :data:`NORM_FLAGS`. Raises ``ValueError`` for a flag that is not a JSON bool."""
    eagle = getattr(config, "eagle_config", None) or {}
    flags = {name: getattr(config, name, False) for name in NORM_FLAGS}
    flags["norm_before_fc"] = eagle.get("norm_before_fc", flags["norm_before_fc"])
    bad = {k: v for k, v in flags.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"EAGLE-3 draft config: {bad} must be true or false")
    return flags


def layer_ids_of(config) -> tuple[int, ...]:
    """draftheads layer ids of a draft config: its vLLM ids each - 1, or :func:`servers_default` when it names
    none (see :func:`draft_config`). Raises ``ValueError`` for ids outside the target's decoder layers (vLLM's
    id 0, the embeddings, is not a layer output)."""
    served = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    if not served:
        return tuple(servers_default(config.num_target_layers))
    ids = tuple(i - 1 for i in served)
    if not ids or not all(0 <= i < config.num_target_layers for i in ids):
        raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids {list(served)} must be non-empty vLLM ids "
                         f"in 1..{config.num_target_layers} (the outputs of decoder layers 0..L-1)")
    return ids


class Eagle3Layer(nn.Module):
    """``midlayer``: one decoder layer whose attention reads the token embedding beside the hidden state.
    Parameters under vLLM's checkpoint names: ``input_layernorm``, ``hidden_norm``, ``self_attn.{q,k,v,o}_proj``,
    ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``. With ``norm_before_residual``
    (:func:`norm_flags`) the residual stream starts at ``hidden_norm(h)`` instead of ``h`` (vLLM 0.32
    ``llama_eagle3.py:101-122``)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm_before_residual = norm_flags(config)["norm_before_residual"]
        D, hd = config.hidden_size, config.head_dim
        H, Hkv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.scaling = hd, hd ** -0.5
        self.input_layernorm = llama.LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.hidden_norm = llama.LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(2 * D, H * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * D, Hkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * D, Hkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(H * hd, D, bias=False)
        self.post_attention_layernorm = llama.LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.mlp = llama.LlamaMLP(config)

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``[B, T, D]`` token embeddings and hidden states -> q ``[B, H, T, hd]``, k and v ``[B, H_kv, T, hd]``
        (q and k rotated)."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        B, T = x.shape[:2]
        a = self.self_attn
        q, k, v = (p(x).view(B, T, -1, self.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = llama.apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention (``[B, H, T, hd]`` attended values) and the MLP: ``[B, T, D]``,
        before ``norm``."""
        residual = self.hidden_norm(hidden) if self.norm_before_residual else hidden
        r = residual + self.self_attn.o_proj(attended.transpose(1, 2).flatten(2))
        return r + self.mlp(self.post_attention_layernorm(r))


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], key_valid: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Attention of training-time-test step j = ``len(keys) - 1``.

    Args:
        q: ``[B, H, T, hd]`` step j's queries; keys, values: steps 0..j, each ``[B, H_kv, T, hd]``.
        key_valid: ``[B, T]`` bool, step 0's rows that are not padding.
    Returns ``[B, H, T, hd]``: row s attends to step 0's rows t <= s (valid) and to row s of steps 1..j, one
    softmax over all of them (the EAGLE-3 reference's ``cache_hidden``: the diagonal of each later step).
    """
    groups = q.shape[1] // keys[0].shape[1]
    k0, v0 = (x.repeat_interleave(groups, dim=1) for x in (keys[0], values[0]))
    T = q.shape[2]
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None] & key_valid[:, None, None, :]
    scores = [(q @ k0.transpose(-1, -2)).float().mul(scale).masked_fill(~allowed, float("-inf"))]
    scores += [(q * k.repeat_interleave(groups, dim=1)).sum(-1, keepdim=True).float().mul(scale) for k in keys[1:]]
    p = torch.cat(scores, dim=-1).softmax(-1).to(q.dtype)
    out = p[..., :T] @ v0
    for i, v in enumerate(values[1:]):
        out = out + p[..., T + i:T + i + 1] * v.repeat_interleave(groups, dim=1)
    return out


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 drafter: ``fc``, ``midlayer`` (:class:`Eagle3Layer`), ``norm``, ``lm_head`` ``[V_draft, D]``
    and the buffers ``d2t`` ``[V_draft]`` int64 and ``t2d`` ``[V]`` bool; the target's embedding table is held,
    frozen and unregistered. With EAGLE-3.1's flags (:func:`norm_flags`): ``input_norm`` ``[K * D_target]``
    (``norm_before_fc``) and ``fc_norm.{k}`` ``[D_target]`` (``fc_norm``), vLLM's module names; absent when off.

    Args:
        config: from :func:`draft_config`.
        embed_weight: the target's ``[V, D]`` input embedding table.
    Raises ``ValueError`` for layer ids outside the target (:func:`layer_ids_of`) or bad flags
    (:func:`norm_flags`).
    """

    def __init__(self, config: LlamaConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.config = config
        self.target_layer_ids = layer_ids_of(config)
        flags = norm_flags(config)
        self.norm_output = flags["norm_output"]
        D, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        K, Dt = len(self.target_layer_ids), config.target_hidden_size
        # built only when on (norms draw no random numbers): without the flags, EAGLE-3's drafter unchanged
        self.input_norm = llama.LlamaRMSNorm(K * Dt, eps=config.rms_norm_eps) if flags["norm_before_fc"] else None
        self.fc_norm = (nn.ModuleList(llama.LlamaRMSNorm(Dt, eps=config.rms_norm_eps) for _ in range(K))
                        if flags["fc_norm"] else None)
        self.fc = nn.Linear(K * Dt, D, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = llama.LlamaRMSNorm(D, eps=config.rms_norm_eps)
        self.lm_head = LMHead(D, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool) if Vd == V else torch.zeros(V, dtype=torch.bool))
        self.rotary_emb = llama.LlamaRotaryEmbedding(config=config)
        self.frozen = (embed_weight,)  # a tuple hides it from registration: not trained, not saved
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=config.initializer_range)

    @classmethod
    def for_target(cls, target: PreTrainedModel, target_layer_ids: list[int], vocabulary: torch.Tensor,
                   **flags: bool) -> "Eagle3DraftModel":
        """A fresh drafter for ``target`` (float32, on its device) over the draft ``vocabulary`` (``[V_draft]``
        sorted target ids, :func:`draft_vocabulary`): linear weights ~ N(0, initializer_range), norms at one,
        ``lm_head`` rows copied from the target's LM head rows of those tokens (the drafter starts where the
        target's head is). ``flags``: :data:`NORM_FLAGS` (off unless given; :func:`draft_config`)."""
        config = draft_config(target.config, target_layer_ids, len(vocabulary), **flags)
        model = cls(config, target.get_input_embeddings().weight)
        model.set_vocabulary(vocabulary)
        with torch.no_grad():
            model.lm_head.weight.copy_(target.get_output_embeddings().weight[vocabulary.to(target.device)].float())
        return model.to(next(target.parameters()).device)

    def set_vocabulary(self, vocabulary: torch.Tensor) -> None:
        """``d2t`` and ``t2d`` for ``[V_draft]`` sorted, distinct target ids. Raises ``ValueError`` otherwise."""
        ids = vocabulary.to(self.d2t.device, torch.long)
        if (len(ids) != len(self.d2t) or not bool((ids[1:] > ids[:-1]).all())
                or not 0 <= int(ids[0]) <= int(ids[-1]) < len(self.t2d)):
            raise ValueError(f"a draft vocabulary is {len(self.d2t)} sorted, distinct ids in 0..{len(self.t2d) - 1}")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_ids(self) -> torch.Tensor:
        """``[V_draft]`` target id of each draft token (``arange + d2t``, as vLLM maps them)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids -> the target's embedding rows (raw lookup), in the drafter's dtype."""
        return F.embedding(ids, self.frozen[0]).to(self.fc.weight.dtype)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[.., K*D_target]`` target layer outputs -> ``[.., D]``: ``input_norm`` over the concatenation
        (``norm_before_fc``), then ``fc_norm.{k}`` on feature k (``fc_norm``), then ``fc``, in vLLM 0.32's order
        (``combine_hidden_states``, ``llama_eagle3.py:405-418``). Without the flags, ``fc`` alone."""
        x = features.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(len(self.fc_norm), dim=-1))], dim=-1)
        return self.fc(x)

    def carry(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[.., D]`` a step's hidden state before ``norm`` -> what the next step is fed: itself (vLLM's
        ``hidden_prenorm``), or ``norm(hidden)`` under ``norm_output`` (EAGLE-3.1; vLLM 0.32
        ``llama_eagle3.py:286``: ``aux_output``, the state its proposer feeds the next draft step)."""
        return self.norm(hidden) if self.norm_output else hidden

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[.., D]`` hidden states before ``norm`` -> ``[.., V_draft]`` logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, D]`` -> ``[n, V]`` logits over the target's vocabulary, -inf outside the draft vocabulary (vLLM's
        ``compute_logits``)."""
        logits = self.draft_logits(hidden)
        out = logits.new_full((logits.shape[0], len(self.t2d)), float("-inf"))
        out[:, self.draft_ids()] = logits
        return out

    # --- training: the unrolled steps over whole sequences ---------------------------------------------

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                steps: int) -> torch.Tensor:
        """Training-time test over whole sequences.

        Args:
            features: ``[B, T, K*D]`` target layer outputs; input_ids, attention_mask: ``[B, T]``.
            steps: unrolled steps J.
        Returns ``[B, T, J, D]``: step j's hidden state (before ``norm``) at row s, which predicts token s+2+j;
        step j+1 is fed :meth:`carry` of it, as drafting is.
        """
        B, T = input_ids.shape
        hidden = self.fuse(features)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        keys, values, out = [], [], []
        valid = attention_mask.bool()
        for j in range(steps):
            ids = F.pad(input_ids[:, 1 + j:], (0, 1 + j))  # token s+1+j at row s (0 past the end, never a label)
            cos, sin = self.rotary_emb(hidden, positions + j)
            q, k, v = self.midlayer.qkv(self.embed(ids), hidden, cos, sin)
            keys.append(k)
            values.append(v)
            out.append(self.midlayer.finish(hidden, ttt_attention(q, keys, values, valid, self.midlayer.scaling)))
            hidden = self.carry(out[-1])
        return torch.stack(out, dim=2)

    # --- decoding: rows appended to a KV cache -----------------------------------------------------------

    def extend(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
               past: tuple[torch.Tensor, torch.Tensor] | None
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """n new rows of one sequence (``[n]`` next-token ids, ``[n, D]`` hidden states, ``[n]`` positions), each
        attending to the cached rows ``past`` (``(k, v)`` ``[1, H_kv, P, hd]``) and to the new rows up to itself.
        Returns ``[n, D]`` hidden states before ``norm`` and the cache with the new rows (a draft step is fed
        :meth:`carry` of the previous one's)."""
        h = hidden[None].to(self.fc.weight.dtype)
        cos, sin = self.rotary_emb(h, positions[None])
        q, k, v = self.midlayer.qkv(self.embed(ids[None]), h, cos, sin)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        n, P = len(ids), k.shape[2] - len(ids)
        mask = torch.arange(P + n, device=k.device)[None] <= P + torch.arange(n, device=k.device)[:, None]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.midlayer.scaling,
                                                  enable_gqa=True)
        return self.midlayer.finish(h, attended)[0], (k, v)


def eagle3_loss(model: Eagle3DraftModel, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                settings, teacher: tuple | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective at every unrolled step against the target's own next tokens (self-distilled rows).

    Args:
        hidden: ``[B, T, J, D]`` from :meth:`Eagle3DraftModel.forward`; input_ids, loss_mask: ``[B, T]``.
        settings: ``eagle3``'s :class:`~draftheads.training.objectives.Objective`: step j (1-based) is chain
            position j; the loss is the weighted mean over targets the draft vocabulary holds (a token outside it
            cannot be proposed: it counts as a miss in the metrics).
        teacher: ``(last [B, T, D], lm_head)``, the target's last hidden states and LM head, for a distillation
            objective (its distribution over the draft vocabulary, renormalised); None for ``ce``.
    Returns ``(loss, metrics)``: :func:`~draftheads.training.held_out.chain_estimates` over steps (``acc_pos{k}``
    for step k, ``alpha_pos{k}``, ``tau_estimate``), ``vocab_coverage`` (targets the draft vocabulary holds) and,
    under a distillation objective, ``overlap`` (mean ``sum_v min(p_v, q_v)``).
    Raises ``ValueError`` when no step has a target in the draft vocabulary.
    """
    B, T, J, _ = hidden.shape
    pos = torch.arange(T, device=hidden.device)[:, None] + 2 + torch.arange(J, device=hidden.device)  # [T, J]
    labels = input_ids[:, pos.clamp(max=T - 1)]  # [B, T, J]: token s+2+j
    valid = (pos < T) & loss_mask[:, pos.clamp(max=T - 1)]
    index = torch.full((len(model.t2d),), -1, dtype=torch.long, device=hidden.device)
    index[model.draft_ids()] = torch.arange(len(model.d2t), device=hidden.device)
    draft_labels = index[labels]
    held = valid & (draft_labels >= 0)
    if not held.any():
        raise ValueError("an EAGLE-3 batch has no target in the draft vocabulary: no trainable token 2+ positions "
                         "after another, or eagle3.draft_vocab_size too small")
    if teacher is not None:
        last, head = teacher  # the target predicts token s+2+j from its state at s+1+j
        rows = head.weight[model.draft_ids()]
        teacher = (last[:, (pos - 1).clamp(max=T - 1)][held], rows,
                   None if head.bias is None else head.bias[model.draft_ids()])
    # chunked through the drafter's own head (inside its forward): no [targets, V_draft] logits
    out = drafted_loss(model.lm_head, model.norm(hidden[held]), draft_labels[held], held, settings, teacher)
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[held] = out.top[:, 0] == draft_labels[held]
        metrics = chain_estimates(correct, valid)
        metrics["vocab_coverage"] = held.sum() / valid.sum()
        if out.alpha is not None:
            metrics["overlap"] = out.alpha.mean()
    return out.loss, metrics


class Eagle3Drafter:
    """A trained :class:`Eagle3DraftModel` as the evaluator's chain drafter: gamma drafts from its argmax, each
    step fed the previous step's hidden state (vLLM's EAGLE proposer; after ``norm`` under ``norm_output``:
    :meth:`Eagle3DraftModel.carry`, as in training).

    Each call appends the newly committed rows (their target features beside the next tokens) to the drafter's
    KV cache, which keeps only rows the target made; the draft rows of a call are dropped at the next one.
    Proposal logits are over the target's vocabulary, -inf outside the draft vocabulary. At temperature > 0 with
    ``eval.proposal=sample`` each position's draft is drawn from its q while the chain continues from q's
    argmax (as vLLM drafts): still lossless, since every draft is drawn from the q it is verified against.
    """

    def __init__(self, model: Eagle3DraftModel, gamma: int):
        if gamma < 1:
            raise ValueError(f"eagle3.gamma={gamma} must be >= 1")
        self.model, self.gamma, self.name = model.eval(), gamma, "eagle3"
        self.target_layer_ids = model.target_layer_ids
        self.start()

    def start(self) -> None:
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self._length = 0

    @torch.inference_mode()
    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                     tokens: torch.Tensor | None) -> torch.Tensor:
        if features is None or tokens is None or len(features) != len(tokens) or not len(tokens):
            raise ValueError("EAGLE-3 drafts from the committed tokens' target features and ids (one row each)")
        model, device = self.model, self.model.fc.weight.device
        following = torch.cat([tokens[1:].to(device), torch.tensor([last_token], device=device)])
        positions = torch.arange(self._length, self._length + len(following), device=device)
        hidden, self._cache = model.extend(following, model.fuse(features.to(device)), positions, self._cache)
        self._length += len(following)
        hidden, cache, out = hidden[-1:], self._cache, []
        for i in range(self.gamma):
            out.append(model.target_logits(hidden)[0])
            if i + 1 < self.gamma:
                token = out[-1].argmax(-1, keepdim=True)
                at = torch.tensor([self._length + i], device=device)
                hidden, cache = model.extend(token, model.carry(hidden), at, cache)  # fed as in training
        return torch.stack(out)
