"""Reasoning targets' two modes, on the conformance suite's tiny Qwen3 target with its real template
(``models/chat_templates/qwen3.jinja``): rows regenerated and trained on a seeded mix of thinking on and off
(``data.thinking_fraction``), the mode recorded per row, in the cache keys and in the data report; eval sets
measured per mode (``thinking: true | false | both``); templates with no thinking switch refused."""

import json
from dataclasses import replace

import pytest
import torch
from hydra import compose, initialize_config_dir

from draftheads.data.batching import DataReport, data_scalars, rows_from_chats, rows_sha256
from draftheads.data.conversations import Chat, load_chats
from draftheads.data.pipeline import self_distilled_rows, with_thinking
from draftheads.data.regenerate import cache_key, prompt_ids, target_prompt_ids
from draftheads.data.sources import PromptSource
from draftheads.data.templates import stop_token_ids
from draftheads.evaluation.methods import load_eval_sets
from draftheads.runs.life import train
from draftheads.models.speculative import plain_decode
from draftheads.models.target import TargetSpec, load_target
from draftheads.training.config import DataConfig, EvalConfig, EvalSetConfig, to_schema
from tests.helpers import CONF, greedy_lossless, smoke

ASSISTANT = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
"""What qwen3.jinja appends to the generation prompt when ``enable_thinking`` is false."""


