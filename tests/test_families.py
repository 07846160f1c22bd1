"""Family conformance suite: a tiny random target of every family people serve (``draftheads.models.tiny``:
each family's architecture with its sliding window and tied or untied embeddings, its real chat template and its
real ``generation_config`` quirks), through every path: the stop set, loss masks, regeneration, every drafter's
job (a few steps), the evaluator (chain, tree, DFlash, EAGLE-3, prompt lookup) past the sliding window, and strict
exports read back. A new family is one ``FAMILIES`` entry plus its end-of-turn token in ``TURN_END``."""

import copy
import dataclasses
import json
import shutil
from dataclasses import replace

import pytest
import torch
from draftheads.data.conversations import Chat
from draftheads.data.generation import GenerationSettings, generate_ids
from draftheads.data.regenerate import TransformersBackend, answer_turns, prompt_ids
from draftheads.data.templates import chat_tokens, stop_token_ids
from draftheads.models.decoding import cut_at_stop
from draftheads.models.speculative import Sampling, plain_decode
from draftheads.models.target import TargetSpec, decoder_layers, hidden_states_from, load_target, record_layer_outputs
from draftheads.models.tiny import FAMILIES
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from draftheads import drafters
from draftheads.drafters.medusa.export import load_tgi_medusa
from draftheads.evaluation.methods import load_eval_sets
from draftheads.jobs.evaluate import evaluate_run
from draftheads.packaged import chitchat_conversations
from draftheads.runs.life import train
from draftheads.runs.saved import open_run
from draftheads.training.config import apply_generation_defaults, to_schema
from tests.helpers import greedy_lossless, short_settings, smoke

TURN_END = {"llama": "<|im_end|>", "llama3": "<|eot_id|>", "qwen3": "<|im_end|>", "gemma3": "<end_of_turn>",
            "mistral": "</s>", "phi3": "<|end|>"}
"""The token each family's chat template closes an assistant turn with (not always the tokenizer's eos)."""
MASK_TOKEN = {"mistral": 0}
"""A family whose tokenizer has no spare special token for a mask (Mistral v0.1's): the id every drafter that
drafts from mask tokens (its config section has ``mask_token_id``) is given, <unk> (id 0), which it never
generates."""


def family_overrides(family: str, drafter: str) -> list[str]:
    """``drafter``'s overrides on ``family``'s target: its mask token where the family has no spare one."""
    section = getattr(drafters.get(drafter).spec.schema(), drafter)  # its config section, at the defaults
    takes_mask = "mask_token_id" in {f.name for f in dataclasses.fields(section)}
    return [f"{drafter}.mask_token_id={MASK_TOKEN[family]}"] if takes_mask and family in MASK_TOKEN else []
JOB = ["data.num_train_prompts=24", "data.num_val_prompts=4", "eval.max_new_tokens=24",
       "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 2}, {name: humaneval, source: humaneval, "
       "num_prompts: 1}]"]


def test_every_family_is_in_the_suite():
    assert TURN_END.keys() == FAMILIES.keys()


def test_the_mask_token_overrides_name_families_and_reach_the_mask_drafters():
    assert MASK_TOKEN.keys() <= FAMILIES.keys()
    assert any(family_overrides("mistral", d) for d in drafters.DRAFTERS)  # some drafter drafts from masks


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, cache_dir):
    """``(name, model, tokenizer)`` of one family's tiny target."""
    model, tokenizer, _ = load_target(TargetSpec(name_or_path=f"tiny://{request.param}"), cache_dir)
    return request.param, model, tokenizer


def test_stop_set_holds_eos_every_generation_config_eos_and_the_turn_end(family):
    name, model, tokenizer = family
    stop = stop_token_ids(tokenizer, model.generation_config)
    listed = model.generation_config.eos_token_id
    listed = set(listed) if isinstance(listed, list) else {listed}
    assert stop == listed | {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(TURN_END[name])}


