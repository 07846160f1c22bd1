"""Draft-then-verify decoding with the target's KV cache, and the plain decoding it must equal.

Chain verification (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv 2302.01318): the draft model proposes gamma tokens from
the target's last hidden state; one target forward over ``[x0, d1..d_gamma]`` scores them all.
- Greedy (temperature 0): the longest prefix where ``d_i`` is the target's argmax is accepted, plus the
  target's own next token (the bonus token). Output equals plain greedy decoding, up to floating-point ties.
- Sampling (temperature > 0): draft ``d_i`` with proposal ``q_i`` is accepted with probability
  ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the token is drawn from ``normalize(max(0, p_i - q_i))``;
  when every draft is accepted the bonus token is drawn from ``p_{gamma+1}``. p and q get the same temperature /
  top-k / top-p processing before the ratio. Output is distributed exactly as plain sampling from the target
  (lossless) for any proposal, and two are offered (:class:`Proposal`):
  - ``argmax`` (default, as servers propose): ``d_i`` is q's argmax and q is one-hot, so ``d_i`` is accepted with
    probability ``p_i(d_i)`` and a rejection draws from p without ``d_i``: vLLM's Medusa, EAGLE and DFlash
    proposers with its rejection sampler (no draft probabilities), and SGLang's target-only verification.
  - ``sample``: ``d_i ~ q_i`` (Leviathan et al.; z-lab's reference ``dflash`` package).

Batch size 1, as in the papers' latency numbers.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from draftheads.choice import Choice
from draftheads.models.decoding import cut_at_stop, explicit_generation
from draftheads.models.target import record_layer_outputs


class Proposal(Choice):
    """How a chain drafter's proposal becomes draft tokens at temperature > 0 (``eval.proposal``); at
    temperature 0 drafts are always q's argmax."""
    argmax = "argmax"
    sample = "sample"


@dataclass(frozen=True)
class Sampling:
    """Token selection shared by the target and the draft model: ``temperature`` 0 is greedy. Raises
    ``ValueError`` for a negative temperature or top_k, or top_p outside (0, 1] (NaN probabilities)."""
    temperature: float = 0.0
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1: all)."""
    proposal: Proposal = Proposal.argmax
    """How a chain drafter's proposal becomes draft tokens at temperature > 0 (both lossless)."""

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got temperature "
                             f"{self.temperature}, top_k {self.top_k}, top_p {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., V]`` logits -> float32 probabilities after temperature, top-k and top-p (in that order,
        as transformers' ``generate`` applies them)."""
        logits = logits.float() / self.temperature
        if self.top_k > 0:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop_sorted = cumulative - sorted_logits.softmax(-1) >= self.top_p  # keeps the token crossing top_p
            logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return logits.softmax(-1)


class ChainDrafter(Protocol):
    """What the evaluator needs from a draft model: logits for gamma future positions."""
    name: str
    """Method name in reports (``medusa_chain``, ``dflash``...)."""
    gamma: int
    """Draft length: tokens proposed per step."""
    target_layer_ids: tuple[int, ...]
    """Target decoder layers whose outputs the drafter reads for every committed token (empty: none)."""

    def start(self) -> None:
        """Forget the previous sequence (a new prompt begins)."""

    def draft_logits(self, hidden_state: torch.Tensor, last_token: int, features: torch.Tensor | None,
                     tokens: torch.Tensor | None) -> torch.Tensor:
        """Proposal logits ``[gamma, V]`` for the gamma tokens after ``last_token``.

        Args:
            hidden_state: ``[D]`` target hidden state (after the final norm) at the position before
                ``last_token``, i.e. the state from which the target predicted ``last_token``.
            last_token: the newest token (bonus token of the last step), not yet in the target's KV cache.
            features: ``[m, K*D]`` outputs of ``target_layer_ids`` (concatenated in that order) for the m tokens
                committed to the target's cache since the previous call (the prompt, then each step's verified
                tokens); None when ``target_layer_ids`` is empty.
            tokens: ``[m]`` int64 ids of those m committed tokens (row i of ``features`` is token i's; the
                feature of the last one predicted ``last_token``); None where the caller drafts from the last
                hidden state alone (tree verification).
        """

    # Optional: a drafter whose proposal at each position depends on the token drafted before it (DFlash 2's
    # selector walk) draws its own tokens instead of returning logits for the evaluator to draw from:
    # ``draft_tokens(hidden_state, last_token, features, tokens, sampling, generator) -> (draft [g], q [g, V] or
    # None)``, as :func:`propose` returns them, each draft drawn from the q it is verified against.