@pytest.fixture(scope="module")
def qwen3(cache_dir):
    """``(model, tokenizer)`` of the tiny Qwen3 target (the family suite's), with its real chat template."""
    model, tokenizer, _ = load_target(TargetSpec(name_or_path="tiny://qwen3"), cache_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def llama(cache_dir):
    """``(model, tokenizer)`` of the tiny Llama target, whose ChatML template has no thinking switch."""
    model, tokenizer, _ = load_target(TargetSpec(name_or_path="tiny://llama"), cache_dir)
    return model, tokenizer


def chats(n: int) -> list[Chat]:
    return [Chat("s", i, ({"role": "user", "content": f"question {i}"},)) for i in range(n)]


def test_eval_prompts_per_mode_come_from_the_right_rendering(qwen3):
    """``both`` gives two sets of the same prompts; thinking off ends the prompt with the template's empty think
    block, thinking on (and the template's default) leaves the answer to open its own."""
    _, tok = qwen3
    sets = load_eval_sets(EvalConfig(sets=[EvalSetConfig(name="chat", source="chitchat", num_prompts=2,
                                                         thinking="both"),
                                           EvalSetConfig(name="off", source="chitchat", num_prompts=2, thinking=False),
                                           EvalSetConfig(name="default", source="chitchat", num_prompts=2)]), tok)
    assert list(sets) == ["chat[thinking]", "chat[no_thinking]", "off", "default"]
    texts = {name: [p.text for p in prompts] for name, prompts in sets.items()}
    assert len({tuple(t) for t in texts.values()}) == 1  # the same prompts, rendered per mode
    for name, prompts in sets.items():
        for p in prompts:
            rendered = tok.decode(target_prompt_ids(tok, p))
            if name in ("chat[no_thinking]", "off"):
                assert rendered.endswith(ASSISTANT + EMPTY_THINK)
            else:
                assert rendered.endswith(ASSISTANT) and "<think>" not in rendered
    assert [p.thinking for p in sets["chat[thinking]"]] == [True, True]
    assert [p.thinking for p in sets["default"]] == [None, None]


def test_thinking_fraction_gives_the_asked_share_seeded_per_row():
    rows = chats(40)
    quarter = with_thinking(rows, 0.25, seed=0)
    assert sum(c.thinking for c in quarter) == 10 and all(c.thinking is not None for c in quarter)
    assert all(c.thinking is False for c in with_thinking(rows, 0.0, seed=0))
    assert all(c.thinking is True for c in with_thinking(rows, 1.0, seed=0))
    assert with_thinking(rows, None, seed=0) == rows  # the template's default, as before
    modes = {c.row: c.thinking for c in quarter}
    assert {c.row: c.thinking for c in with_thinking(rows[::-1], 0.25, seed=0)} == modes  # not by order
    assert {c.row: c.thinking for c in with_thinking(rows, 0.25, seed=1)} != modes
    tokenized = Chat("t", 0, tokens=((1, 2), (False, True)))
    assert with_thinking([tokenized], 1.0, seed=0) == [tokenized]  # used as given
    with pytest.raises(ValueError, match=r"thinking_fraction=1.5 must be in \[0, 1\]"):
        DataConfig(thinking_fraction=1.5)


def test_a_template_without_a_thinking_switch_is_refused(llama, tmp_path):
    _, tok = llama
    with pytest.raises(ValueError, match="data.thinking_fraction: the chat template .* has no thinking switch"):
        with_thinking(chats(4), 0.5, 0, tok)
    with pytest.raises(ValueError, match="no thinking switch"):  # before any row is read or answered
        self_distilled_rows(DataConfig(thinking_fraction=0.5), None, tok, {}, tmp_path)
    with pytest.raises(ValueError, match="eval set 'c': thinking=both: the chat template .* no thinking switch"):
        load_eval_sets(EvalConfig(sets=[EvalSetConfig(name="c", source="chitchat", thinking="both")]), tok)
    with pytest.raises(ValueError, match="thinking='maybe' must be true, false, both or null"):
        EvalSetConfig(name="c", source="chitchat", thinking="maybe")


def test_eval_set_modes_compose_from_yaml_words():
    conf = to_schema(smoke("medusa", "x", "y", "data.thinking_fraction=0.25",
                           "eval.sets=[{name: a, source: chitchat, thinking: true}, "
                           "{name: b, source: chitchat, thinking: both}, {name: c, source: chitchat}]"))
    assert [s.thinking for s in conf.eval.sets] == [True, "both", None]
    assert conf.data.thinking_fraction == 0.25


def test_rows_are_answered_and_trained_in_their_mode_and_counted(qwen3, tmp_path):
    """Each row is regenerated from its mode's prompt (the target's greedy answer to it), trained from where
    the target started writing (after the empty think block when off), carries its mode, and the report counts
    the modes; another mix is another regeneration cache key and another data fingerprint."""
    model, tok = qwen3
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Tell me about topic number {i}."}) + "\n" for i in range(8)))
    data = DataConfig(source="jsonl", path=str(path), thinking_fraction=0.5, num_train_prompts=6, num_val_prompts=2,
                      generation=replace(DataConfig().generation, max_new_tokens=8))
    train_rows, val_rows, report = self_distilled_rows(data, model, tok, {"name": "tiny-qwen3"}, tmp_path / "cache",
                                                       show_progress=False)
    rows = train_rows + val_rows
    assert [r["thinking"] for r in train_rows].count(True) == 3 and [r["thinking"] for r in val_rows].count(True) == 1
    assert report.thinking_modes == {"thinking": 4, "no_thinking": 4}
    assert report.as_dict()["thinking_modes"] == report.thinking_modes and "rows per mode" in report.describe()
    assert data_scalars(report)["rows_no_thinking"] == 4
    stop = stop_token_ids(tok, model.generation_config)
    for r in rows:
        ids, mask = r["input_ids"].tolist(), r["loss_mask"].tolist()
        start = mask.index(True)
        prompt = prompt_ids(tok, f"Tell me about topic number {r['row']}.", thinking=r["thinking"])
        assert ids[:start] == prompt  # trained from where the target started writing in this mode
        assert tok.decode(prompt).endswith(ASSISTANT + EMPTY_THINK if not r["thinking"] else ASSISTANT)
        if not r["thinking"]:  # the trained tokens are the target's greedy answer to the thinking-off prompt
            answer = plain_decode(model, torch.tensor(prompt), 8, stop).tokens
            n = len(answer) - (answer[-1] in stop)
            assert ids[start:start + n] == answer[:n]
    mixed = with_thinking(chats(8), 0.5, 0)
    assert cache_key({}, mixed, data.generation, "b", tok.chat_template) != \
        cache_key({}, with_thinking(chats(8), 0.25, 0), data.generation, "b", tok.chat_template) != \
        cache_key({}, chats(8), data.generation, "b", tok.chat_template)
    assert rows_sha256(rows) != rows_sha256([{**r, "thinking": not r["thinking"]} for r in rows]) != \
        rows_sha256([{k: v for k, v in r.items() if k != "thinking"} for r in rows])


def test_a_regenerated_file_read_back_trains_each_row_in_its_recorded_mode(qwen3, tmp_path):
    """``train/regenerate.py`` writes each row's mode; trained with ``data.regenerate=false``, a thinking-off row
    is rendered off again (the empty think block is context), a row without a mode in the default rendering."""
    _, tok = qwen3
    turns = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Fine."}]
    path = tmp_path / "regenerated.jsonl"
    path.write_text("".join(json.dumps({"messages": turns, **mode}) + "\n" for mode in ({"thinking": False}, {})))
    read = load_chats(PromptSource("jsonl", str(path)), "train", 10)
    assert [c.thinking for c in read] == [False, None]
    off, default = rows_from_chats(tok, read, 256, DataReport())
    for row, context, trained in ((off, ASSISTANT + EMPTY_THINK, "Fine.<|im_end|>"),
                                  (default, ASSISTANT, EMPTY_THINK + "Fine.<|im_end|>")):
        ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
        assert tok.decode(ids[:mask.index(True)]).endswith(context)
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == trained
    assert off["thinking"] is False and "thinking" not in default


def test_the_regenerate_job_writes_each_rows_mode_and_refuses_another_mix_into_its_output(tmp_path, cache_dir):
    from draftheads.jobs.regenerate import regenerate_data
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Say something about {i}."}) + "\n" for i in range(4)))
    out = tmp_path / "out.jsonl"
    overrides = ["model=tiny", "model.name_or_path=tiny://qwen3", f"cache_dir={cache_dir}", "data.source=jsonl",
                 f"data.path={source}", "data.generation.max_new_tokens=4", f"output={out}"]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("regenerate", overrides=overrides + ["data.thinking_fraction=0.5"])
        other = compose("regenerate", overrides=overrides + ["data.thinking_fraction=0.25"])
    assert regenerate_data(cfg)["written"] == 4
    assert sorted(json.loads(line)["thinking"] for line in out.read_text().splitlines()) == [False, False, True, True]
    with pytest.raises(ValueError, match="was made from other data"):
        regenerate_data(other)


@pytest.mark.slow
def test_a_job_trained_on_a_mix_reports_acceptance_per_mode(qwen3, tmp_path, cache_dir, capsys):
    """Medusa (stage 1) on the tiny Qwen3 target, half the rows thinking: report.json counts the modes and
    measures the eval set once per mode, each with tau and per-position acceptance, and the table shows both."""
    report = train("medusa", smoke("medusa", tmp_path / "run", cache_dir, "model.name_or_path=tiny://qwen3",
                                   "data.thinking_fraction=0.5", "data.num_train_prompts=16", "data.num_val_prompts=4",
                                   "data.generation.max_new_tokens=16", "stage2.enabled=false",
                                   "eval.max_new_tokens=12", "eval.peers=[]", "eval.prompt_lookup_tokens=0",
                                   "eval.sets=[{name: chitchat, source: chitchat, num_prompts: 1, thinking: both}]"))
    modes = report["data"]["thinking_modes"]  # 10 rows of each mode made, less those too long (skipped)
    assert modes.keys() == {"thinking", "no_thinking"} and min(modes.values()) >= 5
    assert sum(modes.values()) == report["data"]["rows_out"] + report["data"]["rows_left_out"]
    assert list(report["eval"]) == ["chitchat[thinking]", "chitchat[no_thinking]"]
    for name, mode in (("chitchat[thinking]", True), ("chitchat[no_thinking]", False)):
        m = report["eval"][name]
        assert m["thinking"] is mode and m["acceptance_length"] >= 1 and greedy_lossless(m)
        assert len(m["acceptance_rate_per_position"]) == m["gamma"]
    table = capsys.readouterr().out
    assert "chitchat[thinking]" in table and "chitchat[no_thinking]" in table