def test_an_eval_rows_system_prompt_reaches_the_target_in_every_family(family, tmp_path):
    """Issue 52 row 16: the evaluator renders an eval row's system prompt (a row-level field or a first turn) as
    the chat template does: kept where the family takes system turns, folded into the user turn where it does not."""
    import json

    from draftheads.data.conversations import first_user_prompts
    from draftheads.data.regenerate import target_prompt_ids
    from draftheads.data.sources import PromptSource
    name, _, tokenizer = family
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"system": "Answer in French please.", "prompt": "Hello there"}) + "\n")
    (prompt,) = first_user_prompts(PromptSource("jsonl", str(path)), "eval", 1)
    text = tokenizer.decode(target_prompt_ids(tokenizer, prompt))
    assert "Answer in French please." in text and "Hello there" in text, (name, text)


def test_trained_span_is_each_answer_plus_exactly_one_turn_end(family):
    name, _, tokenizer = family
    chat = [{"role": "user", "content": "Hi there, how are you?"}, {"role": "assistant", "content": "Fine thanks."},
            {"role": "user", "content": "And you?"}, {"role": "assistant", "content": "Good."}]
    ids, mask = chat_tokens(tokenizer, chat)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    end = TURN_END[name]
    # Qwen3 renders the turn after the last user query with its (empty) reasoning block: the target writes it
    assert trained.replace("<think>\n\n</think>\n\n", "") == f"Fine thanks.{end}Good.{end}"


