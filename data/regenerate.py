"""Self-distillation data: the target answers every user turn itself, turn by turn, so later turns condition
on its own earlier answers and the draft model learns the target's own distribution (Medusa paper, section
2.3.2; EAGLE and DFlash regenerate the same way). Results are cached as JSONL, keyed by everything that changes
them, and a killed run resumes where it stopped.

Backends: :class:`TransformersBackend` (batched ``generate``, offline, the default) and
:class:`OpenAIBackend` (any OpenAI-compatible server such as ``vllm serve`` or SGLang, concurrent, with
retries) for real scale.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import weakref
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from draftheads.data.conversations import Chat, kept_prefix
from draftheads.data.generation import GenerationSettings, generate_ids
from draftheads.data.templates import apply_system_policy, check_template, stop_token_ids, template_kwargs
from draftheads.models.decoding import cut_at_stop
from draftheads.models.partial import refuse_partial
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from draftheads.choice import Choice

VLLM_ANSWERS = Path(__file__).resolve().with_name("vllm_answers.py")
"""The engine loop :class:`VLLMBackend` runs in vLLM's environment (it imports nothing from draftheads)."""
READY, ANSWERS = "DRAFTHEADS_READY", "DRAFTHEADS_ANSWERS "
"""The lines :data:`VLLM_ANSWERS` prints when its engine is up and with each answer (as it defines them)."""


@dataclass
class Regenerated:
    """A conversation with every assistant turn answered by the target: ``messages`` (roles system?, user,
    assistant...), ``unfinished`` (indices of answers cut by the token budget), or ``error`` when the backend
    failed on it (then ``messages`` holds the input); ``thinking`` is the mode it was rendered and answered in
    (True, False, None: the template's default; ``data.thinking_fraction``)."""
    source: str
    row: int
    messages: list[dict]
    unfinished: list[int] = field(default_factory=list)
    error: str | None = None
    thinking: bool | None = None
    answered: int = 0
    """How many leading answers were given, not made here (``Chat.answered``): they lend to no conversation that
    asks the target for them."""


class Backend(Protocol):
    """Answers a batch of histories (each ends with a user turn), each in its thinking mode (``thinking``: one
    per history, True / False / None for the template's default; None: all default): ``(assistant turn,
    finished)`` or the exception; the turn is ``{"role": "assistant", "content": ...}`` (and
    ``reasoning_content`` when kept so)."""
    name: str

    def answer(self, histories: list[list[dict]],
               thinking: list[bool | None] | None = None) -> list[tuple[dict, bool] | Exception]: ...


class Reasoning(Choice):
    """What becomes of a reasoning model's reasoning text that an OpenAI-compatible server returns apart from
    the answer (``message.reasoning_content``; ``data.reasoning``)."""
    auto = "auto"
    """``field`` when the chat template renders ``reasoning_content``, ``inline`` when it parses ``</think>``
    blocks out of the content (Qwen3, DeepSeek-R1), else ``drop``: kept where the target's template renders it."""
    inline = "inline"
    """``<think>\n{reasoning}\n</think>\n\n{answer}`` as the content."""
    field = "field"
    """The turn's ``reasoning_content``, beside the content."""
    drop = "drop"


def resolve_reasoning(mode: Reasoning, chat_template: str | None) -> Reasoning:
    """``auto`` made concrete for a chat template (see :class:`Reasoning`)."""
    if mode != Reasoning.auto:
        return mode
    template = chat_template or ""
    return (Reasoning.field if "reasoning_content" in template else
            Reasoning.inline if "</think>" in template else Reasoning.drop)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, text_or_messages, thinking: bool | None = None) -> list[int]:
    """Token ids of a chat (or a single user prompt) ending with the assistant generation prompt, rendered in
    the ``thinking`` mode (None: the template's default; False ends Qwen3's prompt with an empty ``<think>``
    block).

    Raises ``ValueError`` when the tokenizer has no chat template (suggesting the fix).
    """
    check_template(tokenizer)
    messages = ([{"role": "user", "content": text_or_messages}] if isinstance(text_or_messages, str)
                else list(text_or_messages))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        **template_kwargs(thinking))
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def prompt_messages(tokenizer: PreTrainedTokenizerBase, prompt) -> list[dict]:
    """An eval :class:`~draftheads.data.sources.Prompt` as the chat the target answers: its system turn, if any,
    as training renders it by default (``data.system=auto``: kept where the template accepts system turns, else
    folded into the user turn), then the user turn."""
    system = [{"role": "system", "content": prompt.system}] if prompt.system else []
    return apply_system_policy(tokenizer, system + [{"role": "user", "content": prompt.text}], "auto")


