"""Prompts written by the target itself (``data.source=self_made``): the target's chat template up to the start of
a user turn, and the target samples the user's message (Magpie, Xu et al. 2024, arXiv 2406.08464, applied to the
target being drafted for), steered by a system prompt per topic that this module ships. The prompts are then
answered by regeneration like any other source's, so a drafter trains on what its target writes on both sides.

- **Made once, cached, any size**: candidates are sampled in batches of ``batch_size``, batch ``i`` from seed
  ``(seed, i)``, topics taking turns; each batch is appended to ``<cache>/self_made/<key>.jsonl`` (the key hashes
  the target, its chat template and these settings, not the count), so a larger request reuses the smaller one's
  prompts and adds batches, and a killed run resumes after its last whole batch.
- **Filtered, then deduplicated** in that order (deterministic for a seed): empty, too short, cut by the token
  budget (``unfinished``), holding chat-template tokens, repetitive (few distinct word 3-grams), then exact
  duplicates (case and spacing folded) and near duplicates (MinHash LSH over word 3-grams, ``datasketch``). What
  each filter dropped and a diversity figure (distinct word bigrams over all bigrams) go into the data report.
- The steering system prompt generates the prompt and is not part of the row (the rows hold the user's message
  only), unless ``keep_system``.

Reproducible from its seed on one machine (sampling follows the target's logits, which another CPU's kernels may
round otherwise). A target without a chat template is refused by name before any generation.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from draftheads.data.generation import GenerationSettings, generate_ids
from draftheads.data.templates import apply_system_policy, check_template, render, stop_token_ids
from draftheads.models.partial import refuse_partial

TOPICS: dict[str, str] = {
    "chat": "You are a friendly assistant. The user chats with you about their day, their plans, their hobbies, "
            "food, travel, films or music.",
    "math": "You are a math tutor. The user asks you to solve a math word problem, step by step.",
    "code": "You are a programming assistant. The user asks you to write, explain or fix a short piece of Python "
            "code.",
    "writing": "You are a writing assistant. The user asks you to write a short story, a poem, an email or a "
               "product description.",
    "questions": "You are a knowledgeable assistant. The user asks you a factual question about science, history, "
                 "geography or how something works.",
    "summaries": "You are an assistant that summarises texts. The user pastes a paragraph and asks for a short "
                 "summary of it.",
}
"""Steering system prompts by topic: each says what the user asks, so the target writes a user turn of that kind."""

REASONS = ("empty", "too_short", "unfinished", "template_tokens", "repetitive", "duplicate", "near_duplicate")
"""Why a candidate is dropped, in the order the filters run."""


@dataclass
class SelfMade:
    """How the target writes its own prompts (``data.self_made``, an eval set's ``self_made``)."""
    topics: list[str] = field(default_factory=lambda: list(TOPICS))
    """Shipped topics (:data:`TOPICS`) taking turns batch by batch; an unknown one is refused."""
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    """The prompts of one seed; another seed (the held-out general eval set's) draws others."""
    max_prompt_tokens: int = 96
    """A prompt the target has not ended by then is dropped (``unfinished``)."""
    min_words: int = 4
    batch_size: int = 32
    """Prompts sampled per ``generate`` call: one cached unit (a batch is sampled whole or not at all)."""
    near_duplicate: float = 0.7
    """Jaccard similarity of word 3-gram sets (MinHash estimate) at which a prompt near-duplicates a kept one."""
    max_batches: int | None = None
    """Stop after this many batches even if fewer prompts than asked survived (null: 4 x what a request needs)."""
    keep_system: bool = False
    """Keep the steering system prompt as the row's system turn (default: the user's message alone)."""
    follow_ups: float = 0.0
    """Share of the prompts (0..1) whose conversation goes on: the target answers the prompt, writes the user's
    next turn after its answer, and regeneration answers that too (:mod:`draftheads.data.follow_ups`; training
    data only, with ``data.regenerate``)."""

    def __post_init__(self):
        unknown = [t for t in self.topics if t not in TOPICS]
        if unknown or not self.topics:
            raise ValueError(f"self_made.topics={self.topics}: topics are {sorted(TOPICS)}")
        if not 0 <= self.follow_ups <= 1:
            raise ValueError(f"self_made.follow_ups={self.follow_ups}: a share of the prompts, in [0, 1]")
        if not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError(f"self_made: temperature {self.temperature} must be > 0 (prompts are sampled) and top_p "
                             f"{self.top_p} in (0, 1]")


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def shingles(text: str, n: int = 3) -> set[str]:
    """Word ``n``-grams of ``text`` (the text's words themselves when it has fewer than ``n``)."""
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(max(len(w) - n + 1, 1))} if w else set()


def repetitive(text: str) -> bool:
    """Whether at most half of the text's word 3-grams are distinct (a loop: "and then and then and then")."""
    w = words(text)
    grams = [" ".join(w[i:i + 3]) for i in range(len(w) - 2)]
    return len(grams) >= 6 and len(set(grams)) <= len(grams) / 2


