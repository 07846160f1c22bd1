"""Draft-then-verify decoding with the target's KV cache, and the plain greedy baseline it must equal.

Greedy chain verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", arXiv 2211.17192, the greedy special case; Medusa's chain mode): the draft model proposes
gamma tokens from the target's last hidden state; one target forward over ``[x0, d1..d_gamma]`` scores
them all; the longest prefix where ``d_i`` equals the target's argmax is accepted, plus the target's own
next token (the bonus token). Output is what the target alone would produce, by construction.

Batch size 1, as in the papers' latency numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel


class ChainDrafter(Protocol):
    """What the evaluator needs from a draft model: gamma proposals from one hidden state."""
    gamma: int
    """Draft length: tokens proposed per step."""

    def propose(self, hidden_state: torch.Tensor) -> torch.Tensor:
        """``[D]`` target hidden state (after the final norm) at the last accepted position ->
        ``[gamma]`` int64 proposed next tokens, following that position's bonus token."""


class MedusaDrafter:
    """Medusa heads as a chain drafter: head k's top-1 token (Medusa paper, section 2.1.2, chain case)."""

    def __init__(self, heads, lm_head):
        self.heads, self.lm_head = heads, lm_head
        self.gamma = heads.num_heads

    @torch.inference_mode()
    def propose(self, hidden_state: torch.Tensor) -> torch.Tensor:
        return self.heads(hidden_state, lm_head=self.lm_head).argmax(-1)


@dataclass
class DecodeResult:
    """One prompt's decoding: new tokens (bonus and EOS included), counters and timings (seconds)."""
    tokens: list[int]
    target_forwards: int = 0
    seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list)
    """Per verification step: draft tokens accepted (0..gamma); tokens emitted = accepted + 1."""
    emitted_per_step: list[int] = field(default_factory=list)
    """Per verification step: tokens emitted (accepted + bonus, cut at EOS or the token budget)."""
    top2_gaps: list[float] = field(default_factory=list)
    """Greedy only: target logit gap between its top-2 tokens at each step (ties show as tiny gaps)."""


def _forward(target: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """``[n]`` new token ids through the target with its cache -> ``[n, D]`` last hidden states."""
    return target.base_model(input_ids=ids[None], cache=cache, use_cache=True).last_hidden_state[0]


def _cut(tokens: list[int], budget: int, eos_id: int | None) -> tuple[list[int], bool]:
    """Tokens up to the budget and the first EOS (kept); and whether decoding should stop."""
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[:tokens.index(eos_id) + 1]
        return tokens[:budget], True
    return tokens[:budget], len(tokens) >= budget


@torch.inference_mode()
def greedy_decode(target: PreTrainedModel, prompt_ids: torch.Tensor, max_new_tokens: int,
                  eos_id: int | None) -> DecodeResult:
    """Plain autoregressive greedy decoding, one target forward per token (the baseline).

    Args:
        prompt_ids: ``[P]`` int64 on the target's device.
    """
    lm_head = target.get_output_embeddings()
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    hidden = _forward(target, prompt_ids, cache)[-1]
    result = DecodeResult(tokens=[], target_forwards=1)
    while True:
        logits = lm_head(hidden)
        top2 = logits.topk(2)
        token = int(top2.indices[0])
        result.top2_gaps.append(float(top2.values[0] - top2.values[1]))
        result.tokens, stop = _cut(result.tokens + [token], max_new_tokens, eos_id)
        if stop:
            break
        hidden = _forward(target, prompt_ids.new_tensor([token]), cache)[-1]
        result.target_forwards += 1
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def speculative_decode(target: PreTrainedModel, drafter: ChainDrafter, prompt_ids: torch.Tensor,
                       max_new_tokens: int, eos_id: int | None) -> DecodeResult:
    """Greedy draft-then-verify decoding with the KV cache keeping only accepted tokens.

    Args:
        prompt_ids: ``[P]`` int64 on the target's device.
    Returns:
        a :class:`DecodeResult` whose ``tokens`` equal :func:`greedy_decode`'s up to floating-point ties.
    """
    lm_head = target.get_output_embeddings()
    start = time.perf_counter()
    cache = DynamicCache(config=target.config)
    hidden = _forward(target, prompt_ids, cache)[-1]
    x0 = int(lm_head(hidden).argmax())
    result = DecodeResult(tokens=[], target_forwards=1)
    result.tokens, stop = _cut([x0], max_new_tokens, eos_id)
    while not stop:
        t = time.perf_counter()
        draft = drafter.propose(hidden)
        t_verify = time.perf_counter()
        result.draft_seconds += t_verify - t
        states = _forward(target, torch.cat([prompt_ids.new_tensor([x0]), draft]), cache)  # [1 + gamma, D]
        predicted = lm_head(states).argmax(-1)  # predicted[i]: the target's token after candidate i
        result.target_forwards += 1
        matches = (draft == predicted[:-1]).int()
        n = int(matches.cumprod(0).sum())
        cache.crop(-(len(draft) - n))  # x0 and the accepted drafts stay; rejected drafts leave the cache
        result.verify_seconds += time.perf_counter() - t_verify
        emitted = draft[:n].tolist() + [int(predicted[n])]
        before = len(result.tokens)
        result.tokens, stop = _cut(result.tokens + emitted, max_new_tokens, eos_id)
        result.accepted_per_step.append(n)
        result.emitted_per_step.append(len(result.tokens) - before)
        hidden, x0 = states[n], emitted[-1]
    result.seconds = time.perf_counter() - start
    return result