def likely(model, tokenizer, token_id: int, prompts: list[list[int]], share: float = 0.25):
    """A copy of ``model`` whose greedy answers to ``prompts`` pick ``token_id`` at about ``share`` of their
    positions (its LM-head row moved along the mean hidden state there), so random targets end answers with it.

    The row moves halfway between the shifts two positions need, at the widest such gap near ``share``: each
    position then picks the turn end or not by a margin. Moving it by exactly one position's need would tie the
    turn end with that position's top token, a tie that batched and single-sequence decoding (or two CPUs' SIMD
    paths) break differently."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        states = []
        for ids in prompts:
            answer = plain_decode(model, torch.tensor(ids), 16, ()).tokens
            states.append(model.base_model(torch.tensor([ids + answer])).last_hidden_state[0, len(ids) - 1:])
        h = torch.cat(states)
        head = model.get_output_embeddings().weight
        logits = model.get_output_embeddings()(h)
        u = h.mean(0) / h.mean(0).norm()
        reach = h @ u
        need = ((logits.max(-1).values - logits[:, token_id])[reach > 0] / reach[reach > 0]).sort().values
        near = range(max(int(share * len(need)) - 3, 0), min(int(share * len(need)) + 3, len(need) - 1))
        k = max(near, key=lambda i: need[i + 1] - need[i])
        head[token_id] += (need[k] + need[k + 1]) / 2 * u
    return model


def test_the_last_layers_run_on_a_cached_layer_state_give_the_whole_forward(family, monkeypatch):
    """Medusa stage 2 runs only the layers it trains, from the cached output of the layer before: for every
    family (sliding windows past the window, RoPE per layer type, Gemma's scaled embedding), padded or packed,
    the last hidden states equal the whole forward's, and gradients reach only the layers run. Packed, ``sdpa``
    runs once per row (:func:`rows_attend_alone`), never over the whole packed sequence."""
    _, model, _ = family
    L, T = len(decoder_layers(model)), 40  # past the tiny sliding window (16)
    ids = torch.randint(3, model.config.vocab_size, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, 25:] = 0
    with torch.no_grad(), record_layer_outputs(model, range(L)) as outputs:
        whole = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    for start in (1, L - 1):
        got = hidden_states_from(model, ids, mask, start, outputs[start - 1])
        keep = mask.bool()
        assert torch.allclose(got[keep], whole[keep], atol=1e-5), start
    n = [T, 25]  # packed back to back, positions restarting: each row as if alone
    sdpa, lengths = ALL_ATTENTION_FUNCTIONS["sdpa"], []

    def recorded_sdpa(module, query, *args, **kwargs):
        lengths.append(query.shape[2])
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", recorded_sdpa)
    packed = hidden_states_from(model, torch.cat([ids[0], ids[1, :n[1]]])[None], None, 1,
                                torch.cat([outputs[0][0], outputs[0][1, :n[1]]])[None],
                                torch.cat([torch.arange(k) for k in n])[None])
    assert torch.allclose(packed[0], whole[mask.bool()], atol=1e-5)
    assert model.config._attn_implementation == "sdpa" and lengths == n * (L - 1)
    model.zero_grad(set_to_none=True)
    model.requires_grad_(True)
    hidden_states_from(model, ids, mask, L - 1, outputs[L - 2]).sum().backward()
    grads = {i: any(p.grad is not None for p in layer.parameters()) for i, layer in enumerate(decoder_layers(model))}
    model.requires_grad_(False).zero_grad(set_to_none=True)
    assert grads == {i: i == L - 1 for i in range(L)}
    with torch.no_grad():
        assert torch.allclose(hidden_states_from(model, ids, mask, 0, None), whole)


def test_regeneration_is_the_plain_greedy_answer_through_the_first_stop(family):
    """The turn end that is not eos stops regeneration and plain decoding alike; the target's decoding defaults
    (sampling, a repetition penalty) reach neither; the row trains exactly the generated ids plus one turn end."""
    name, model, tokenizer = family
    turn_end = tokenizer.convert_tokens_to_ids(TURN_END[name])
    chats = [Chat("chitchat", i, ({"role": "user", "content": c.messages[0]},))
             for i, c in enumerate(chitchat_conversations()[:5])]
    model = likely(model, tokenizer, turn_end, [prompt_ids(tokenizer, c.messages) for c in chats])
    stop = stop_token_ids(tokenizer, model.generation_config)
    answered = answer_turns(TransformersBackend(model, tokenizer, GenerationSettings(max_new_tokens=16)), chats)
    finished = 0
    for chat, result in zip(chats, answered):
        decoded = plain_decode(model, torch.tensor(prompt_ids(tokenizer, chat.messages)), 16, stop)
        assert min(decoded.top2_gaps) > 1e-4, "the shaped target must decide every step by a margin, not a tie"
        plain = decoded.tokens
        answer = result.messages[-1]
        ends = plain[-1] in stop
        finished += ends
        assert answer["token_ids"] == (plain[:-1] if ends else plain)
        assert (1 in result.unfinished) == (not ends)
        ids, mask = chat_tokens(tokenizer, result.messages, unfinished=frozenset(result.unfinished))
        trained = [i for i, m in zip(ids, mask) if m]
        if name == "qwen3" and tokenizer.decode(trained).startswith("<think>\n\n</think>\n\n"):
            # Qwen3's template puts an empty reasoning block before a last answer that has none: the template's
            # tokens are kept there (what the template renders is not what this random target wrote)
            assert tokenizer.decode(trained) == "<think>\n\n</think>\n\n" + tokenizer.decode(
                answer["token_ids"]).lstrip("\n") + (TURN_END[name] if ends else "")
        else:
            assert trained == answer["token_ids"] + ([turn_end] if ends else [])
    assert finished >= 2  # the stop really ended answers


@pytest.fixture(scope="module")
def jobs(family, tmp_path_factory, cache_dir):
    """Every registered drafter's job, made short (``tests/helpers.py SHORT``: every stage, Medusa's second too),
    on one family's target: ``{drafter: (folder, report)}``."""
    name = family[0]
    out = {}
    for drafter in sorted(drafters.DRAFTERS):
        folder = tmp_path_factory.mktemp(f"{name}-{drafter}")
        out[drafter] = folder, train(drafter, smoke(drafter, folder, cache_dir, f"model.name_or_path=tiny://{name}",
                                                    *JOB, *short_settings(drafter),
                                                    *family_overrides(name, drafter)))
    return out


