"""Self-made follow-ups: regeneration keeps the answers a row marks as the target's (``answered``), borrows by them,
and the target writes second user turns after its own first answers (data/follow_ups.py)."""

import json
from collections import Counter
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftheads.data import follow_ups as fu
from draftheads.data.conversations import BadRow, Chat, to_chat
from draftheads.data.pipeline import made_source, self_distilled_rows
from draftheads.data.regenerate import Regenerated, answer_turns, cache_key, regenerate
from draftheads.data.self_made import REASONS, SelfMade
from draftheads.data.generation import GenerationSettings
from draftheads.models.target import TargetSpec, load_target
from draftheads.training.config import DataConfig
from tests.helpers import quick_to_end

U1, A1, U2 = ({"role": "user", "content": "Name a red fruit."}, {"role": "assistant", "content": "A cherry."},
              {"role": "user", "content": "And a yellow one?"})


class Recorder:
    """A backend answering ``answer <k>`` to its k-th request and keeping every history it was asked."""
    name = "recorder"

    def __init__(self):
        self.asked = []

    def answer(self, histories, thinking=None):
        self.asked += [list(h) for h in histories]
        return [({"role": "assistant", "content": f"answer {len(self.asked) - len(histories) + i}"}, True)
                for i in range(len(histories))]


def test_regeneration_keeps_the_answers_a_row_marks_as_the_targets_and_answers_after_them():
    backend = Recorder()
    kept, replaced = answer_turns(backend, [Chat("f", 0, (U1, A1, U2), answered=1), Chat("f", 1, (U1, A1, U2))])
    assert kept.messages == [U1, A1, U2, {"role": "assistant", "content": "answer 0"}]
    assert replaced.messages[1] != A1 and len(replaced.messages) == 4
    assert backend.asked[0] == [U1, A1, U2]  # the kept answer is the next turn's context
    assert [U1] in backend.asked and len(backend.asked) == 3  # the unmarked row was answered from its first turn
    # the mark is part of what an answer depends on
    settings = GenerationSettings()
    assert cache_key({}, [Chat("f", 0, (U1, A1, U2), answered=1)], settings, "b", None) != \
        cache_key({}, [Chat("f", 0, (U1, A1, U2))], settings, "b", None)


def test_a_row_names_its_kept_answers_and_a_bad_count_is_refused_naming_the_row():
    assert to_chat({"messages": [U1, A1, U2], "answered": 1}, "f.jsonl row 3", "f", 3).answered == 1
    assert to_chat({"messages": [U1, A1, U2]}, "f.jsonl row 3", "f", 3).answered == 0
    for bad in (2, -1, "1", True):
        with pytest.raises(BadRow, match=r"f.jsonl row 3.*answered.*0\.\.1") as e:
            to_chat({"messages": [U1, A1, U2], "answered": bad}, "f.jsonl row 3", "f", 3)
        assert e.value.reason == "bad_answered"


def test_a_conversation_with_kept_answers_borrows_only_where_the_lenders_answers_are_the_same(tmp_path):
    lender = Recorder()
    whole = [Chat("a", 0, (U1, A1, U2))]
    made = regenerate(lender, whole, 4, tmp_path / "lender.jsonl", False, settings="same")
    first = made[0].messages[1]
    borrower = Recorder()
    same = Chat("b", 0, (U1, first, U2), answered=1)
    other = Chat("b", 1, (U1, {"role": "assistant", "content": "A strawberry."}, U2), answered=1)
    out = regenerate(borrower, [same, other], 4, tmp_path / "borrower.jsonl", False, settings="same")
    assert out[0].messages == made[0].messages  # lent: the same first answer, so the same second one
    assert borrower.asked == [[U1, other.messages[1], U2]]  # only the other first answer was asked again
    # an answer given, not made, lends to no conversation that asks the target for it
    u3, u4 = {"role": "user", "content": "Name a blue bird."}, {"role": "user", "content": "And a green one?"}
    regenerate(Recorder(), [Chat("k", 0, (u3, A1, u4), answered=1)], 4, tmp_path / "kept.jsonl", False,
               settings="same")
    asker = Recorder()
    regenerate(asker, [Chat("c", 0, (u3, A1, u4))], 4, tmp_path / "asker.jsonl", False, settings="same")
    assert asker.asked[0] == [u3]


