"""The decoding contract every path follows: regeneration, plain decoding, chain and tree verification, DFlash,
prompt lookup and the vLLM parity check.

- **One stop set.** Decoding stops at the first token of the target's stop set: the tokenizer's eos, every id of
  ``generation_config.eos_token_id`` and the chat template's end-of-turn token (Gemma's ``<end_of_turn>`` and
  Phi-3's ``<|end|>`` are not ``eos_token``; Llama 3 lists ``<|eot_id|>`` beside ``<|end_of_text|>``). The stop
  token is emitted once; nothing after it is.
- **Explicit settings.** Every path decodes with the settings it is given, never with the decoding defaults a
  target ships in ``generation_config.json`` (a ``repetition_penalty``, a temperature): transformers' ``generate``
  would apply them to regeneration and prompt lookup but not to our own decoders, so they are switched off
  there (:func:`explicit_generation`) and reported (:func:`generation_defaults`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

from transformers import GenerationConfig, PreTrainedModel

DECODING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                   "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                   "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                   "min_new_tokens", "min_length")
"""``generation_config`` fields that change which token is chosen."""


def cut_at_stop(tokens: list[int], budget: int, stop: Collection[int]) -> tuple[list[int], bool]:
    """Tokens up to the budget and the first stop token (kept); and whether decoding should stop."""
    first = next((i for i, t in enumerate(tokens) if t in stop), None)
    if first is not None:
        return tokens[:min(first + 1, budget)], True
    return tokens[:budget], len(tokens) >= budget


def eos_ids(value) -> set[int]:
    """``generation_config.eos_token_id`` (None, an int or a list) as a set."""
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


def generation_defaults(model: PreTrainedModel) -> dict:
    """The decoding defaults of the target's ``generation_config`` that differ from transformers' own
    (``{"repetition_penalty": 1.1}``): what :func:`explicit_generation` keeps out of every path; recorded in
    reports and cache keys."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    plain = GenerationConfig()
    return {k: getattr(config, k) for k in DECODING_FIELDS
            if getattr(config, k, None) is not None and getattr(config, k, None) != getattr(plain, k, None)}


@contextmanager
def explicit_generation(model: PreTrainedModel) -> Iterator[None]:
    """Inside the context ``model.generate`` sees transformers' plain defaults, so only the arguments it is
    called with decide the output (transformers fills every argument left at its global default from the
    model's ``generation_config``, even in an explicit ``GenerationConfig``)."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved
