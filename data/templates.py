"""Conversations -> token ids and the loss mask over assistant tokens, through the target's own chat template.

The trainable span of an assistant turn is its text as the template renders it plus its end-of-turn token
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``...), never the role header, the user's turns or
the whitespace the template puts after the end-of-turn token. Two ways to find it:
- templates with generation markers (``{% generation %}``): transformers' ``return_assistant_tokens_mask``, each
  run made exactly the assistant's tokens plus one end-of-turn token whatever the markers enclose (the newline
  after it, or the text only); markers that miss a turn (an empty answer) fall back to diffing;
- any other template: a turn starts where the rendering of the conversation up to it (with the generation
  prompt) ends, and ends at the first end-of-turn token after that in the full rendering (the template's own,
  found on a probe exchange: Phi-3 appends ``eos`` after the last turn, Qwen3 drops earlier turns' ``<think>``
  blocks). Character spans become token masks through the fast tokenizer's offsets.
- regenerated answers keep the ids the target generated (``token_ids``): those are trained, not a re-encoding
  of their text.

Reasoning targets whose template takes a thinking switch (``enable_thinking``, Qwen3) render a conversation in
one of two modes: ``thinking`` True (the generation prompt leaves the answer to open its ``<think>`` block),
False (the prompt ends with an empty block, ``<think>\n\n</think>\n\n``) or None (the template's default).
Every rendering here takes that mode, so a row's loss mask starts where the target started writing in it.
"""

from __future__ import annotations

import bisect
import functools
import re

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from draftheads.models.decoding import eos_ids

SYSTEM_POLICIES = ("auto", "keep", "fold", "drop")


class TemplateRejected(ValueError):
    """The chat template raised on this conversation (e.g. roles that do not alternate)."""


RENDER_ERRORS = (TemplateError, ValueError, TypeError, KeyError, IndexError)
"""What rendering one conversation can raise: the template's own ``raise_exception`` and Jinja errors, and
transformers' checks (an empty conversation...). Each becomes a :class:`TemplateRejected` naming the row."""


def check_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Raises ``ValueError`` suggesting ``model.chat_template`` when the tokenizer has no chat template."""
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template: use an instruct/chat model, "
                         "or pass one with model.chat_template=<Jinja text or a path to a file holding it>")


THINKING_SWITCH = "enable_thinking"
"""The chat-template variable that turns a reasoning target's thinking on or off (Qwen3's templates)."""


def has_thinking_switch(chat_template: str | None) -> bool:
    """Whether the chat template reads :data:`THINKING_SWITCH`."""
    return THINKING_SWITCH in (chat_template or "")


def check_thinking_switch(tokenizer: PreTrainedTokenizerBase, key: str) -> None:
    """Raises ``ValueError`` naming config ``key`` when the tokenizer's chat template has no thinking switch (a
    mode asked of a template that renders one way only)."""
    if not has_thinking_switch(tokenizer.chat_template):
        raise ValueError(f"{key}: the chat template of {tokenizer.name_or_path!r} has no thinking switch "
                         f"({THINKING_SWITCH}), so it renders one way only: leave {key} unset (null) for this "
                         "target, or pass a template that has one (model.chat_template)")


THINKING_LABELS = {True: "thinking", False: "no_thinking"}
"""How reports name the two modes: data report counts, eval sets measured per mode (``<set>[thinking]``)."""


def template_kwargs(thinking: bool | None) -> dict:
    """The chat template's extra variables for a thinking mode: ``{}`` for the template's default (None)."""
    return {} if thinking is None else {THINKING_SWITCH: bool(thinking)}


def render(tokenizer: PreTrainedTokenizerBase, messages, generation_prompt: bool = False,
           thinking: bool | None = None) -> str:
    """The template's text for ``messages`` in a thinking mode (None: the template's default). Raises
    :class:`TemplateRejected` with the template's message."""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt,
                                             **template_kwargs(thinking))
    except RENDER_ERRORS as e:
        raise TemplateRejected(f"the chat template rejected the conversation: {e}") from None


