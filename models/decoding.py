"""The decoding contract every path follows: regeneration, plain decoding, chain and tree verification, DFlash,
prompt lookup and the vLLM parity check.

- **One stop set.** Decoding stops at the first token of the target's stop set: the tokenizer's eos, every id of
  ``generation_config.eos_token_id`` and the chat template's end-of-turn token (Gemma's ``<end_of_turn>`` and
  Phi-3's ``<|end|>`` are not ``eos_token``; Llama 3 lists ``<|eot_id|>`` beside ``<|end_of_text|>``). The stop
  token is emitted once; nothing after it is.
- **Explicit settings.** Every path decodes with the settings it is given, never with the decoding defaults a
  target ships in ``generation_config.json`` (a ``repetition_penalty``, a temperature): transformers' ``generate``
  would apply them to regeneration and prompt lookup but not to our own decoders, so they are switched off
  there (:func:`explicit_generation`) and reported (:func:`generation_defaults`). On request
  (``model.generation_defaults=apply``) the target's sampling defaults become the settings of every path
  (:func:`target_sampling`); a default no path can apply is refused, never applied to some paths only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

from transformers import GenerationConfig, PreTrainedModel

from draftheads.choice import Choice

DECODING_FIELDS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff",
                   "eta_cutoff", "repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                   "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
                   "min_new_tokens", "min_length")
"""``generation_config`` fields that change which token is chosen."""
SAMPLING_FIELDS = ("do_sample", "temperature", "top_k", "top_p")
"""The ones every path applies alike: regeneration (in process and through a server), plain, chain and tree
decoding, DFlash, EAGLE-3 and prompt lookup (:class:`~draftheads.models.speculative.Sampling`)."""


class GenerationDefaults(Choice):
    """What becomes of the decoding defaults a target ships in ``generation_config.json``
    (``model.generation_defaults``)."""
    ignore = "ignore"
    """Every path decodes with the configured settings (``data.generation``, ``eval.temperatures``, ``eval.top_k``,
    ``eval.top_p``); the defaults are printed and reported."""
    apply = "apply"
    """The target's sampling defaults (do_sample, temperature, top_k, top_p) replace the configured sampling in
    regeneration and in every evaluated method; a default outside them (a ``repetition_penalty``, ``min_p``...)
    is refused before any work."""


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


def generation_defaults(config: GenerationConfig | None) -> dict:
    """The decoding defaults of a target's ``generation_config`` that differ from transformers' own
    (``{"repetition_penalty": 1.1}``): what :func:`explicit_generation` keeps out of every path; recorded in
    reports."""
    if config is None:
        return {}
    plain = GenerationConfig()
    return {k: getattr(config, k) for k in DECODING_FIELDS
            if getattr(config, k, None) is not None and getattr(config, k, None) != getattr(plain, k, None)}


def target_sampling(config: GenerationConfig | None) -> tuple[float, int, float]:
    """``(temperature, top_k, top_p)`` a target's ``generation_config`` asks for: greedy ``(0.0, 0, 1.0)`` unless
    ``do_sample`` is true, else its temperature (1 when unset), top_k (0: off) and top_p (1: off). A field the
    config does not set is off, as vLLM reads the config (``--generation-config auto``,
    ``ModelConfig.get_diff_sampling_param``); transformers' ``generate`` would add its global ``top_k=50``.
    Raises ``ValueError`` naming every default outside :data:`SAMPLING_FIELDS` (no path here applies a
    ``repetition_penalty`` to speculative verification, so applying it to some paths would compare two
    different decoders)."""
    defaults = generation_defaults(config)
    refused = {k: v for k, v in defaults.items() if k not in SAMPLING_FIELDS}
    if refused:
        raise ValueError(f"model.generation_defaults=apply: the target's generation_config sets {refused}, which "
                         f"speculative decoding here cannot apply in every path (only {list(SAMPLING_FIELDS)} "
                         f"are); use model.generation_defaults=ignore and set the sampling in data.generation and "
                         f"eval.temperatures/top_k/top_p")
    temperature = float(defaults.get("temperature", 1.0))
    if not defaults.get("do_sample") or temperature == 0:
        return 0.0, 0, 1.0
    return temperature, int(defaults.get("top_k") or 0), float(defaults.get("top_p", 1.0))


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