def test_which_prompts_go_on_is_a_share_fixed_per_row():
    settings = SelfMade(follow_ups=0.3)
    chosen = [r for r in range(2000) if fu.goes_on(settings, r)]
    assert 520 <= len(chosen) <= 680  # 600 expected; binomial sd about 20
    assert chosen != [r for r in range(2000) if fu.goes_on(SelfMade(follow_ups=0.3, seed=1), r)]  # a seed's own
    assert not any(fu.goes_on(SelfMade(), r) for r in range(200))
    assert all(fu.goes_on(SelfMade(follow_ups=1.0), r) for r in range(200))
    with pytest.raises(ValueError, match="follow_ups"):
        SelfMade(follow_ups=1.5)


def config(**self_made) -> DataConfig:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {
        "source": "self_made", "num_train_prompts": 10, "num_val_prompts": 2, "max_length": 128,
        "self_made": {"batch_size": 16, "max_prompt_tokens": 64, "min_words": 1, "max_batches": 40, **self_made},
        "generation": {"max_new_tokens": 12, "temperature": 1.0}}))  # sampled: a tiny target's answers end, not at once


def test_the_target_writes_follow_ups_after_its_own_answers_and_trains_on_both_turns(tiny, tmp_path, monkeypatch):
    """Half the prompts go on: each two-turn row's first answer is the target's own (as the follow-up stage answered
    it, kept by the job's regeneration), its follow-up passed the filters, and both answers are trained; the data
    report counts every chosen prompt; a second run makes the same rows from the caches alone."""
    model, tokenizer = tiny
    cfg = config(follow_ups=0.5)
    with quick_to_end(model, tokenizer):
        train, val, report = self_distilled_rows(cfg, model, tokenizer, {"tiny": "llama"}, tmp_path, False)
    (path, made), = report.self_made.items()
    follow = made["follow_ups"]
    assert follow["asked"] == sum(fu.goes_on(cfg.self_made, r) for r in range(12)) > 0
    assert follow["asked"] == follow["made"] + follow.get("answer_empty", 0)
    assert follow["made"] == follow["kept"] + sum(v for k, v in follow.items() if k in REASONS)
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    two_turn = [r for r in rows if "messages" in r]
    assert len(two_turn) == follow["kept"] > 0 and all(r["answered"] == 1 for r in two_turn)
    trained = {r["row"]: r for r in train + val}
    for r in two_turn:
        first_answer = r["messages"][1]
        assert first_answer["role"] == "assistant" and first_answer["token_ids"]
        assert ("unfinished" in r) == (len(first_answer["token_ids"]) == cfg.generation.max_new_tokens)  # cut, kept
        ids = trained[r["row"]]["input_ids"]
        text = tokenizer.decode(ids)
        assert r["messages"][2]["content"] in text and first_answer["content"] in text
        labelled = sum(trained[r["row"]]["loss_mask"])
        assert labelled > len(first_answer["token_ids"])  # the second answer is trained too
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generated again, not read from the caches"))
    again = self_distilled_rows(cfg, model, tokenizer, {"tiny": "llama"}, tmp_path, False)
    assert [r["input_ids"].tolist() for r in again[0]] == [r["input_ids"].tolist() for r in train]


def test_follow_ups_are_refused_where_no_regeneration_answers_them_before_any_generation(tiny, tmp_path, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generated before refusing"))
    cfg = config(follow_ups=0.5)
    for bad in ({"regenerate": False}, {"thinking_fraction": 0.5}):
        with pytest.raises(ValueError, match="follow_ups=0.5.*data.regenerate"):
            self_distilled_rows(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), bad)), model,
                                tokenizer, {"tiny": "llama"}, tmp_path, False)
    with pytest.raises(ValueError, match="not for eval sets"):  # an eval set's prompts: no job answers them first
        made_source(cfg, 8, model, tokenizer, {"tiny": "llama"}, tmp_path)