def target_prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt) -> list[int]:
    """The token ids the target reads for an eval :class:`~draftheads.data.sources.Prompt`: its chat
    (:func:`prompt_messages`) with the generation prompt, in the prompt's thinking mode (``prompt.thinking``)."""
    return prompt_ids(tokenizer, prompt_messages(tokenizer, prompt), prompt.thinking)


class TransformersBackend:
    """The target itself through ``generate``: left-padded batches sorted by length, stopping at the target's
    stop set (:func:`~draftheads.data.templates.stop_token_ids`) with only the given settings
    (:mod:`draftheads.models.decoding`). The answer is the generated tokens before the first stop token
    (``finished``) or all of them (cut by the budget); ``token_ids`` keeps them as generated."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: GenerationSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.stop = stop_token_ids(tokenizer, model.generation_config)
        self.name = f"transformers+stop{sorted(self.stop)}"  # in the cache key: another stop set, other answers

    @torch.inference_mode()
    def answer(self, histories: list[list[dict]],
               thinking: list[bool | None] | None = None) -> list[tuple[dict, bool]]:
        refuse_partial(self.model, "regenerating answers", "regenerate them first with the whole target "
                                                           "(train/regenerate.py, or one run of the job), or set "
                                                           "data.server to a server of the target")
        modes = thinking or [None] * len(histories)
        encoded = [prompt_ids(self.tokenizer, h, mode) for h, mode in zip(histories, modes)]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        out: list[tuple[dict, bool]] = [({}, False)] * len(encoded)
        for i, (ids, finished) in zip(order, generate_ids(self.model, self.tokenizer, [encoded[i] for i in order],
                                                          self.settings, self.stop)):
            answer = ids[:-1] if finished else ids
            out[i] = ({"role": "assistant", "content": self.tokenizer.decode(answer), "token_ids": answer}, finished)
        return out


class VLLMBackend:
    """The target through vLLM's offline engine (``data.generation.engine=vllm``), in vLLM's own environment
    (``python``: its interpreter; the engine started once, on the first batch, by :mod:`draftheads.data.vllm_answers`
    and ended with the process): prompts rendered here with the target's chat template exactly as
    :class:`TransformersBackend` renders them, sent as token ids, answered with the same stop set and settings (the
    target's own ``generation_config`` defaults kept out: ``generation_config="vllm"``), returned as generated ids.
    Greedy answers equal the transformers path's wherever the target has no near-tie (the two compute the same
    float32 logits by other kernels). ``target``: the folder vLLM loads (a GGUF target as draftheads converted it)."""

    def __init__(self, python: str | Path, target: str, tokenizer: PreTrainedTokenizerBase,
                 settings: GenerationSettings, stop: Collection[int], engine: dict):
        self.python, self.target, self.tokenizer, self.settings = Path(python), target, tokenizer, settings
        self.stop, self.engine = sorted(stop), engine
        self.name = f"vllm+stop{self.stop}"  # in the cache key: another engine may break a near-tie otherwise
        self.process: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        job = {"target": self.target, "engine": self.engine}
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        process = subprocess.Popen([str(self.python), str(VLLM_ANSWERS), json.dumps(job)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env=env)
        for line in process.stdout:
            if line.startswith(READY):
                weakref.finalize(self, process.kill)
                return process
        raise RuntimeError(f"vLLM's engine did not start for {self.target} (exit {process.wait()}): see its output "
                           f"above")

    def generate(self, prompts: list[list[int]], settings: GenerationSettings,
                 seeds: list[int] | None = None) -> list[tuple[list[int], bool]]:
        """Generated ids per prompt (token ids, as the target's tokenizer encodes them), through the first stop
        token (included when ``finished``), at ``settings``' sampling; ``seeds``: one per prompt (identical prompts
        then draw different samples: self-made prompts), else ``settings.seed`` for all. Starts the engine on
        first use; ``RuntimeError`` when it ends before answering."""
        self.process = self.process or self._start()
        s = settings
        request = {"prompts": prompts, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                   "max_tokens": s.max_new_tokens, "stop": self.stop, "seed": s.seed, "seeds": seeds}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith(ANSWERS):
                break
        else:
            raise RuntimeError(f"vLLM's engine ended (exit {self.process.wait()}) before answering: see its output")
        out = []
        for ids, reason in json.loads(line[len(ANSWERS):]):
            tokens, _ = cut_at_stop(ids, s.max_new_tokens, self.stop)
            out.append((tokens, bool(tokens) and tokens[-1] in self.stop or reason == "stop"))
        return out

    def answer(self, histories: list[list[dict]],
               thinking: list[bool | None] | None = None) -> list[tuple[dict, bool]]:
        modes = thinking or [None] * len(histories)
        encoded = [prompt_ids(self.tokenizer, h, mode) for h, mode in zip(histories, modes)]
        out = []
        for tokens, finished in self.generate(encoded, self.settings):
            answer = tokens[:-1] if tokens and tokens[-1] in self.stop else tokens
            out.append(({"role": "assistant", "content": self.tokenizer.decode(answer), "token_ids": answer}, finished))
        return out


class OpenAIBackend:
    """Any OpenAI-compatible chat-completions server (``vllm serve``, SGLang, TGI's Messages API) through the
    ``openai`` client: ``concurrency`` requests in flight, each retried ``max_retries`` times with backoff by the
    client. ``finished`` is the server's ``finish_reason == "stop"``. Every sampling field a server may take from
    the model's ``generation_config.json`` (vLLM's default ``--generation-config auto`` does) is sent explicitly,
    so the server decodes with the settings given and nothing else. A reasoning model's ``reasoning_content``
    is kept as ``reasoning`` says (:class:`Reasoning`, resolved for the target's chat template), so the trained
    answer and the next turn's history hold it where the template renders it. A thinking mode other than the
    template's default goes to the server's chat template as ``chat_template_kwargs`` (vLLM, SGLang)."""

    def __init__(self, base_url: str, model: str, settings: GenerationSettings, api_key: str = "EMPTY",
                 concurrency: int = 16, max_retries: int = 3, timeout_s: float = 600.0,
                 reasoning: Reasoning = Reasoning.drop):
        from openai import OpenAI
        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=max_retries, timeout=timeout_s)
        self.model, self.settings, self.concurrency, self.reasoning = model, settings, concurrency, reasoning
        self.name = f"openai+reasoning-{reasoning}"  # in the cache key: another mode, other training text

    def _one(self, history: list[dict], thinking: bool | None = None) -> tuple[dict, bool] | Exception:
        extra = {"top_k": self.settings.top_k or -1, "min_p": 0.0, "repetition_penalty": 1.0}
        if thinking is not None:
            extra["chat_template_kwargs"] = template_kwargs(thinking)
        try:
            reply = self.client.chat.completions.create(
                model=self.model, messages=history, max_tokens=self.settings.max_new_tokens,
                temperature=self.settings.temperature, top_p=self.settings.top_p, seed=self.settings.seed,
                presence_penalty=0.0, frequency_penalty=0.0, extra_body=extra)
            choice = reply.choices[0]
            return self._turn(choice.message.content or "", getattr(choice.message, "reasoning_content", None)), \
                choice.finish_reason == "stop"
        except Exception as e:  # counted as a failed row; the run goes on
            return e

    def _turn(self, content: str, reasoning: str | None) -> dict:
        if reasoning and self.reasoning == Reasoning.inline:
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
        turn = {"role": "assistant", "content": content}
        if reasoning and self.reasoning == Reasoning.field:
            turn["reasoning_content"] = reasoning
        return turn

    def answer(self, histories: list[list[dict]],
               thinking: list[bool | None] | None = None) -> list[tuple[dict, bool] | Exception]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._one, histories, thinking or [None] * len(histories)))


def answer_turns(backend: Backend, chats: list[Chat]) -> list[Regenerated]:
    """Regenerate every assistant turn of ``chats`` turn by turn: round k answers each conversation's k-th user
    turn given the system prompt, earlier user turns and the target's own earlier answers, in the
    conversation's thinking mode (``Chat.thinking``). The dataset's own assistant turns are replaced, but for the
    first ``Chat.answered`` ones, which the target wrote already: those are kept, and the answering starts after
    them. A conversation where the backend fails is returned with ``error``."""
    histories: list[list[dict]] = [list(c.messages[:c.kept]) for c in chats]
    users = [[m for m in c.messages[c.kept:] if m["role"] == "user"] for c in chats]
    unfinished: list[list[int]] = [[i for i in c.unfinished if i < c.kept] for c in chats]
    errors: list[str | None] = [None] * len(chats)
    for k in range(max(map(len, users), default=0)):
        live = [i for i in range(len(chats)) if k < len(users[i]) and errors[i] is None]
        for i in live:
            histories[i].append(users[i][k])
        modes = [chats[i].thinking for i in live]
        answers = (backend.answer([histories[i] for i in live]) if all(m is None for m in modes) else
                   backend.answer([histories[i] for i in live], modes))  # a backend without modes keeps working
        for i, result in zip(live, answers):
            if isinstance(result, Exception):
                errors[i] = f"turn {k}: {type(result).__name__}: {result}"
                continue
            turn, finished = result
            if not finished:
                unfinished[i].append(len(histories[i]))
            histories[i].append(turn)
    return [Regenerated(c.source, c.row, list(c.messages), error=e, thinking=c.thinking, answered=c.answered) if e
            else Regenerated(c.source, c.row, h, u, thinking=c.thinking, answered=c.answered)
            for c, h, u, e in zip(chats, histories, unfinished, errors)]


def cache_key(model_id: dict, chats: list[Chat], settings: GenerationSettings, backend: str,
              chat_template: str | None) -> str:
    """Hash of the target's identity and chat template, the conversations (and each one's thinking mode when it
    is not the template's default, and its kept answers when it has some), the generation settings and the backend
    (which names the engine: the ``engine`` setting itself stays out, so caches made before it existed keep their
    keys)."""
    h = hashlib.sha256(_answer_maker(model_id, settings, backend, chat_template))
    for c in chats:
        mode = [] if c.thinking is None else [c.thinking]  # the default's keys stay those of caches made before
        kept = [{"answered": c.answered}] if c.answered else []
        h.update(json.dumps([c.source, c.row, c.messages, *mode, *kept]).encode())
    return h.hexdigest()[:20]


def settings_key(model_id: dict, settings: GenerationSettings, backend: str, chat_template: str | None) -> str:
    """Hash of what makes an answer, whichever conversations are answered: the target's identity and chat
    template, the generation settings and the backend. Caches with the same settings key lend each other
    answers (:func:`regenerate`'s ``settings``)."""
    return hashlib.sha256(_answer_maker(model_id, settings, backend, chat_template)).hexdigest()[:20]


def _answer_maker(model_id: dict, settings: GenerationSettings, backend: str, chat_template: str | None) -> bytes:
    """The part of both keys that says what makes an answer (the ``engine`` setting stays out: the backend's name
    says it, and caches made before the setting existed keep their keys)."""
    made = {k: v for k, v in asdict(settings).items() if k != "engine"}
    return json.dumps([model_id, made, backend, chat_template], sort_keys=True).encode()


def _turns(messages, thinking: bool | None, answered: int = 0) -> str:
    """What the target is asked in a conversation, whatever its source calls it: the system prompt, the first
    ``answered`` answers (the target's, kept), every user turn and the thinking mode (a dataset's own assistant
    turns are replaced, so they do not count)."""
    kept = kept_prefix(messages, answered)
    asked = [{"role": m["role"], "content": m["content"]} for m in messages[:kept]] + \
        [m for m in messages[kept:] if m["role"] == "user"]
    return json.dumps([asked, thinking], sort_keys=True)


def _borrow(chats: list[Chat], cache_file: Path, settings: str, into: Path) -> int:
    """Append to ``into`` the answers that finished caches beside ``cache_file`` made with the same settings key
    hold for ``chats`` (matched by what the target is asked, not by source and row: a conversation with kept
    answers borrows from one whose same answers the target made). Returns how many."""
    wanted: dict[str, list[Chat]] = {}
    for c in chats:
        wanted.setdefault(_turns(c.messages, c.thinking, c.answered), []).append(c)
    depths = sorted({c.answered for c in chats})
    borrowed = []
    for mark in sorted(cache_file.parent.glob("*.jsonl.settings")):
        lender = mark.with_suffix("")
        if lender == cache_file or not lender.exists() or mark.read_text() != settings or not wanted:
            continue
        for r in _read(lender):
            answers = sum(m["role"] == "assistant" for m in r.messages)
            for k in (k for k in depths if r.error is None and r.answered <= k <= answers):
                borrowed += [Regenerated(c.source, c.row, r.messages, r.unfinished, thinking=c.thinking, answered=k)
                             for c in wanted.pop(_turns(r.messages, r.thinking, k), [])]
    if borrowed:
        with open(into, "a") as f:
            f.writelines(json.dumps(asdict(r)) + "\n" for r in borrowed)
    return len(borrowed)


def regenerate(backend: Backend, chats: list[Chat], batch_size: int, cache_file: str | Path,
               show_progress: bool = True, rank: int = 0, world_size: int = 1,
               barrier: Callable[[], None] = lambda: None, settings: str | None = None) -> list[Regenerated]:
    """Answer every conversation with the backend in chunks of ``batch_size``, reusing and extending
    ``cache_file`` (JSONL, one :class:`Regenerated` per line).

    Lines are appended per chunk to ``<cache_file>.partial``, so a killed run resumes from its last chunk; the
    file is renamed to ``cache_file`` when every conversation succeeded. Returns results in the order of
    ``chats``, failed ones (``error`` set) included; those are retried by the next run.

    ``settings`` (:func:`settings_key`, recorded in ``<cache_file>.settings``; None: nothing borrowed):
    conversations that another finished cache in ``cache_file``'s folder made with the same settings key answers
    (the same system prompt, kept answers, user turns and thinking mode) are taken from it instead of asking the
    backend, so a larger data set reuses a smaller one's answers (at temperature > 0 a borrowed answer is another
    draw from the same distribution).

    With ``world_size`` > 1 (call it on every rank, ``barrier`` being a collective wait), each rank answers its
    share of what is left into ``<cache_file>.partial.rank<r>`` (resuming from every rank's partial file, so
    the number of ranks may change between runs), then rank 0 merges them; every rank returns the same results.
    """
    cache_file = Path(cache_file)
    mark = cache_file.with_name(cache_file.name + ".settings")
    if rank == 0 and settings is not None and not mark.exists():  # a cache made before settings keys lends too
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        mark.write_text(settings)
    if cache_file.exists():
        return _read(cache_file)
    mine = cache_file.with_name(cache_file.name + ".partial" + (f".rank{rank}" if world_size > 1 else ""))
    if mine.exists():  # drop a line cut by a kill, else the next line appended to it is unreadable too
        _write(mine, [r for r in _read(mine) if r.error is None])
    if rank == 0 and settings is not None:
        answered = _merge(cache_file)
        lent = _borrow([c for c in chats if (c.source, c.row) not in answered], cache_file, settings, mine)
        if lent and show_progress:
            print(f"regeneration: {lent} of {len(chats)} conversations answered by earlier caches with the same "
                  "target and settings", flush=True)
    barrier()  # every partial file is clean before any rank reads them
    done = _merge(cache_file)
    barrier()  # every rank has the same view of what is done before any rank appends
    todo = sorted((c for c in chats if (c.source, c.row) not in done),
                  key=lambda c: sum(len(m["content"]) for m in c.messages))[rank::world_size]
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(todo), desc=f"regenerating answers ({backend.name})", unit="conversation",
               disable=not show_progress)
    # seeded sampling in a forked RNG: training afterwards draws the same numbers whether or not this ran
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), open(mine, "a") as f:
        torch.manual_seed(getattr(getattr(backend, "settings", None), "seed", 0))
        for i in range(0, len(todo), batch_size):
            for r in answer_turns(backend, todo[i:i + batch_size]):
                f.write(json.dumps(asdict(r)) + "\n")
            f.flush()
            bar.update(len(todo[i:i + batch_size]))
    bar.close()
    if world_size > 1:
        print(f"[rank {rank}] answered {len(todo)} conversations", flush=True)
    barrier()
    if rank == 0:
        merged = _merge(cache_file, keep_failed=True)
        ordered = [merged[(c.source, c.row)] for c in chats]
        if not any(r.error for r in ordered):
            _write(cache_file, ordered)
            for p in _partials(cache_file):
                p.unlink()
    barrier()
    if cache_file.exists():
        return _read(cache_file)
    merged = _merge(cache_file, keep_failed=True)
    return [merged[(c.source, c.row)] for c in chats]


def _partials(cache_file: Path) -> list[Path]:
    """Every rank's partial file (not the temporary files of an atomic rewrite)."""
    return sorted(p for p in cache_file.parent.glob(cache_file.name + ".partial*") if ".tmp" not in p.name)


def _merge(cache_file: Path, keep_failed: bool = False) -> dict[tuple[str, int], Regenerated]:
    """Every rank's partial results by (source, row); a success wins over a failure of the same row."""
    merged: dict[tuple[str, int], Regenerated] = {}
    for path in _partials(cache_file):
        for r in _read(path):
            key = (r.source, r.row)
            if (r.error is None or keep_failed) and (key not in merged or merged[key].error is not None):
                merged[key] = r
    return merged


def _write(path: Path, results: list[Regenerated]) -> None:
    """Replace ``path`` atomically with one JSON line per result."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text("".join(json.dumps(asdict(r)) + "\n" for r in results))
    tmp.replace(path)


def _read(path: Path) -> list[Regenerated]:
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(Regenerated(**json.loads(line)))
            except (json.JSONDecodeError, TypeError):
                break  # a line cut by a kill: regenerate from here
    return out