@dataclass
class DecodeResult:
    """One prompt's decoding: new tokens (bonus and EOS included), counters and timings (seconds)."""
    tokens: list[int]
    target_forwards: int = 0
    seconds: float = 0.0
    """Wall time of the whole decoding, the prefill included."""
    prefill_seconds: float | None = None
    """Wall time of the prompt's forward (None: the method does not separate it, as transformers' generate)."""
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    gamma: int = 0
    """Draft positions verified per step (0: the method reports no steps)."""
    accepted_per_step: list[int] = field(default_factory=list)
    """Per verification step: draft tokens accepted (0..gamma), counted by the verification itself, before the
    token budget or a stop token cuts what is emitted (as vLLM's rejection sampler and EAGLE count)."""
    verified_per_step: list[int] = field(default_factory=list)
    """Per verification step: draft positions the target verified (gamma with fixed-length verification, fewer
    where the method chooses how many to verify: DSpark's adaptive verification)."""
    emitted_per_step: list[int] = field(default_factory=list)
    """Per verification step: tokens emitted (accepted + bonus, cut at EOS or the token budget)."""
    context_per_step: list[int] = field(default_factory=list)
    """Per verification step: the context length it drafts and verifies at, in tokens: the prompt plus every
    token generated before the step (the newest one, not yet in the target's cache, included)."""
    top2_gaps: list[float] = field(default_factory=list)
    """Plain decoding only: target logit gap between its top-2 tokens at each step (ties show as tiny gaps)."""
    logit_steps: list[float] = field(default_factory=list)
    """Plain decoding only: the logits' resolution at each step, ``finfo(dtype).eps * |top-1 logit|`` (at least
    one step of the dtype there: 0.125 for a bf16 logit of 20): a smaller gap is a rounding tie."""
    reference: list[int] | None = None
    """A greedy method verified by another target than the evaluated one (a peer run's stage-2 target): that
    target's own plain greedy tokens, which it must equal (None: the evaluated target's plain decoding)."""


def new_cache() -> DynamicCache:
    """An empty KV cache whose every layer keeps every token, sliding-window layers included (Mistral, Phi-3,
    Gemma 2/3, gpt-oss). Verification rolls the cache back (a chain's rejected drafts, a tree's other
    branches), which transformers' sliding-window cache layers refuse once the window is reached; with full
    layers the model's own mask applies the window (``sliding_window_overlay``), so the logits are those of
    the windowed model at any length."""
    return DynamicCache()


def with_cache(target: PreTrainedModel, cache: DynamicCache) -> dict:
    """The keyword that passes ``cache`` to ``target``'s base model: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (an unknown keyword is silently ignored: decoding would run without the cache)."""
    forward = inspect.signature(type(target.base_model).forward).parameters
    return {"cache" if "cache" in forward else "past_key_values": cache}


def target_step(target: PreTrainedModel, ids: torch.Tensor, cache: DynamicCache,
             layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n]`` new token ids through the target with its cache -> ``[n, D]`` last hidden states, and
    ``[n, K*D]`` outputs of decoder layers ``layer_ids`` (None when empty)."""
    with record_layer_outputs(target, layer_ids) as outputs:
        hidden = target.base_model(input_ids=ids[None], use_cache=True,
                                   **with_cache(target, cache)).last_hidden_state[0]
    features = torch.cat([outputs[i][0] for i in layer_ids], dim=-1) if layer_ids else None
    return hidden, features


def _select(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """One token from ``[V]`` target logits: argmax, or a draw from the processed distribution."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(sampling.probs(logits), 1, generator=generator))