@pytest.mark.slow
def test_every_drafter_trains_and_decodes_losslessly_past_the_window(family, jobs):
    _, model, tokenizer = family
    window = getattr(model.config, "sliding_window", None)
    if window:  # every evaluated sequence runs past the window
        prompts = [p for ps in load_eval_sets(to_schema(smoke("medusa", "x", "y", *JOB)).eval).values() for p in ps]
        assert min(len(prompt_ids(tokenizer, p.text)) for p in prompts) > window
    for drafter, (_, report) in jobs.items():
        curve = next(iter(report["train_curves"].values()))
        assert all(torch.isfinite(torch.tensor(list(h.values()))).all() for h in curve)
        for set_name, metrics in report["eval"].items():
            methods = {metrics["method"]: metrics, **metrics.get("peers", {})}
            assert len(methods) >= 2
            for method, m in methods.items():
                assert greedy_lossless(m), (drafter, set_name, method, m.get("mismatches"))
            assert set(metrics["decoding"]["stop_token_ids"]) == stop_token_ids(tokenizer, model.generation_config)


@pytest.mark.slow
def test_exports_load_back_strictly(family, jobs):
    for drafter, (folder, report) in jobs.items():
        run = open_run(folder, [], drafters.get(drafter).spec.vllm_weights)  # the strict loaders of the vLLM export
        assert run.trained.model is not None
        assert json.loads((folder / "report.json").read_text())["eval"].keys() == report["eval"].keys()
    heads = load_tgi_medusa(jobs["medusa"][0] / "export" / "tgi")
    assert heads.vocab_size == len(family[2])


APPLIED = {"llama": (0.0, 0, 1.0), "llama3": (0.6, 0, 0.9), "qwen3": "repetition_penalty", "gemma3": (1.0, 64, 0.95),
           "mistral": (0.0, 0, 1.0), "phi3": (0.0, 0, 1.0)}
"""What ``model.generation_defaults=apply`` makes of each family's ``generation_config``: ``(temperature, top_k,
top_p)`` for regeneration and every evaluated method, or the default it refuses."""


@pytest.mark.slow
def test_generation_defaults_apply_to_every_path_or_are_refused(family, jobs, tmp_path):
    """On request the target's sampling defaults become regeneration's and the evaluation's settings, sampled as
    the target's own ``generate`` samples with them; a default no path can apply is refused, never applied to
    some paths only."""
    name, model, tokenizer = family
    folder = tmp_path / "run"
    shutil.copytree(jobs["medusa"][0], folder)
    apply = ["model.generation_defaults=apply", "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 1}]",
             "eval.max_new_tokens=8", "eval.peers=[]"]
    if isinstance(APPLIED[name], str):
        with pytest.raises(ValueError, match=APPLIED[name]):
            evaluate_run(folder, apply)
        return
    conf = to_schema(smoke("medusa", "x", "y", f"model.name_or_path=tiny://{name}", "model.generation_defaults=apply"))
    apply_generation_defaults(conf, model.generation_config)
    generation = conf.data.generation
    assert (generation.temperature, generation.top_k, generation.top_p) == APPLIED[name]
    assert conf.eval.samplings() == [Sampling(*APPLIED[name], conf.eval.proposal)]
    stop, ids = stop_token_ids(tokenizer, model.generation_config), prompt_ids(tokenizer, "Tell me about your day")
    torch.manual_seed(0)  # top_k passed: where the config sets none, transformers' generate adds its own 50
    own = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=12, pad_token_id=tokenizer.pad_token_id, top_k=generation.top_k)[0, len(ids):]
    torch.manual_seed(0)
    ((ours, _),) = generate_ids(model, tokenizer, [ids], replace(generation, max_new_tokens=12), stop)
    assert ours == cut_at_stop(own.tolist(), 12, stop)[0]
    if generation.temperature > 0:  # it really sampled
        assert ours != plain_decode(model, torch.tensor(ids), 12, stop).tokens
    report = evaluate_run(folder, apply)
    key = "chitchat" if generation.temperature == 0 else f"chitchat@T{generation.temperature:g}"
    assert report["eval"][key]["decoding"]["generation_defaults"] == "apply"
    sampling = report["eval"][key]["sampling"]
    assert (sampling["temperature"], sampling["top_k"], sampling["top_p"]) == APPLIED[name]

