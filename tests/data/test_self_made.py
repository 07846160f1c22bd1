"""Prompts written by the target itself: the pre-query template of every family, the filters and deduplication on
crafted rows, the same seed giving the same rows (and a larger request the smaller one's first), a target without a
chat template refused before any generation, and a job training on them."""

import json
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftheads.data import self_made as sm
from draftheads.data.templates import stop_token_ids
from draftheads.data.pipeline import near_eval, self_distilled_rows
from draftheads.data.conversations import Chat
from draftheads.models.target import TargetSpec, load_target
from draftheads.models.tiny import FAMILIES
from draftheads.training.config import DataConfig
from tests.helpers import quick_to_end

SETTINGS = sm.SelfMade(batch_size=16, max_prompt_tokens=64, min_words=1)


def candidate(text: str, finished: bool = True) -> dict:
    return {"text": text, "topic": "chat", "finished": finished}


def test_each_filter_drops_what_it_names_and_keeps_the_rest_in_order():
    crafted = [candidate("How do I bake bread at home?"), candidate("   "), candidate("Hi"),
               candidate("Tell me about the history of the Roman empire", finished=False),
               candidate("What is <|im_start|> doing here?"), candidate("and then and then and then and then and then"),
               candidate("how do I  BAKE bread at home?"),  # case and spacing folded: the first one again
               candidate("How do I bake bread at home today?"),  # a near duplicate of the first
               candidate("Which planet is the largest in our solar system?")]
    counts = Counter()
    kept = sm.keep(crafted, sm.SelfMade(min_words=3, near_duplicate=0.5), ("<|im_start|>",), counts)
    assert [k["text"] for k in kept] == ["How do I bake bread at home?",
                                         "Which planet is the largest in our solar system?"]
    assert counts == {"empty": 1, "too_short": 1, "unfinished": 1, "template_tokens": 1, "repetitive": 1,
                      "duplicate": 1, "near_duplicate": 1}
    assert sm.distinct_bigrams(["a b c", "a b d"]) == pytest.approx(3 / 4)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, cache_dir):
    model, tokenizer, _ = load_target(TargetSpec(name_or_path=f"tiny://{request.param}"), cache_dir)
    return request.param, model, tokenizer


def test_the_pre_query_template_ends_where_the_users_message_begins_in_every_family(family):
    """Rendered with a user message appended, the pre-query template is the conversation's exact start (the system
    prompt kept, or folded into the user turn where the family's template takes none)."""
    from draftheads.data.templates import apply_system_policy, render
    name, _, tokenizer = family
    prefix = sm.pre_query(tokenizer, sm.TOPICS["math"])
    whole = render(tokenizer, apply_system_policy(tokenizer, [{"role": "system", "content": sm.TOPICS["math"]},
                                                              {"role": "user", "content": "What is 2 + 2?"}], "auto"))
    assert whole.startswith(prefix + "What is 2 + 2?"), (name, prefix)
    assert "math tutor" in prefix
    # after a whole exchange (a follow-up's): the next user turn begins where the rendered conversation goes on
    history = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
    prefix = sm.pre_query(tokenizer, "Ask again.", history)
    whole = render(tokenizer, apply_system_policy(tokenizer, [{"role": "system", "content": "Ask again."}, *history,
                                                              {"role": "user", "content": "And 3 + 3?"}], "auto"))
    assert whole.startswith(prefix + "And 3 + 3?") and "It is 4." in prefix, (name, prefix)


def test_the_same_seed_gives_the_same_prompts_and_a_larger_request_extends_them(family, tmp_path):
    name, model, tokenizer = family
    ident = {"family": name}
    with quick_to_end(model, tokenizer):
        first = sm.self_made_prompts(SETTINGS, 3, model, tokenizer, ident, tmp_path / "a", show_progress=False)
        again = sm.self_made_prompts(SETTINGS, 3, model, tokenizer, ident, tmp_path / "b", show_progress=False)
        more = sm.self_made_prompts(SETTINGS, 20, model, tokenizer, ident, tmp_path / "a", show_progress=False)
        other = sm.self_made_prompts(sm.SelfMade(batch_size=16, max_prompt_tokens=64, min_words=1, seed=1), 3, model,
                                     tokenizer, ident, tmp_path / "a", show_progress=False)
    assert first and first == again  # from the seed alone, in a fresh cache
    assert len(more) == 20 and more[:len(first)] == first
    batches = sm.cache_file(SETTINGS, ident, tokenizer.chat_template, tmp_path / "a").read_text().splitlines()
    assert len(batches) > 1  # the larger request sampled batches after the cached ones
    assert [p["prompt"] for p in other] != [p["prompt"] for p in first]