@functools.lru_cache(maxsize=8)
def _accepts_system(tokenizer: PreTrainedTokenizerBase) -> bool:
    try:
        render(tokenizer, [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
        return True
    except TemplateRejected:
        return False


def apply_system_policy(tokenizer: PreTrainedTokenizerBase, messages: list[dict], policy: str) -> list[dict]:
    """A leading system turn kept, folded into the first user turn (``system + blank line + user``) or dropped.
    ``auto`` keeps it when the template accepts system turns and folds it otherwise; ``keep`` leaves it for the
    template to accept or reject. Raises ``ValueError`` for an unknown policy."""
    if policy not in SYSTEM_POLICIES:
        raise ValueError(f"data.system={policy!r} is not one of {SYSTEM_POLICIES}")
    if not messages or messages[0]["role"] != "system" or policy == "keep":
        return messages
    if policy == "auto" and _accepts_system(tokenizer):
        return messages
    system, rest = messages[0], [dict(m) for m in messages[1:]]
    if policy != "drop":
        first_user = next(i for i, m in enumerate(rest) if m["role"] == "user")
        rest[first_user]["content"] = system["content"] + "\n\n" + rest[first_user]["content"]
    return rest


def _specials(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    return tuple(tokenizer.all_special_tokens) + tuple(tokenizer.get_added_vocab())


@functools.lru_cache(maxsize=8)
def _turn_end(tokenizer: PreTrainedTokenizerBase, template: str) -> str:
    """The text of the special token ``template`` closes an assistant turn with, found on a probe exchange: the
    first special token after the answer's text (whitespace allowed between them), not whatever the rendering
    ends with (Phi-3 appends ``eos`` after the last turn, Llama 2 puts a space before ``</s>``); '' when the turn
    ends with no special token or the template rejects the probe."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        before = render(tokenizer, probe[:1], generation_prompt=True)
        through = render(tokenizer, probe)
    except TemplateRejected:
        return ""
    answer = through.find("Hello", len(before) if through.startswith(before) else 0)
    after = through[answer + len("Hello"):].lstrip() if answer >= 0 else ""
    return max((t for t in _specials(tokenizer) if after.startswith(t)), key=len, default="")


def end_of_turn_token(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``, ``<end_of_turn>``,
    ``<|eot_id|>``, ``<|end|>``, ``</s>``...); None without a template or when a turn ends with no special
    token."""
    marker = _turn_end(tokenizer, tokenizer.chat_template) if tokenizer.chat_template else ""
    return tokenizer.convert_tokens_to_ids(marker) if marker else None


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_config=None) -> frozenset[int]:
    """The target's stop set (:mod:`draftheads.models.decoding`): the tokenizer's eos, every id of
    ``generation_config.eos_token_id`` and the chat template's end-of-turn token."""
    stop = eos_ids(getattr(generation_config, "eos_token_id", None)) | eos_ids(tokenizer.eos_token_id)
    turn_end = end_of_turn_token(tokenizer)
    return frozenset(stop | ({turn_end} if turn_end is not None else set()))


def assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict], full: str,
                    thinking: bool | None = None) -> list[tuple[int, int, int]]:
    """``(start, end, end_marker_chars)`` character spans of each assistant turn in ``full`` (the rendering of
    ``messages`` in the ``thinking`` mode): from the end of its generation prompt through the first end-of-turn
    token after it (:func:`end_of_turn_token`), or, for a template that ends turns with no special token, through
    the turn's own rendering less trailing whitespace. An earlier turn the template renders without the mode's
    prompt (Qwen3 drops earlier turns' ``<think>`` blocks, the empty one of thinking off too) starts after the
    default generation prompt. Raises :class:`TemplateRejected` when the rendering of earlier turns is not a
    prefix of ``full`` (the diff would be meaningless) or a turn has no end-of-turn token after it."""
    marker = _turn_end(tokenizer, tokenizer.chat_template)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True, thinking=thinking)
        if not full.startswith(before) and thinking is not None:
            before = render(tokenizer, messages[:i], generation_prompt=True)
        if not full.startswith(before):
            raise TemplateRejected(f"assistant turn {i}: the template renders earlier turns differently once this "
                                   "turn follows; cannot locate its tokens")
        if marker:
            end = full.find(marker, len(before))
            if end < 0:
                raise TemplateRejected(f"assistant turn {i}: no end-of-turn token {marker!r} after it")
            spans.append((len(before), end + len(marker), len(marker)))
            continue
        through = render(tokenizer, messages[:i + 1], thinking=thinking).rstrip()
        if not through.startswith(before) or not full.startswith(through):
            raise TemplateRejected(f"assistant turn {i}: rendered differently when later turns follow and no "
                                   "end-of-turn token to find it by")
        spans.append((len(before), len(through), 0))
    return spans


