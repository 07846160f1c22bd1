"""Loss masks through real chat templates (shipped here as strings, no hub): the trainable span of every
assistant turn must decode to exactly the assistant text, as the template renders it, plus its end-of-turn
token; nothing of the user's turns, the role headers or the whitespace after the end-of-turn token."""

import copy

import pytest

from draftheads.data.templates import TemplateRejected, apply_system_policy, chat_tokens
from draftheads.models.tiny import tiny_tokenizer

SMOLLM2 = (  # SmolLM2-135M-Instruct's own template (from the GGUF the main job runs); ChatML with a default system
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = (  # Meta-Llama-3-Instruct: contents are trimmed, no newline after <|eot_id|>
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

MISTRAL = (  # Mistral-7B-Instruct: strict user/assistant alternation, no system role, eos after each answer
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

GEMMA = (  # Gemma-it: no system role, assistant is "model", contents trimmed
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

QWEN3 = (  # Qwen3's template without its tool-calling branches: <think> kept only after the last user query
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- set content = message.content %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + "
    "content.lstrip('\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + content }}{%- endif %}{{- '<|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}")

CHATML_MARKED = (  # ChatML with transformers' generation markers around the assistant text and <|im_end|>
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CHATML_MARKED_NEWLINE = CHATML_MARKED.replace(  # markers that also enclose the newline after <|im_end|>
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}",
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}")
CHATML_MARKED_TEXT = CHATML_MARKED.replace(  # markers around the text alone
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}",
    "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>\n' }}")

SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>", "[INST]",
            "[/INST]", "<bos>", "<start_of_turn>", "<end_of_turn>"]

CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris. "},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, since 1871."}]


@pytest.fixture(scope="module")
def base_tokenizer():
    corpus = [m["content"] for m in CHAT] * 20 + ["hello world, the quick brown fox"] * 20
    tok = tiny_tokenizer(400, corpus)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.add_tokens(["<think>", "</think>"])  # Qwen3: added, not special
    return tok


def with_template(tok, template, bos, eos):
    tok = copy.deepcopy(tok)
    tok.chat_template, tok.bos_token, tok.eos_token = template, bos, eos
    return tok


def trained_spans(tok, ids, mask) -> list[str]:
    """Decoded text of every contiguous run of trainable tokens."""
    runs, current = [], []
    for t, m in zip(ids + [None], mask + [False]):
        if m:
            current.append(t)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs


CASES = {  # template, bos, eos, system policy's effect, expected spans
    "smollm2": (SMOLLM2, "<|im_start|>", "<|im_end|>", ["Paris. <|im_end|>", "Rome, since 1871.<|im_end|>"]),
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", ["Paris.<|eot_id|>", "Rome, since 1871.<|eot_id|>"]),
    "mistral": (MISTRAL, "<s>", "</s>", ["Paris. </s>", "Rome, since 1871.</s>"]),
    "gemma": (GEMMA, "<bos>", "<end_of_turn>", ["Paris.<end_of_turn>", "Rome, since 1871.<end_of_turn>"]),
    "chatml_generation_markers": (CHATML_MARKED, "<|im_start|>", "<|im_end|>",
                                  ["Paris. <|im_end|>", "Rome, since 1871.<|im_end|>"]),
    "markers_around_the_newline_too": (CHATML_MARKED_NEWLINE, "<|im_start|>", "<|im_end|>",
                                       ["Paris. <|im_end|>", "Rome, since 1871.<|im_end|>"]),
    "markers_around_the_text_only": (CHATML_MARKED_TEXT, "<|im_start|>", "<|im_end|>",
                                     ["Paris. <|im_end|>", "Rome, since 1871.<|im_end|>"]),
}


@pytest.mark.parametrize("name", CASES)
def test_trainable_spans_are_exactly_the_assistant_turns(base_tokenizer, name):
    template, bos, eos, expected = CASES[name]
    tok = with_template(base_tokenizer, template, bos, eos)
    messages = apply_system_policy(tok, CHAT, "auto")
    folded = name in ("mistral", "gemma")  # templates that reject a system turn get it folded into the user's
    assert (messages[0]["role"] == "user" and messages[0]["content"].startswith("Answer briefly.\n\n")) == folded
    ids, mask = chat_tokens(tok, messages)
    assert len(ids) == len(mask) and tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False)
    assert trained_spans(tok, ids, mask) == expected
    ids, mask = chat_tokens(tok, messages, train_on="last")
    assert trained_spans(tok, ids, mask) == expected[-1:]
    ids, mask = chat_tokens(tok, messages, unfinished=frozenset({len(messages) - 1}))  # cut by the token budget
    assert trained_spans(tok, ids, mask) == expected[:-1] + [expected[-1].removesuffix(eos)]


@pytest.mark.parametrize("template", [CHATML_MARKED, CHATML_MARKED_NEWLINE, CHATML_MARKED_TEXT, SMOLLM2])
def test_an_empty_answer_trains_its_end_of_turn_token_alone(base_tokenizer, template):
    tok = with_template(base_tokenizer, template, "<|im_start|>", "<|im_end|>")
    ids, mask = chat_tokens(tok, [CHAT[1], {"role": "assistant", "content": ""}])
    assert trained_spans(tok, ids, mask) == ["<|im_end|>"]


def test_qwen3_think_blocks_train_where_the_template_keeps_them(base_tokenizer):
    """Qwen3 keeps <think> only in turns after the last user query: an earlier turn trains on its answer alone
    (as the template renders it in the conversation), the last one on its reasoning too."""
    tok = with_template(base_tokenizer, QWEN3, "<|im_start|>", "<|im_end|>")
    chat = [CHAT[1], {"role": "assistant", "content": "<think>\nFrance, so Paris.\n</think>\n\nParis."},
            CHAT[3], {"role": "assistant", "content": "<think>\nItaly.\n</think>\n\nRome."}]
    ids, mask = chat_tokens(tok, chat)
    assert trained_spans(tok, ids, mask) == ["Paris.<|im_end|>", "<think>\nItaly.\n</think>\n\nRome.<|im_end|>"]


def test_templates_that_reject_a_conversation_say_so(base_tokenizer):
    tok = with_template(base_tokenizer, MISTRAL, "<s>", "</s>")
    with pytest.raises(TemplateRejected, match="must alternate"):
        chat_tokens(tok, [CHAT[2], CHAT[1], CHAT[2]])
    with pytest.raises(TemplateRejected, match="rejected the conversation"):  # a system turn
        chat_tokens(tok, apply_system_policy(tok, CHAT, "keep"))
    assert apply_system_policy(tok, CHAT, "drop")[0] == CHAT[1]


def test_a_tokenizer_without_chat_template_gets_a_suggestion(base_tokenizer):
    tok = with_template(base_tokenizer, None, "<s>", "</s>")
    with pytest.raises(ValueError, match="no chat template.*model.chat_template"):
        chat_tokens(tok, CHAT[1:3])
