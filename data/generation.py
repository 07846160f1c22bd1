"""How the target generates (:class:`GenerationSettings`, the ``data.generation`` config) and one batched
``generate`` call in process (:func:`generate_ids`), shared by regeneration (:mod:`draftheads.data.regenerate`)
and self-made prompts (:mod:`draftheads.data.self_made`)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from draftheads.models.decoding import cut_at_stop, explicit_generation

from draftheads.choice import Choice


class Engine(Choice):
    """What generates the target's answers in process (``data.generation.engine``)."""
    transformers = "transformers"
    vllm = "vllm"


@dataclass
class GenerationSettings:
    """How the target answers (the ``data.generation`` config)."""
    max_new_tokens: int = 128
    """Budget per answer in tokens; an answer cut there is kept and marked unfinished."""
    temperature: float = 0.0
    """0 = greedy, the distribution the greedy evaluator measures; > 0 samples."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    batch_size: int = 32
    """Conversations answered together (one generate() call per turn, or concurrent requests per chunk); a
    chunk is also the unit a killed run resumes from."""
    seed: int = 0
    engine: Engine = Engine.transformers
    """Who generates in process: transformers (the target as loaded) or vllm (vLLM's offline engine in its own
    environment, ``vllm.venv``: :class:`VLLMBackend`). Part of the answers' cache key through the backend's name."""



@torch.inference_mode()
def generate_ids(model, tokenizer, batch: list[list[int]], settings: GenerationSettings,
                 stop: Collection[int]) -> list[tuple[list[int], bool]]:
    """Generated ids per prompt, through the first token of ``stop`` (included when ``finished``), one
    left-padded ``generate`` with the target's own decoding defaults kept out."""
    width = max(map(len, batch))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=model.device)
    sampling = settings.temperature > 0
    with explicit_generation(model):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens,
                             do_sample=sampling, temperature=settings.temperature if sampling else None,
                             top_p=settings.top_p if sampling else None,
                             top_k=(settings.top_k or None) if sampling else None, pad_token_id=pad,
                             eos_token_id=sorted(stop) or None)
    results = []
    for row in out[:, width:].tolist():
        tokens, _ = cut_at_stop(row, settings.max_new_tokens, stop)
        results.append((tokens, bool(tokens) and tokens[-1] in stop))
    return results
