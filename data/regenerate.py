"""Self-distillation data: the target answers the prompts itself, so the draft model learns the target's
own distribution (Medusa paper, section 2.3.2). Results are cached on disk, keyed by everything that
changes them, and a killed run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from data.sources import Prompt


@dataclass
class GenerationSettings:
    """How the target answers (the ``data.generation`` config)."""
    max_new_tokens: int = 128
    """Response budget in tokens; a response cut there is kept and marked unfinished."""
    temperature: float = 0.0
    """0 = greedy, the distribution the greedy evaluator measures; > 0 samples."""
    top_p: float = 1.0
    batch_size: int = 32
    """Prompts per generate() call; prompts are sorted by length so padding stays small."""
    seed: int = 0


@dataclass
class Response:
    """A prompt and the target's answer: ``prompt_ids`` (chat template with generation prompt) and
    ``response_ids`` (generated tokens, end-of-turn included when ``finished``)."""
    source: str
    row: int
    prompt: str
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of a single-turn chat ending with the assistant generation prompt.

    Raises ``ValueError`` when the tokenizer has no chat template (suggesting the fix).
    """
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: use an instruct/chat model, "
                         "or set tokenizer.chat_template before building data")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def cache_key(model_id: dict, prompts: list[Prompt], settings: GenerationSettings) -> str:
    """Hash of the target's identity, the prompts and the generation settings."""
    h = hashlib.sha256(json.dumps([model_id, asdict(settings)], sort_keys=True).encode())
    for p in prompts:
        h.update(f"{p.source}\0{p.row}\0{p.text}\0".encode())
    return h.hexdigest()[:20]


@torch.inference_mode()
def _generate(model, tokenizer, batch: list[list[int]], settings: GenerationSettings) -> list[tuple[list[int], bool]]:
    width = max(map(len, batch))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch], device=model.device)
    sampling = settings.temperature > 0
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=settings.max_new_tokens,
                         do_sample=sampling, temperature=settings.temperature if sampling else None,
                         top_p=settings.top_p if sampling else None, top_k=None, pad_token_id=pad)
    eos = tokenizer.eos_token_id
    results = []
    for row in out[:, width:].tolist():
        finished = eos in row
        results.append((row[:row.index(eos) + 1] if finished else row, finished))
    return results


def regenerate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[Prompt],
               settings: GenerationSettings, cache_file: str | Path, show_progress: bool = True) -> list[Response]:
    """Answer every prompt with the target, batched, reusing and extending ``cache_file`` (JSONL).

    Lines are appended per batch to ``<cache_file>.partial``, so a killed run resumes from its last batch;
    the file is renamed to ``cache_file`` when complete. Returns responses in the order of ``prompts``.
    """
    cache_file = Path(cache_file)
    if cache_file.exists():
        return _read(cache_file)
    partial = cache_file.with_name(cache_file.name + ".partial")
    done = {(r.source, r.row): r for r in _read(partial)} if partial.exists() else {}
    if partial.exists():  # drop a line cut by a kill, else the next line appended to it is unreadable too
        _write(partial, list(done.values()))
    todo = [p for p in prompts if (p.source, p.row) not in done]
    encoded = sorted(((p, prompt_ids(tokenizer, p.text)) for p in todo), key=lambda x: len(x[1]))
    torch.manual_seed(settings.seed)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="regenerating responses (target)",
               unit="prompt", disable=not show_progress)
    with open(partial, "a") as f:
        for i in range(0, len(encoded), settings.batch_size):
            chunk = encoded[i:i + settings.batch_size]
            for (p, ids), (resp, finished) in zip(chunk, _generate(model, tokenizer, [c[1] for c in chunk], settings)):
                r = Response(p.source, p.row, p.text, ids, resp, finished)
                done[(p.source, p.row)] = r
                f.write(json.dumps(asdict(r)) + "\n")
            f.flush()
            bar.update(len(chunk))
    bar.close()
    ordered = [done[(p.source, p.row)] for p in prompts]
    _write(cache_file, ordered)
    partial.unlink(missing_ok=True)
    return ordered


def _write(path: Path, responses: list[Response]) -> None:
    """Replace ``path`` atomically with one JSON line per response."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in responses))
    tmp.replace(path)


def _read(path: Path) -> list[Response]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(Response(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break  # a line cut by a kill: regenerate from here
    return out