def chat_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[dict], train_on: str = "all",
                unfinished: frozenset[int] = frozenset(), thinking: bool | None = None) -> tuple[list[int], list[bool]]:
    """``(input_ids, loss_mask)`` of a conversation rendered by the tokenizer's chat template.

    Args:
        messages: normalised ``{"role", "content"}`` turns (system policy already applied).
        train_on: ``all`` assistant turns or the ``last`` one.
        unfinished: indices (into ``messages``) of assistant turns cut by a token budget: their end-of-turn
            token, which the target never produced, is not trained on.
        thinking: the rendering mode (see the module docstring; None: the template's default): with thinking
            off, the empty ``<think>`` block the prompt ends with is context, not trained.
    Returns:
        ids and mask of equal length; the mask is True on assistant tokens (text + end-of-turn token).
    Raises:
        ValueError: no chat template (suggesting ``model.chat_template``), ``train_on`` not all/last.
        TemplateRejected: the template raised on the conversation or its turns cannot be located.
    """
    check_template(tokenizer)
    if train_on not in ("all", "last"):
        raise ValueError(f"data.train_on={train_on!r} must be all or last")
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    try:
        if not GENERATION_MARKER.search(tokenizer.chat_template):
            raise TemplateRejected("no generation markers")
        ids, runs = _marked_turns(tokenizer, messages, len(assistant), thinking)
    except TemplateRejected:  # no markers, or markers that miss a turn (an empty answer): diff the renderings
        ids, runs = _diffed_turns(tokenizer, messages, thinking)
    ids, runs = _as_generated(tokenizer, messages, assistant, ids, runs)
    keep = [(a, b - cut if i in unfinished else b) for i, (a, b, cut) in zip(assistant, runs)]
    keep = keep[-1:] if train_on == "last" else keep
    mask = [False] * len(ids)
    for a, b in keep:
        mask[a:b] = [True] * (b - a)
    return ids, mask


def _as_generated(tokenizer, messages: list[dict], assistant: list[int], ids: list[int],
                  runs: list[tuple[int, int, int]]) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Each assistant turn's text tokens replaced by the ids the target generated (``token_ids``, kept by
    regeneration) where they spell the same text up to surrounding whitespace (Gemma's template trims answers):
    what is trained is what the target generated after the generation prompt, not a re-encoding of its text (the
    two can split the same text differently). A turn the template renders otherwise (Qwen3 drops the reasoning
    of earlier turns) keeps the template's tokens. Later turns were generated after the template's rendering of
    the earlier ones, so where an earlier turn's ids and its re-encoding differ, their context differs by that
    re-encoding."""
    out, spans, pos = [], [], 0
    for i, (a, b, cut) in zip(assistant, runs):
        body, generated = ids[a:b - cut], messages[i].get("token_ids")
        if generated is not None and tokenizer.decode(generated).strip() == tokenizer.decode(body).strip():
            body = list(generated)
        out += ids[pos:a]
        spans.append((len(out), len(out) + len(body) + cut, cut))
        out += body + ids[b - cut:b]
        pos = b
    return out + ids[pos:], spans


GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")


def _marked_turns(tokenizer, messages: list[dict], n_turns: int,
                  thinking: bool | None = None) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token runs ``(start, end, end-of-turn tokens)`` of the assistant turns from the template's generation
    markers (transformers' ``return_assistant_tokens_mask``), each made the assistant's tokens plus exactly one
    end-of-turn token whatever the markers enclose: what follows that token inside them (a newline) is cut, and
    a turn whose markers enclose the text only gets the end-of-turn token right after it. Raises
    :class:`TemplateRejected` when the markers do not give one run per assistant turn (an empty answer's
    markers enclose nothing)."""
    try:
        out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **template_kwargs(thinking))
    except RENDER_ERRORS as e:
        raise TemplateRejected(f"the chat template rejected the conversation: {e}") from None
    ids, marks = list(out["input_ids"]), list(out["assistant_masks"])
    special = set(tokenizer.all_special_ids)
    runs, start = [], None
    for t, m in enumerate(marks + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            closing = next((i for i in range(start, t) if ids[i] in special), None)
            end = closing + 1 if closing is not None else t + (t < len(ids) and ids[t] in special)
            runs.append((start, end, int(ids[end - 1] in special)))
            start = None
    if len(runs) != n_turns:
        raise TemplateRejected(f"the template's generation markers cover {len(runs)} spans for {n_turns} "
                               "assistant turns")
    return ids, runs


def _diffed_turns(tokenizer, messages: list[dict],
                  thinking: bool | None = None) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Token runs of the assistant turns from :func:`assistant_spans`: a token belongs to a turn when it starts
    inside the turn's characters."""
    full = render(tokenizer, messages, thinking=thinking)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, _ in enc["offset_mapping"]]
    runs = []
    for s, e, marker in assistant_spans(tokenizer, messages, full, thinking):
        a = bisect.bisect_left(starts, s)
        b = bisect.bisect_left(starts, e)
        runs.append((a, b, int(marker > 0)))
    return list(enc["input_ids"]), runs