def minhash(text: str, num_perm: int = 128):
    from datasketch import MinHash
    m = MinHash(num_perm=num_perm, seed=1)
    m.update_batch([s.encode() for s in shingles(text)])
    return m


class NearDuplicates:
    """Texts seen so far, answering whether a new one near-duplicates any (MinHash LSH at ``threshold``)."""

    def __init__(self, threshold: float):
        from datasketch import MinHashLSH
        self.lsh, self.threshold, self.n = MinHashLSH(threshold=threshold, num_perm=128), threshold, 0

    def seen(self, text: str) -> bool:
        return bool(self.lsh.query(minhash(text)))

    def add(self, text: str) -> None:
        self.lsh.insert(str(self.n), minhash(text))
        self.n += 1


class Keeper:
    """The filters and deduplication of :func:`keep`, fed candidates as they are sampled (the near-duplicate index
    grows with them): ``kept`` in order, ``drops`` by reason (:data:`REASONS`)."""

    def __init__(self, settings: SelfMade, specials: tuple[str, ...]):
        self.settings, self.specials = settings, specials
        self.exact, self.near = set(), NearDuplicates(settings.near_duplicate)
        self.kept: list[dict] = []
        self.drops: Counter = Counter()

    def offer(self, c: dict) -> None:
        """Keep candidate ``c`` (``{"text", "topic", "finished"}``) or count why not."""
        text = c["text"].strip()
        key = " ".join(words(text))
        reason = ("empty" if not text else "too_short" if len(words(text)) < self.settings.min_words
                  else "unfinished" if not c["finished"]
                  else "template_tokens" if any(t in text for t in self.specials)
                  else "repetitive" if repetitive(text) else "duplicate" if key in self.exact
                  else "near_duplicate" if self.near.seen(text) else None)
        if reason:
            self.drops[reason] += 1
            return
        self.exact.add(key)
        self.near.add(text)
        self.kept.append({**c, "text": text})


def keep(candidates: list[dict], settings: SelfMade, specials: tuple[str, ...],
         counts: Counter | None = None) -> list[dict]:
    """The candidates (``{"text", "topic", "finished"}``, in order) that pass the filters and are no duplicate of
    an earlier kept one (:data:`REASONS`); ``counts`` gets the drops by reason."""
    keeper = Keeper(settings, specials)
    for c in candidates:
        keeper.offer(c)
    if counts is not None:
        counts.update(keeper.drops)
    return keeper.kept


def distinct_bigrams(texts: list[str]) -> float:
    """Distinct word bigrams over all word bigrams of ``texts`` (distinct-2, Li et al. 2016): 1.0 when no pair of
    words repeats anywhere, near 0 for texts that say the same thing."""
    grams = [(w[i], w[i + 1]) for t in texts for w in [words(t)] for i in range(len(w) - 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def pre_query(tokenizer, system: str | None, history: list[dict] = ()) -> str:
    """The chat template rendered up to where the next user message begins (Magpie's pre-query template): the
    ``system`` prompt, the conversation so far (``history``: user and assistant turns, no system turn) and a user
    turn holding a marker, cut at the marker. Raises ``ValueError`` (naming the fix) for a tokenizer without a chat
    template."""
    check_template(tokenizer)
    marker = "\x00SELF_MADE_USER_TURN\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": m["role"], "content": m["content"]} for m in history] + [{"role": "user", "content": marker}]
    text = render(tokenizer, apply_system_policy(tokenizer, messages, "auto"))
    return text[:text.index(marker)]


class Sampler(Protocol):
    """Another engine than the target in process that samples the prompts (``data.generation.engine=vllm``:
    :class:`~draftheads.data.regenerate.VLLMBackend`): its ``name`` keys the cache (another engine samples other
    prompts from the same seed)."""
    name: str

    def generate(self, prompts: list[list[int]], settings: GenerationSettings,
                 seeds: list[int] | None = None) -> list[tuple[list[int], bool]]: ...


def template_tokens(tokenizer) -> tuple[str, ...]:
    """The texts a prompt may not hold (the ``template_tokens`` filter): the tokenizer's special tokens and the turn
    markers of the ChatML and Gemma templates."""
    return tuple(s for s in tokenizer.all_special_tokens if s) + ("<|im_start|>", "<start_of_turn>")


def cache_file(settings: SelfMade, model_id: dict, chat_template: str | None, cache_dir: str | Path,
               engine: str | None = None) -> Path:
    """Where the candidates of ``settings`` for this target live: keyed by the target, its template, every
    setting that changes a candidate (not the filters, which run on read, nor the count) and the ``engine``'s
    name when one samples them (None: the target in process, through transformers)."""
    made = {k: v for k, v in asdict(settings).items() if k in ("topics", "temperature", "top_p", "seed",
                                                                   "max_prompt_tokens", "batch_size", "keep_system")}
    key = hashlib.sha256(json.dumps([model_id, chat_template, made] + ([engine] if engine else []),
                                    sort_keys=True).encode()).hexdigest()[:16]
    return Path(cache_dir).expanduser() / "self_made" / f"{key}.jsonl"