class RecordingSampler:
    """An engine that samples in place of the target (as vLLM's does with data.generation.engine=vllm): each
    prompt's message is a function of its seed alone, and every call is recorded."""
    name = "recording"

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, []

    def generate(self, prompts, settings, seeds=None):
        self.calls.append((prompts, settings, seeds))
        end = sorted(stop_token_ids(self.tokenizer))[0]
        return [(self.tokenizer(f"Question {s} about item {s % 97} please", add_special_tokens=False)["input_ids"]
                 + [end], True) for s in seeds]


def test_another_engine_samples_each_prompt_from_its_own_seed_in_a_cache_of_its_own(tiny, tmp_path, monkeypatch):
    """With an engine, the target in process generates nothing; the engine gets the pre-query template once per
    prompt with the self-made sampling settings and a seed per prompt (distinct within a batch and across batches,
    the same for the same batch again), and its prompts are cached apart from the target's own."""
    model, tokenizer = tiny
    monkeypatch.setattr(sm, "generate_ids", lambda *a, **k: pytest.fail("the target in process generated"))
    engine = RecordingSampler(tokenizer)
    made = sm.self_made_prompts(SETTINGS, 20, model, tokenizer, {"t": 1}, tmp_path / "a", show_progress=False,
                                engine=engine)
    again = sm.self_made_prompts(SETTINGS, 20, model, tokenizer, {"t": 1}, tmp_path / "b", show_progress=False,
                                 engine=RecordingSampler(tokenizer))
    assert len(made) == 20 and made == again
    (first, settings, seeds0), (_, _, seeds1) = engine.calls
    prefix = tokenizer(sm.pre_query(tokenizer, sm.TOPICS[SETTINGS.topics[0]]), add_special_tokens=False)["input_ids"]
    assert first == [prefix] * SETTINGS.batch_size
    assert (settings.temperature, settings.top_p, settings.max_new_tokens) == (1.0, 0.95, 64)
    assert len(set(seeds0 + seeds1)) == 2 * SETTINGS.batch_size
    ours = sm.cache_file(SETTINGS, {"t": 1}, tokenizer.chat_template, tmp_path / "a")
    theirs = sm.cache_file(SETTINGS, {"t": 1}, tokenizer.chat_template, tmp_path / "a", engine.name)
    assert theirs.exists() and not ours.exists()


def test_a_target_without_a_chat_template_is_refused_before_any_generation(cache_dir, tmp_path, monkeypatch):
    model, tokenizer, _ = load_target(TargetSpec(name_or_path="tiny://llama"), cache_dir)
    monkeypatch.setattr(tokenizer, "chat_template", None)
    monkeypatch.setattr(sm, "sample_batch", lambda *a, **k: pytest.fail("generated first"))
    with pytest.raises(ValueError, match="has no chat template: .*model.chat_template"):
        sm.self_made_prompts(SETTINGS, 3, model, tokenizer, {}, tmp_path, show_progress=False)


def test_an_unknown_topic_is_refused_naming_the_shipped_ones():
    with pytest.raises(ValueError, match=r"topics are \['chat', 'code'"):
        sm.SelfMade(topics=["poetry"])


def test_a_self_made_source_becomes_a_file_every_reader_reads_and_its_report(tiny, tmp_path):
    """made_source writes the kept prompts to a JSONL file; training rows come from it, answered by the target,
    and the data report says how many were made, dropped by which filter, and their diversity."""
    model, tokenizer = tiny
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "source": "self_made", "num_train_prompts": 6, "num_val_prompts": 2, "max_length": 64,
        "self_made": {"batch_size": 16, "max_prompt_tokens": 64, "min_words": 1, "max_batches": 40},
        "generation": {"max_new_tokens": 8}}))
    with quick_to_end(model, tokenizer):
        train, val, report = self_distilled_rows(cfg, model, tokenizer, {"tiny": "llama"}, tmp_path, False)
    (path, made), = report.self_made.items()
    assert made["used"] == 8 and made["kept"] >= 8 and 0 < made["distinct_bigrams"] <= 1
    assert made["made"] == made["kept"] + sum(made["dropped"].values())
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert len(rows) == 8 and len(train) + len(val) == 8 - report.skipped.get("too_long", 0)
    assert train[0]["source"] == path
    # other filters over the same cached candidates: the same file, rewritten with what they keep
    stricter = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"self_made": {"min_words": 6}}))
    with quick_to_end(model, tokenizer):
        self_distilled_rows(stricter, model, tokenizer, {"tiny": "llama"}, tmp_path, False)
    assert all(len(sm.words(json.loads(line)["prompt"])) >= 6 for line in Path(path).read_text().splitlines())


def test_training_prompts_that_near_duplicate_eval_prompts_are_flagged():
    chats = [Chat("f.jsonl", 0, ({"role": "user", "content": "Natalia sold clips to 48 of her friends in April"},)),
             Chat("f.jsonl", 1, ({"role": "user", "content": "What is the capital of France?"},))]
    found = near_eval(chats, ["Natalia sold clips to 48 of her friends in April and May"])
    assert found["count"] == 1 and found["examples"][0].startswith("f.jsonl row 0 (line 1)")