class FirstAnswers:
    """The job's regeneration as :func:`~draftheads.data.follow_ups.with_follow_ups` sees it: answers ``<word> <row>``
    to each prompt (``key`` and ``system`` as the job's)."""
    key, system = "settings", "auto"

    def __init__(self, word: str):
        self.word = word

    def __call__(self, chats):
        return [Regenerated(c.source, c.row, [*c.messages, {"role": "assistant", "content": f"{self.word} {c.row}"}])
                for c in chats]


def follow(tiny, tmp_path, count: int, word: str = "Sure", **settings) -> tuple[list[dict], int]:
    """The rows of ``count`` prompts after :func:`with_follow_ups` (every prompt going on, batches of 4), and how
    many batches it sampled."""
    model, tokenizer = tiny
    sampled = []
    real = fu.sample_user_turns
    rows = [{"prompt": f"Tell me about the number {i} please", "topic": "chat", "row": i} for i in range(count)]
    try:
        fu.sample_user_turns = lambda *a, **k: sampled.append(1) or real(*a, **k)
        out = fu.with_follow_ups(rows, "src", SelfMade(follow_ups=1.0, batch_size=4, min_words=1, **settings),
                                 FirstAnswers(word), model, tokenizer, tmp_path / "prompts.jsonl", Counter(), False)
    finally:
        fu.sample_user_turns = real
    return out, len(sampled)


def test_follow_ups_are_reused_only_after_the_same_prompts_and_first_answers(tiny, tmp_path):
    """Cached per batch under what they followed: a larger request reuses a smaller one's whole batches and samples
    its own last one; a smaller request after a larger one samples only its own last batch and spoils nothing; first
    answers made again differently (another regeneration cache, at temperature > 0) get new follow-ups."""
    with quick_to_end(*tiny):
        small, n = follow(tiny, tmp_path, 6)
        assert n == 2  # batches of 4 and 2
        large, n = follow(tiny, tmp_path, 16)
        assert n == 3 and large[:4] == small[:4]  # the whole first batch reused; the batch of 2 became one of 4
        assert follow(tiny, tmp_path, 6) == (small, 0) and follow(tiny, tmp_path, 16) == (large, 0)
        other, n = follow(tiny, tmp_path, 6, word="Well")
    assert n == 2 and all(r["messages"][1]["content"].startswith("Well") for r in other if "messages" in r)


def test_a_kept_steering_prompt_is_placed_as_the_job_places_it_in_a_template_without_system_turns(cache_dir,
                                                                                                     tmp_path):
    """keep_system on a target whose template takes no system turn (Mistral's): the first answer is asked with the
    steering prompt folded into the user's turn (data.system=auto), as the job's rows are rendered."""
    model, tokenizer, _ = load_target(TargetSpec(name_or_path="tiny://mistral"), cache_dir)
    cfg = config(follow_ups=1.0, keep_system=True)
    with quick_to_end(model, tokenizer):
        train, val, report = self_distilled_rows(cfg, model, tokenizer, {"tiny": "mistral"}, tmp_path, False)
    (path, made), = report.self_made.items()
    two_turn = [json.loads(line) for line in Path(path).read_text().splitlines() if '"messages"' in line]
    assert two_turn and all(r["messages"][0]["role"] == "user" and r["messages"][0]["content"].startswith("You are")
                            for r in two_turn)


def test_a_first_answer_the_target_failed_on_stops_the_job_naming_it():
    def answer(chats):
        return [Regenerated(c.source, c.row, list(c.messages), error="HTTP 500" if c.row == 1 else None) for c in chats]
    answer.key, answer.system = "k", "auto"
    rows = [{"prompt": f"Question number {i} here", "topic": "chat", "row": i} for i in range(3)]
    with pytest.raises(RuntimeError, match=r"failed to answer 1 of the 3 .*prompt 1: HTTP 500.*rerun"):
        fu.with_follow_ups(rows, "src", SelfMade(follow_ups=1.0), answer, None, None, Path("p.jsonl"), Counter())