def batch_seed(settings: SelfMade, index: int) -> int:
    """The seed of batch ``index`` of ``settings.seed`` (32 bits)."""
    return int(hashlib.sha256(f"{settings.seed}|{index}".encode()).hexdigest()[:8], 16)


def sample_batch(model, tokenizer, settings: SelfMade, index: int, engine: Sampler | None = None) -> list[dict]:
    """Batch ``index``: ``batch_size`` user messages sampled by the target after the pre-query template of topic
    ``topics[index % len(topics)]``, from :func:`batch_seed` (the global RNG left as it was), by ``model`` in
    process or by ``engine`` (each prompt from that seed plus its place in the batch):
    ``{"text", "topic", "finished", "system"}`` each."""
    topic = settings.topics[index % len(settings.topics)]
    made = sample_user_turns(model, tokenizer, settings, [pre_query(tokenizer, TOPICS[topic])] * settings.batch_size,
                             batch_seed(settings, index), engine)
    return [{**m, "topic": topic, "system": TOPICS[topic]} for m in made]


def sample_user_turns(model, tokenizer, settings: SelfMade, prefixes: list[str], seed: int,
                      engine: Sampler | None = None) -> list[dict]:
    """One user message sampled by the target after each pre-query text of ``prefixes`` (:func:`pre_query`) at
    ``settings``' temperature, top-p and token budget, from ``seed`` (the global RNG left as it was), by ``model``
    in process or by ``engine`` (prompt ``j`` from ``seed + j``): ``{"text", "finished"}`` each, ``finished``
    when the target ended the turn within ``max_prompt_tokens``."""
    refuse_partial(model, "writing self-made prompts", "make them once with the whole target (a run of the job, or "
                                                       "train/regenerate.py), then train partially")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prefixes]
    sampling = GenerationSettings(max_new_tokens=settings.max_prompt_tokens, temperature=settings.temperature,
                                  top_p=settings.top_p)
    stop = stop_token_ids(tokenizer, model.generation_config)
    if engine is not None:
        made = engine.generate(ids, sampling, [seed + j for j in range(len(ids))])
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            made = generate_ids(model, tokenizer, ids, sampling, stop)
    return [{"text": tokenizer.decode(out[:-1] if out and out[-1] in stop else out), "finished": finished}
            for out, finished in made]


def self_made_prompts(settings: SelfMade, count: int, model, tokenizer, model_id: dict, cache_dir: str | Path,
                      counts: Counter | None = None, show_progress: bool = True,
                      engine: Sampler | None = None) -> list[dict]:
    """The first ``count`` prompts of ``settings`` that pass :func:`keep`, sampling (and caching) batches until
    that many survive or ``max_batches`` (default: 4 x ``count`` / ``batch_size`` batches) were sampled: fewer
    than ``count`` then. ``counts`` gets ``made`` (candidates sampled), ``kept`` (passed the filters, used or
    not) and the drops by reason (:data:`REASONS`): made = kept + drops. Each prompt is ``{"prompt"}`` (and
    ``"system"`` with ``keep_system``), ``"topic"`` and ``"row"``, its index among the kept. A target of another
    device is fine: the model generates where it lies; ``engine`` samples instead of it (:func:`sample_batch`)."""
    check_template(tokenizer)  # a target without a template: refused before any generation
    path = cache_file(settings, model_id, tokenizer.chat_template, cache_dir, engine and engine.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    batches = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    specials = template_tokens(tokenizer)
    limit = settings.max_batches or max(4 * -(-count // settings.batch_size), 1)
    keeper = Keeper(settings, specials)
    for c in (c for b in batches for c in b):
        keeper.offer(c)
    while len(keeper.kept) < count and len(batches) < limit:
        batch = sample_batch(model, tokenizer, settings, len(batches), engine)
        with open(path, "a") as f:  # a whole batch per line: a killed run resumes after its last one
            f.write(json.dumps(batch) + "\n")
        batches.append(batch)
        for c in batch:
            keeper.offer(c)
        if show_progress:
            print(f"self-made prompts: {len(keeper.kept)}/{count} kept after {len(batches)} batches", flush=True)
    kept, drops = keeper.kept, keeper.drops
    if counts is not None:
        counts.update(drops)
        counts["made"] += sum(map(len, batches))
        counts["kept"] += len(kept)
    return [{"prompt": c["text"], "topic": c["topic"], "row": i, **({"system": c["system"]}
                                                                      if settings.keep_system else {})}
            for i, c in enumerate(kept[:count])]