def propose(q_logits: torch.Tensor, sampling: Sampling,
            generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens ``[g]`` from proposal logits ``[g, V]``, and the proposal probabilities ``[g, V]`` they are
    verified against (None when greedy): by ``sampling.proposal``, q's argmax with q one-hot (``argmax``), or a
    draw from the processed q (``sample``)."""
    if sampling.greedy or sampling.proposal == Proposal.argmax:
        draft = q_logits.argmax(-1)
        return draft, None if sampling.greedy else torch.nn.functional.one_hot(draft, q_logits.shape[-1]).float()
    q = sampling.probs(q_logits)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q


def accept_chain(draft: torch.Tensor, q: torch.Tensor | None, target_logits: torch.Tensor, sampling: Sampling,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """Verify one chain: ``(n accepted drafts, next token)``.

    Args:
        draft: ``[g]`` proposed tokens; q: ``[g, V]`` the probabilities they were proposed with (:func:`propose`;
            unused when greedy). target_logits: ``[g + 1, V]``; row i is the target's logits for the token after
            candidate i.
    The next token is the bonus token (all accepted) or the corrected token at the first rejection.
    """
    if sampling.greedy:
        predicted = target_logits.argmax(-1)
        n = int((draft == predicted[:-1]).int().cumprod(0).sum())
        return n, int(predicted[n])
    p = sampling.probs(target_logits)
    u = torch.rand(len(draft), generator=generator)
    for i, x in enumerate(draft.tolist()):
        if u[i] * q[i, x] < p[i, x]:  # u < min(1, p/q) without dividing by a tiny q
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(draft), int(torch.multinomial(p[-1], 1, generator=generator))


@torch.inference_mode()
def plain_decode(target: PreTrainedModel, prompt_ids: torch.Tensor, max_new_tokens: int, stop: Collection[int],
                 sampling: Sampling = Sampling(), generator: torch.Generator | None = None) -> DecodeResult:
    """Plain autoregressive decoding, one target forward per token (the baseline).

    Args:
        prompt_ids: ``[P]`` int64 on the target's device.
        stop: the target's stop set (:func:`~draftheads.data.templates.stop_token_ids`); decoding ends at the
            first of them, which is emitted.
        generator: CPU random generator for sampling (seeded by the caller for reproducible runs).
    """
    lm_head = target.get_output_embeddings()
    start = time.perf_counter()
    cache = new_cache()
    hidden = target_step(target, prompt_ids, cache)[0][-1]
    result = DecodeResult(tokens=[], target_forwards=1, prefill_seconds=time.perf_counter() - start)
    while True:
        logits = lm_head(hidden).cpu()
        top2 = logits.topk(2).values
        result.top2_gaps.append(float(top2[0] - top2[1]))
        result.logit_steps.append(torch.finfo(logits.dtype).eps * abs(float(top2[0])))
        result.tokens, done = cut_at_stop(result.tokens + [_select(logits, sampling, generator)], max_new_tokens, stop)
        if done:
            break
        hidden = target_step(target, prompt_ids.new_tensor(result.tokens[-1:]), cache)[0][-1]
        result.target_forwards += 1
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def speculative_decode(target: PreTrainedModel, drafter: ChainDrafter, prompt_ids: torch.Tensor,
                       max_new_tokens: int, stop: Collection[int], sampling: Sampling = Sampling(),
                       generator: torch.Generator | None = None,
                       verify: Callable[[int], int] | None = None) -> DecodeResult:
    """Chain draft-then-verify decoding; the KV cache keeps only accepted tokens.

    Args:
        prompt_ids: ``[P]`` int64 on the target's device.
        stop: the target's stop set, as for :func:`plain_decode`.
        generator: CPU random generator for draft sampling and acceptance (seeded by the caller).
        verify: given a step's g drafts, how many of them (a prefix, 0..g) the target verifies (default all:
            fixed-length verification); called after drafting, before the target sees the drafts. Lossless when
            the count depends on nothing the verification draws (the drafter's own state: DSpark's confidence
            head, :mod:`draftheads.drafters.dspark.adaptive`); a count outside 0..g raises ``ValueError``.
    Returns:
        a :class:`DecodeResult`; greedy ``tokens`` equal :func:`plain_decode`'s up to floating-point ties,
        sampled ``tokens`` follow the same distribution.
    """
    lm_head = target.get_output_embeddings()
    layer_ids = tuple(drafter.target_layer_ids)
    start = time.perf_counter()
    drafter.start()
    cache = new_cache()
    states, features = target_step(target, prompt_ids, cache, layer_ids)
    hidden, committed = states[-1], prompt_ids
    x0 = _select(lm_head(hidden).cpu(), sampling, generator)
    result = DecodeResult(tokens=[], target_forwards=1, gamma=drafter.gamma,
                          prefill_seconds=time.perf_counter() - start)
    result.tokens, done = cut_at_stop([x0], max_new_tokens, stop)
    while not done:
        t = time.perf_counter()
        if hasattr(drafter, "draft_tokens"):
            draft, q = drafter.draft_tokens(hidden, x0, features, committed, sampling, generator)
        else:
            draft, q = propose(drafter.draft_logits(hidden, x0, features, committed).float().cpu(), sampling,
                               generator)
        if verify is not None:
            b = verify(len(draft))
            if not 0 <= b <= len(draft):
                raise ValueError(f"verify chose {b} of {len(draft)} drafts to verify (0..{len(draft)})")
            draft, q = draft[:b], None if q is None else q[:b]
        t_verify = time.perf_counter()
        result.draft_seconds += t_verify - t
        ids = torch.cat([prompt_ids.new_tensor([x0]), draft.to(prompt_ids.device)])
        states, features = target_step(target, ids, cache, layer_ids)
        n, next_token = accept_chain(draft, q, lm_head(states).cpu(), sampling, generator)
        result.target_forwards += 1
        if n < len(draft):  # x0 and the accepted drafts stay; rejected drafts leave the cache
            cache.crop(-(len(draft) - n))  # (never crop(0): some 5.x releases read it as "keep 0 tokens")
        features = features[:n + 1] if features is not None else None  # the drafter's new context
        committed = ids[:n + 1]
        result.verify_seconds += time.perf_counter() - t_verify
        emitted = draft[:n].tolist() + [next_token]
        before = len(result.tokens)
        result.tokens, done = cut_at_stop(result.tokens + emitted, max_new_tokens, stop)
        result.accepted_per_step.append(n)
        result.verified_per_step.append(len(draft))
        result.emitted_per_step.append(len(result.tokens) - before)
        result.context_per_step.append(len(prompt_ids) + before)
        hidden, x0 = states[n], next_token
    result.seconds = time.perf_counter() - start
    return result


@torch.inference_mode()
def prompt_lookup_decode(target: PreTrainedModel, prompt_ids: torch.Tensor, max_new_tokens: int,
                         stop: Collection[int], num_tokens: int = 10, sampling: Sampling = Sampling(),
                         generator: torch.Generator | None = None) -> DecodeResult:
    """Prompt-lookup decoding (Saxena 2023) exactly as users run it: transformers' ``generate`` with
    ``prompt_lookup_num_tokens``. A model-free peer: drafts are n-gram continuations copied from the context.

    With sampling, generate verifies by drawing each position from the processed target distribution and
    keeping drafts while they equal the draws (q one-hot), which is lossless. generate draws from torch's
    global RNG, so it is seeded from ``generator`` for reproducible runs.
    Target forwards are counted with a forward hook (generate does not expose per-step acceptance). The
    target's own ``generation_config`` decoding defaults are kept out
    (:func:`~draftheads.models.decoding.explicit_generation`).
    """
    forwards = []
    knobs = {"do_sample": False}
    if not sampling.greedy:
        knobs = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k or None,
                 "top_p": sampling.top_p}
        torch.manual_seed(int(torch.randint(2 ** 31, (1,), generator=generator)))
    hook = target.register_forward_hook(lambda *_: forwards.append(1))
    start = time.perf_counter()
    try:
        with explicit_generation(target):
            out = target.generate(prompt_ids[None], attention_mask=torch.ones_like(prompt_ids[None]),
                                  max_new_tokens=max_new_tokens, prompt_lookup_num_tokens=num_tokens,
                                  eos_token_id=sorted(stop) or None, pad_token_id=min(stop, default=0), **knobs)
    finally:
        hook.remove()
    tokens, _ = cut_at_stop(out[0, len(prompt_ids):].tolist(), max_new_tokens, stop)
    return DecodeResult(tokens=tokens, target_forwards=len(forwards), seconds=time.perf_counter() - start)
