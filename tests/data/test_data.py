"""Tests of the data package: prompt sources, self-distillation by the target (regenerate), tokenised rows,
batches, rank shards and cached hidden states. The target is the tiny random Llama, built once per module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import draftheads.data.regenerate as regen_mod
import pytest
import torch
from omegaconf import OmegaConf
from draftheads.data.batching import (
    BatchPlan,
    DataReport,
    collate,
    data_scalars,
    epoch_batches,
    pack,
    rank_shard,
    rows_from_chats,
    token_batches,
    unpack,
)
from draftheads.data.conversations import Chat, first_user_prompts, load_chats
from draftheads.data.generation import GenerationSettings
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.regenerate import Regenerated, TransformersBackend, prompt_ids, regenerate
from draftheads.data.sources import (
    HUMANEVAL_EVAL_ROWS,
    HUMANEVAL_INSTRUCTION,
    Prompt,
    PromptSource,
    chitchat_conversations,
    chitchat_prompts,
    humaneval_prompts,
)
from draftheads.models.target import TINY, TargetSpec, load_target
from transformers import AutoTokenizer

from draftheads.runs.life import open_job
from draftheads.runs.rows import job_rows
from tests.helpers import ROOT, smoke

ALL = 10**9  # a limit no source reaches
REAL_GENERATE = regen_mod.generate_ids  # before any test monkeypatches it


# ----------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's ops are too small for intra-op threads; they only spin on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """``(model, tokenizer, path)`` of the tiny random Llama with its ChatML tokenizer (named apart from
    conftest's ``tiny``, which has no path)."""
    cache_dir = tmp_path_factory.mktemp("cache")
    return load_target(TargetSpec(name_or_path=TINY), cache_dir)


SETTINGS = GenerationSettings(max_new_tokens=8, batch_size=2)
MULTI_TURN = Chat("multi", 0, ({"role": "user", "content": "Hi there, how are you?"},
                               {"role": "assistant", "content": "The dataset's own answer, replaced."},
                               {"role": "user", "content": "What did you do today?"}))


@pytest.fixture(scope="module")
def regenerated(target, tmp_path_factory):
    """One complete regenerate() run on 5 chitchat prompts and a 2-turn chat: ``(chats, cache_file, results)``."""
    model, tokenizer, _ = target
    chats = load_chats(PromptSource("chitchat"), "train", 5) + [MULTI_TURN]
    cache_file = tmp_path_factory.mktemp("regen") / "answers.jsonl"
    backend = TransformersBackend(model, tokenizer, SETTINGS)
    return chats, cache_file, regenerate(backend, chats, SETTINGS.batch_size, cache_file, show_progress=False)


def greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's greedy continuation of one unpadded prompt, cut after the end-of-turn token."""
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, len(ids):].tolist()
    eos = tokenizer.eos_token_id
    return new[:new.index(eos) + 1] if eos in new else new


class Killed(Exception):
    """Stands for the process being killed in the middle of a run."""


def recording_generate(calls: list, fail_after: int | None = None):
    """A ``generate_ids`` that records the prompt ids it is asked for (and raises after ``fail_after`` calls)."""
    def fake(model, tokenizer, batch, settings, stop):
        if fail_after is not None and len(calls) >= fail_after:
            raise Killed
        calls.append([list(b) for b in batch])
        return REAL_GENERATE(model, tokenizer, batch, settings, stop)
    return fake


# ----------------------------------------------------------------------------------------------- sources

def test_chitchat_splits_are_disjoint_and_cover_expected_shares():
    splits = {s: chitchat_prompts(s, ALL) for s in ("train", "val", "eval")}
    rows = {s: {p.row for p in ps} for s, ps in splits.items()}
    assert rows["train"].isdisjoint(rows["val"])
    assert rows["train"].isdisjoint(rows["eval"])
    assert rows["val"].isdisjoint(rows["eval"])
    for ps in splits.values():
        assert len({p.row for p in ps}) == len(ps)  # one prompt per conversation
    # 90/5/5 by hash of the conversation id: the shares are close to those.
    total = sum(len(ps) for ps in splits.values())
    assert 0.87 < len(splits["train"]) / total < 0.93
    assert 0.03 < len(splits["val"]) / total < 0.07
    assert 0.03 < len(splits["eval"]) / total < 0.07
    # Each prompt is one of the messages of the conversation its row names.
    convs = chitchat_conversations()
    for p in splits["val"]:
        assert p.source == "chitchat"
        assert p.text in convs[p.row].messages


def test_chitchat_limit_and_char_bounds():
    assert len(chitchat_prompts("train", 25)) == 25
    assert chitchat_prompts("train", 25) == chitchat_prompts("train", 40)[:25]
    assert all(40 <= len(p.text) <= 300 for p in chitchat_prompts("train", 500))
    narrow = chitchat_prompts("val", ALL, min_chars=100, max_chars=120)
    assert narrow and all(100 <= len(p.text) <= 120 for p in narrow)
    with pytest.raises(ValueError, match="test"):
        chitchat_prompts("test", 5)


def test_chitchat_is_deterministic_across_processes():
    """Same prompts in a fresh interpreter with another str-hash salt (the split must not use hash())."""
    here = [asdict(p) for p in chitchat_prompts("eval", 30)]
    code = ("import json; from dataclasses import asdict; from draftheads.data.sources import chitchat_prompts; "
            "print(json.dumps([asdict(p) for p in chitchat_prompts('eval', 30)]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
                         cwd=ROOT)
    assert json.loads(out.stdout) == here


def test_humaneval_prompts_come_from_the_package_with_a_held_out_eval_split():
    evaluation, training = humaneval_prompts("eval", ALL), humaneval_prompts("train", ALL)
    assert len(evaluation) == HUMANEVAL_EVAL_ROWS and len(evaluation) + len(training) == 164
    assert [p.row for p in evaluation + training] == list(range(164))
    for p in evaluation + training:
        assert p.source == "humaneval"
        assert p.text.startswith(HUMANEVAL_INSTRUCTION)
        assert "def " in p.text
    assert humaneval_prompts("eval", 3) == evaluation[:3]
    assert first_user_prompts(PromptSource("humaneval"), "train", 2) == training[:2]


def test_sources_reject_an_unknown_name_and_jsonl_or_hub_without_path():
    with pytest.raises(ValueError, match="chitchat, humaneval, jsonl, hub"):
        first_user_prompts(PromptSource("alpaca"), "train", 5)
    for source in ("jsonl", "hub"):
        with pytest.raises(ValueError, match=f"source '{source}' needs a path"):
            first_user_prompts(PromptSource(source), "train", 5)


def test_eval_prompts_from_jsonl_accept_prompt_turns_and_messages(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Plain prompt"},
             {"turns": ["First MT-Bench turn", "second turn"], "category": "writing"},
             None,  # a blank line: skipped, but it still counts for line numbers
             {"messages": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "User message"},
                           {"role": "assistant", "content": "hi"}, {"role": "user", "content": "later"}]}]
    path.write_text("".join(("" if x is None else json.dumps(x)) + "\n" for x in lines))
    got = first_user_prompts(PromptSource("jsonl", str(path)), "eval", ALL)
    assert got == [Prompt(str(path), 0, "Plain prompt"), Prompt(str(path), 1, "First MT-Bench turn"),
                   Prompt(str(path), 3, "User message", system="be nice")]
    assert first_user_prompts(PromptSource("jsonl", str(path)), "eval", 2) == got[:2]


def _local_dataset(folder, rows):
    """A dataset folder as a hub repository would hold it (one parquet file), written with datasets."""
    import datasets
    folder.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(folder / "train-00000-of-00001.parquet"))
    return folder


def hub(path, **kw) -> list[Prompt]:
    return first_user_prompts(PromptSource("hub", str(path), **kw), "eval", ALL)


def test_an_evaluation_with_no_eval_set_is_refused():
    """``eval.sets=[]`` with evaluation on would print an empty table and exit 0: refused, naming the fix."""
    from draftheads.evaluation.methods import load_eval_sets
    from draftheads.training.config import to_schema
    conf = to_schema(smoke("medusa", "unused", "unused", "eval.sets=[]")).eval
    with pytest.raises(ValueError, match=r"eval.sets=\[\]: no eval set to measure.*eval.enabled=false"):
        load_eval_sets(conf)
    assert load_eval_sets(replace(conf, enabled=False)) == {}


def test_hub_prompts_read_datasets_folders_and_files_with_any_common_prompt_field(tmp_path):
    """The path real users take (datasets.load_dataset on a hub id) run on a local folder: MT-Bench's list of
    turns, GSM8K's question, ShareGPT conversations; and local parquet/jsonl files."""
    mt_bench = _local_dataset(tmp_path / "mt_bench", [{"prompt": ["Write a haiku.", "Now a limerick."],
                                                       "category": "writing"}] * 3)
    assert [p.text for p in first_user_prompts(PromptSource("hub", str(mt_bench)), "eval", 2)] == ["Write a haiku."] * 2
    gsm8k = _local_dataset(tmp_path / "gsm8k", [{"question": f"What is {i} + 1?", "answer": str(i + 1)}
                                                for i in range(4)])
    got = hub(gsm8k)
    assert [(p.row, p.text) for p in got] == [(i, f"What is {i} + 1?") for i in range(4)]
    assert got[0].source == f"{gsm8k}[train]"
    share = tmp_path / "sharegpt.jsonl"
    share.write_text(json.dumps({"conversations": [{"from": "human", "value": "Hi there"},
                                                   {"from": "gpt", "value": "Hello"}]}) + "\n")
    assert [p.text for p in hub(share)] == ["Hi there"]
    assert [p.text for p in hub(gsm8k, field="answer")] == ["1", "2", "3", "4"]
    assert [p.text for p in hub(share, field="conversations")] == ["Hi there"]  # a chat column by name


def test_hub_prompts_name_dataset_row_and_field_of_a_bad_row(tmp_path):
    folder = _local_dataset(tmp_path / "ds", [{"question": "fine"}, {"question": ""}])
    with pytest.raises(ValueError, match=r"ds\[train\] row 1: field 'question': must be a non-empty string"):
        hub(folder)
    with pytest.raises(ValueError, match=r"row 0: field 'prompt': no such field \(fields: \['question'\]\)"):
        hub(folder, field="prompt")


@pytest.mark.parametrize("bad_line, expected", [
    ('{"prompt": "unterminated', "invalid JSON"),
    ('{"prompt": ""}', "'prompt'"),
    ('{"prompt": 42}', "'prompt'"),
    ('{"turns": ["   "]}', "'turns[0]'"),
    ('{"messages": [{"role": "system", "content": "only a system message"}]}', "'messages': no user turn"),
    ('{"text": "unknown key"}', "'prompt|question|instruction|turns|messages|conversations'"),
    ('["not", "an", "object"]', "expected a JSON object"),
])
def test_jsonl_prompts_malformed_line_names_file_line_and_field(tmp_path, bad_line, expected):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + bad_line + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError) as err:
        first_user_prompts(PromptSource("jsonl", str(path)), "eval", ALL)
    assert f"{path} row 2 (line 3):" in str(err.value)
    assert expected in str(err.value)


# ----------------------------------------------------------------------------------------------- prompt_ids

def test_prompt_ids_needs_a_chat_template(target):
    tokenizer = AutoTokenizer.from_pretrained(target[2])  # a separate copy: the shared one keeps its template
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        prompt_ids(tokenizer, "hello")


def test_prompt_ids_is_chatml_with_generation_prompt(target):
    _, tokenizer, _ = target
    ids = prompt_ids(tokenizer, "How are you today?")
    assert all(isinstance(i, int) for i in ids)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    text = tokenizer.decode(ids)
    assert text == "<|im_start|>user\nHow are you today?<|im_end|>\n<|im_start|>assistant\n"
    assert text.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------------------- rows

def test_rows_mask_exactly_the_assistant_tokens(target):
    _, tokenizer, _ = target
    chat = Chat("chitchat", 7, ({"role": "user", "content": "Say something nice."},
                                {"role": "assistant", "content": "You are doing great."}))
    report = DataReport()
    (row,) = rows_from_chats(tokenizer, [chat], 512, report)
    assert row["input_ids"].dtype == torch.int64 and row["loss_mask"].dtype == torch.bool
    assert tokenizer.decode(row["input_ids"][row["loss_mask"]].tolist()) == "You are doing great.<|im_end|>"
    assert tokenizer.decode(row["input_ids"][~row["loss_mask"]].tolist()) == (
        "<|im_start|>user\nSay something nice.<|im_end|>\n<|im_start|>assistant\n\n")
    assert (row["source"], row["row"]) == ("chitchat", 7)
    n = len(row["input_ids"])
    assert (report.rows_out, report.tokens, report.trainable_tokens) == (1, n, int(row["loss_mask"].sum()))
    assert report.length_percentiles == {"p50": n, "p90": n, "p99": n, "max": n}


def tokenized(n: int, trainable_from: int, row: int) -> Chat:
    """A pre-tokenised chat: ids 100.., trainable from ``trainable_from`` on."""
    return Chat("tok", row, tokens=(tuple(range(100, 100 + n)), tuple(i >= trainable_from for i in range(n))))


@pytest.mark.parametrize("overlong, kept, truncated", [
    ("truncate", {0: 5, 1: 6, 3: 3}, 2),  # rows 0 and 1 cut to their first 8 tokens, row 2 dropped (1 left)
    ("drop", {3: 3}, 0),                   # every row over 8 dropped
])
def test_rows_over_long_are_truncated_or_dropped_and_counted(target, overlong, kept, truncated):
    """``kept``: row -> where its training starts; each kept row is its first 8 tokens, the mask kept with them."""
    _, tokenizer, _ = target
    chats = [tokenized(15, 5, 0),    # 15 > 8: truncated to 3 trainable tokens
             tokenized(11, 6, 1),    # 11 > 8: exactly 2 trainable tokens left: truncated
             tokenized(12, 7, 2),    # 12 > 8: 1 trainable token would be left: dropped
             tokenized(8, 3, 3)]     # fits exactly: kept whole
    report = DataReport()
    rows = rows_from_chats(tokenizer, chats, 8, report, overlong=overlong)
    assert [r["row"] for r in rows] == list(kept)
    for r in rows:
        assert r["input_ids"].tolist() == list(range(100, 108)), r["row"]
        assert r["loss_mask"].tolist() == [i >= kept[r["row"]] for i in range(8)], r["row"]
    assert report.truncated == truncated
    assert report.skipped == {"too_long": 4 - len(kept)}
    assert report.rows_out == len(kept)
    assert report.trainable_tokens == sum(8 - start for start in kept.values())


def test_pretokenised_rows_of_another_vocabulary_are_skipped(target):
    _, tokenizer, _ = target
    report = DataReport()
    big = Chat("tok", 1, tokens=((5, len(tokenizer), 7), (False, True, True)))
    rows = rows_from_chats(tokenizer, [tokenized(4, 1, 0), big], 16, report)
    assert [r["row"] for r in rows] == [0] and report.skipped == {"bad_tokens": 1}
    assert "outside the tokenizer" in report.examples["bad_tokens"]


@pytest.mark.parametrize("chats", [[], [tokenized(20, 19, 0)], [tokenized(4, 9, 0), tokenized(3, 9, 1)]],
                         ids=["no rows", "all dropped", "nothing trainable"])
def test_rows_without_trainable_token_raise(target, chats):
    with pytest.raises(ValueError, match="no trainable"):
        rows_from_chats(target[1], chats, 16, DataReport())


def test_unfinished_answers_train_without_the_end_of_turn_token(target):
    _, tokenizer, _ = target
    chat = Regenerated("s", 0, [{"role": "user", "content": "Tell me a story."},
                                {"role": "assistant", "content": "Once upon a"}], unfinished=[1])
    report = DataReport()
    (row,) = rows_from_chats(tokenizer, [chat], 512, report)
    assert tokenizer.decode(row["input_ids"][row["loss_mask"]].tolist()) == "Once upon a"
    assert report.unfinished_answers == 1


# ----------------------------------------------------------------------------------------------- batches

def test_collate_right_pads_every_key():
    D, pad = 4, 99
    lengths = [3, 5, 1]
    rows = [{"input_ids": torch.arange(1, n + 1), "loss_mask": torch.tensor([i % 2 == 1 for i in range(n)]),
             "hidden_states": torch.randn(n, D), "source": "s", "row": k} for k, n in enumerate(lengths)]
    batch = collate(rows, pad_token_id=pad)
    assert batch["input_ids"].shape == (3, 5) and batch["input_ids"].dtype == torch.int64
    assert batch["attention_mask"].shape == (3, 5) and batch["attention_mask"].dtype == torch.int64
    assert batch["loss_mask"].shape == (3, 5) and batch["loss_mask"].dtype == torch.bool
    assert batch["hidden_states"].shape == (3, 5, D) and batch["hidden_states"].dtype == torch.float32
    for i, (r, n) in enumerate(zip(rows, lengths)):
        assert batch["input_ids"][i].tolist() == r["input_ids"].tolist() + [pad] * (5 - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (5 - n)
        assert batch["loss_mask"][i].tolist() == r["loss_mask"].tolist() + [False] * (5 - n)
        assert torch.equal(batch["hidden_states"][i, :n], r["hidden_states"])
        assert not batch["hidden_states"][i, n:].any()
    assert "hidden_states" not in collate([{k: v for k, v in r.items() if k != "hidden_states"} for r in rows], 0)


@pytest.mark.parametrize("n_rows, world_size", [(10, 1), (10, 3), (10, 4), (8, 8)])
def test_rank_shard_equal_and_disjoint(n_rows, world_size):
    rows = list(range(n_rows))
    shards = [rank_shard(rows, rank, world_size) for rank in range(world_size)]
    assert {len(s) for s in shards} == {n_rows // world_size}
    flat = [x for s in shards for x in s]
    assert len(set(flat)) == len(flat) == world_size * (n_rows // world_size)


def test_rank_shard_too_few_rows():
    with pytest.raises(ValueError, match="3 rows"):
        rank_shard([0, 1, 2], 0, 4)


class RankZeroOfTwo:
    """A one-process job's accelerator as rank 0 of two processes sees it (every rank reads all the rows)."""
    num_processes, process_index = 2, 0

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def __getattr__(self, name):
        return getattr(self.accelerator, name)


def test_training_rows_beyond_the_processes_equal_shares_are_counted_as_left_out(tmp_path, cache_dir):
    """Each process trains ``len(rows) // processes`` training rows (:func:`rank_shard`): the data report counts
    the rest as left out (printed, logged, in report.json) rather than as trained on."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [5 + i] * 30, "loss_mask": [0] * 10 + [1] * 20}) + "\n"
                            for i in range(12)))
    job = open_job(smoke("medusa", tmp_path / "run", cache_dir, "data=general", "data.source=jsonl",
                         f"data.path={path}", "data.regenerate=false", "data.num_train_prompts=11",
                         "data.num_val_prompts=1"))  # the file named replaces the mixture, in the saved config too
    assert OmegaConf.load(tmp_path / "run" / "config.yaml").data.mixture == [] == job.conf.data.mixture
    train, _, report = job_rows(replace(job, accelerator=RankZeroOfTwo(job.accelerator)), attach=False)
    assert len(train) == 11  # 10 trained, 1 left out; and 1 held out
    assert (report.rows_in, report.rows_out, report.rows_left_out) == (12, 11, 1)
    assert "+ 1 left out" in report.describe()
    assert data_scalars(report)["rows_left_out"] == report.as_dict()["rows_left_out"] == 1


def test_epoch_batches_deterministic_complete_and_length_grouped():
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.zeros(int(n), dtype=torch.long), "row": i}
            for i, n in enumerate(torch.randint(1, 60, (75,), generator=g))]

    def order(seed, epoch):
        return [[r["row"] for r in b] for b in epoch_batches(rows, 4, seed, epoch)]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(0, 1)
    assert order(0, 0) != order(1, 0)
    for seed, epoch in [(0, 0), (0, 1), (3, 7)]:
        batches = epoch_batches(rows, 4, seed, epoch)
        assert sorted(r["row"] for b in batches for r in b) == list(range(75))  # every row exactly once
        assert all(1 <= len(b) <= 4 for b in batches)
        assert sum(len(b) < 4 for b in batches) <= 1  # 75 = 2 full windows of 32 + 11: one short batch
        for b in batches:  # sorted by length inside a window, so inside each batch too
            lengths = [len(r["input_ids"]) for r in b]
            assert lengths == sorted(lengths)


def _rows_of_lengths(n: int, seed: int = 0, longest: int = 60) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 9, (int(t),), generator=g),
             "loss_mask": torch.rand(int(t), generator=g) > .5,
             "hidden_states": torch.randn(int(t), 3, generator=g), "row": i}
            for i, t in enumerate(torch.randint(1, longest, (n,), generator=g))]


def test_token_batches_hold_the_budget_cover_every_row_once_and_are_nearly_full():
    rows = _rows_of_lengths(300)
    rows.append({**rows[0], "input_ids": torch.zeros(150, dtype=torch.long), "row": 300})  # over the budget

    def order(seed, epoch):
        return [[r["row"] for r in b] for b in token_batches(rows, 128, seed, epoch)]

    assert order(0, 0) == order(0, 0) and order(0, 0) != order(0, 1) and order(0, 0) != order(1, 0)
    batches = token_batches(rows, 128, 0, 0)
    assert sorted(r["row"] for b in batches for r in b) == list(range(301))
    sizes = [sum(len(r["input_ids"]) for r in b) for b in batches]
    assert [b for b, n in zip(batches, sizes) if n > 128] == [[rows[300]]]  # the long row alone
    assert sum(sizes) / (128 * len(batches)) > 0.9  # first-fit decreasing leaves little of the budget unused


def test_token_batches_for_drafters_reading_lines_keep_the_padded_lines_within_the_budget():
    """``lines``: a batch's rows times its longest row stay within the budget (a drafter that unpacks pads each
    row to the longest), every row once; without it, rows of very unlike lengths share batches."""
    rows = _rows_of_lengths(300, seed=3)

    def lines(batches):
        return [len(b) * max(len(r["input_ids"]) for r in b) for b in batches]

    batches = token_batches(rows, 128, 0, 0, lines=True)
    assert sorted(r["row"] for b in batches for r in b) == list(range(300))
    assert max(lines(batches)) <= 128
    assert max(lines(token_batches(rows, 128, 0, 0))) > 128


def test_a_packed_batch_holds_the_rows_back_to_back_with_positions_restarting():
    rows = _rows_of_lengths(3)
    batch = pack(rows)
    n = [len(r["input_ids"]) for r in rows]
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, sum(n))
    assert torch.equal(batch["input_ids"][0], torch.cat([r["input_ids"] for r in rows]))
    assert torch.equal(batch["hidden_states"][0], torch.cat([r["hidden_states"] for r in rows]))
    assert batch["position_ids"][0].tolist() == [t for k in n for t in range(k)]
    assert batch["documents"][0].tolist() == [i for i, k in enumerate(n) for _ in range(k)]


def test_unpacking_a_packed_batch_gives_the_padded_batch_of_its_rows():
    """What a drafter attending per row reads: the rows one per line, as :func:`collate` pads them (pad id 0 here),
    features computed on the packed sequence carried to their rows."""
    rows = _rows_of_lengths(4, seed=2)
    packed = pack(rows)
    features = torch.randn(*packed["input_ids"].shape, 3)
    lines = unpack({**packed, "target_features": features})
    padded = collate(rows, 0)
    assert lines.keys() == padded.keys() | {"target_features"}
    for key in padded:
        assert torch.equal(lines[key], padded[key]), key
    keep = padded["attention_mask"].bool()
    assert torch.equal(lines["target_features"][keep], features[0]) and not lines["target_features"][~keep].any()


@pytest.mark.parametrize("world_size", [1, 3])
def test_a_packed_plan_gives_every_process_the_same_number_of_batches_each_epoch(world_size):
    """Shares that pack into fewer batches split some in two, so no row is left out."""
    rows = _rows_of_lengths(200, seed=1)
    plans = [BatchPlan(rows, r, world_size, 8, 100, seed=0) for r in range(world_size)]
    for epoch in range(3):
        counts = {len(p.epoch(epoch)) for p in plans}
        assert counts == {plans[0].count(epoch)}
        seen = sorted(r["row"] for p in plans for b in p.epoch(epoch) for r in b)
        assert seen == [r["row"] for p in plans for r in p.shards[p.rank]]  # every row of every share, once
    plan = plans[0]
    assert plan.total(2.5) == plan.count(0) + plan.count(1) + plan.count(2) // 2
    padded = BatchPlan(rows, 0, 1, 20, None, seed=0)  # 10 batches an epoch
    assert [padded.total(e) for e in (0.01, 0.4, 2.3)] == [1, 4, 23]
    assert plan.locate(plan.count(0)) == (1, 0) and plan.locate(plan.count(0) - 1) == (0, plan.count(0) - 1)
    padded = BatchPlan(rows, 0, world_size, 8, None, seed=0)
    assert padded.epoch(0) == epoch_batches(rank_shard(rows, 0, world_size), 8, 0, 0)


# ----------------------------------------------------------------------------------------------- regenerate

def test_regenerate_answers_every_turn_with_the_targets_greedy_continuation(target, regenerated):
    """Turn by turn: the second answer of the multi-turn chat is the target's continuation of the conversation
    holding its own first answer, and the dataset's own answer is gone."""
    model, tokenizer, _ = target
    chats, cache_file, results = regenerated
    assert [(r.source, r.row) for r in results] == [(c.source, c.row) for c in chats]
    assert cache_file.exists() and not cache_file.with_name(cache_file.name + ".partial").exists()
    for chat, r in zip(chats, results):
        assert [m["role"] for m in r.messages] == ["user", "assistant"] * (len(r.messages) // 2)
        assert [m for m in r.messages if m["role"] == "user"] == [m for m in chat.messages if m["role"] == "user"]
        for i in range(1, len(r.messages), 2):
            ids = greedy(model, tokenizer, prompt_ids(tokenizer, r.messages[:i]), SETTINGS.max_new_tokens)
            finished = ids[-1] == tokenizer.eos_token_id
            assert r.messages[i]["content"] == tokenizer.decode(ids[:-1] if finished else ids)
            assert (i in r.unfinished) == (not finished)
    assert len(results[-1].messages) == 4 and "replaced" not in results[-1].messages[1]["content"]
    # The cache file holds exactly the returned results, in order.
    assert [json.loads(line) for line in cache_file.read_text().splitlines()] == [asdict(r) for r in results]


def test_regenerate_reads_the_cache_without_generating(target, regenerated, monkeypatch):
    model, tokenizer, _ = target
    chats, cache_file, results = regenerated

    def fail(*args, **kwargs):
        raise AssertionError("generate called despite a complete cache file")
    monkeypatch.setattr(regen_mod, "generate_ids", fail)
    backend = TransformersBackend(model, tokenizer, SETTINGS)
    assert regenerate(backend, chats, SETTINGS.batch_size, cache_file, show_progress=False) == results


def test_regenerate_resumes_a_killed_run(target, regenerated, tmp_path, monkeypatch):
    model, tokenizer, _ = target
    chats, _, reference = regenerated
    cache_file = tmp_path / "answers.jsonl"
    partial = tmp_path / "answers.jsonl.partial"
    # A killed run left two complete lines and a third one cut mid-write.
    cut = json.dumps(asdict(reference[3]))
    partial.write_text(json.dumps(asdict(reference[1])) + "\n" + json.dumps(asdict(reference[4])) + "\n"
                       + cut[:len(cut) // 2])
    calls = []
    monkeypatch.setattr(regen_mod, "generate_ids", recording_generate(calls))
    backend = TransformersBackend(model, tokenizer, SETTINGS)
    assert regenerate(backend, chats, SETTINGS.batch_size, cache_file, show_progress=False) == reference
    first_turns = sorted(ids for batch in calls for ids in batch if ids.count(tokenizer.eos_token_id) == 1)
    assert first_turns == sorted(prompt_ids(tokenizer, chats[i].messages[:1]) for i in (0, 2, 3, 5))
    assert cache_file.exists() and not partial.exists()


def test_regenerate_survives_a_second_kill_after_resuming(target, regenerated, tmp_path, monkeypatch):
    """Lines appended after a cut line must stay readable: a run killed twice loses no finished chunk."""
    model, tokenizer, _ = target
    chats, reference = regenerated[0][:5], regenerated[2][:5]  # single-turn chats: one generate call each
    cache_file = tmp_path / "answers.jsonl"
    partial = tmp_path / "answers.jsonl.partial"
    cut = json.dumps(asdict(reference[2]))
    partial.write_text(json.dumps(asdict(reference[0])) + "\n" + cut[:20])
    backend = TransformersBackend(model, tokenizer, SETTINGS)
    first = []
    monkeypatch.setattr(regen_mod, "generate_ids", recording_generate(first, fail_after=2))
    with pytest.raises(Killed):  # killed again after two more chats
        regenerate(backend, chats, 1, cache_file, show_progress=False)
    assert len(first) == 2 and not cache_file.exists()
    second = []
    monkeypatch.setattr(regen_mod, "generate_ids", recording_generate(second))
    assert regenerate(backend, chats, 1, cache_file, show_progress=False) == reference
    assert len(second) == len(chats) - 3
    assert not {tuple(b[0]) for b in first} & {tuple(b[0]) for b in second}


def test_a_larger_set_borrows_the_answers_a_smaller_cache_with_the_same_settings_holds(target, regenerated, tmp_path,
                                                                                   monkeypatch):
    """A data set that grows (the data-scaling curve, a user adding rows) asks the target only for its new
    conversations: a finished cache made with the same settings key lends the others, matched by what the target
    is asked (a row renumbered by another source keeps its answer; a row whose turns changed does not), and the
    new cache holds every answer, as if answered here. A cache made before settings keys lends once read with
    its key. Another settings key lends nothing."""
    model, tokenizer, _ = target
    chats, _, reference = regenerated
    small = tmp_path / "small.jsonl"
    regenerate(TransformersBackend(model, tokenizer, SETTINGS), chats[:3], SETTINGS.batch_size, small,
               show_progress=False)  # no settings key: an older version's cache
    assert not list(tmp_path.glob("*.settings"))
    regenerate(TransformersBackend(model, tokenizer, SETTINGS), chats[:3], SETTINGS.batch_size, small,
               show_progress=False, settings="same")  # read back: its key recorded
    renumbered = replace(chats[1], source="other.jsonl", row=7)  # the same turns under another name
    changed = replace(chats[2], messages=({"role": "user", "content": "Something else entirely?"},))
    grown = [chats[0], renumbered, changed, chats[3], chats[4]]
    calls = []
    monkeypatch.setattr(regen_mod, "generate_ids", recording_generate(calls))
    backend = TransformersBackend(model, tokenizer, SETTINGS)
    results = regenerate(backend, grown, SETTINGS.batch_size, tmp_path / "grown.jsonl", show_progress=False,
                         settings="same")
    asked = sorted(ids for batch in calls for ids in batch)
    assert asked == sorted(prompt_ids(tokenizer, c.messages[:1]) for c in (changed, chats[3], chats[4]))
    assert results[0] == reference[0] and results[1] == replace(reference[1], source="other.jsonl", row=7)
    assert [r.messages for r in results[3:]] == [r.messages for r in reference[3:5]]
    calls.clear()
    regenerate(backend, chats[:3], SETTINGS.batch_size, tmp_path / "other.jsonl", show_progress=False,
               settings="another")
    assert len(calls) == 2  # nothing borrowed (batches of 2): all three asked


def test_batched_left_padded_generation_equals_per_prompt(target):
    model, tokenizer, _ = target
    texts = ["Hi!", "What did you do over the weekend? I went hiking.",
             "I have been reading a long novel about a family that moves across the country, and every "
             "chapter is told by a different person, which makes it slow but rewarding. Have you read it?"]
    batch = [prompt_ids(tokenizer, t) for t in texts]
    assert len({len(b) for b in batch}) == 3
    settings = GenerationSettings(max_new_tokens=8)
    together = REAL_GENERATE(model, tokenizer, batch, settings, {tokenizer.eos_token_id})
    alone = [REAL_GENERATE(model, tokenizer, [ids], settings, {tokenizer.eos_token_id})[0] for ids in batch]
    assert together == alone
    assert len({tuple(r) for r, _ in together}) > 1  # the outputs depend on the prompt


# ----------------------------------------------------------------------------------------------- hidden states

def test_attach_hidden_states_matches_unpadded_forward(target):
    model, tokenizer, _ = target
    g = torch.Generator().manual_seed(1)
    lengths = [5, 17, 9, 30, 2, 12, 9]
    rows = [{"input_ids": torch.randint(3, model.config.vocab_size, (n,), generator=g),
             "loss_mask": torch.ones(n, dtype=torch.bool), "source": "s", "row": i} for i, n in enumerate(lengths)]
    attach_hidden_states(model, rows, batch_size=3, pad_token_id=tokenizer.pad_token_id, show_progress=False)
    D = model.config.hidden_size
    for r, n in zip(rows, lengths):
        h = r["hidden_states"]
        assert h.shape == (n, D) and h.dtype == torch.float32 and h.device.type == "cpu"
        with torch.no_grad():
            expected = model.base_model(input_ids=r["input_ids"][None]).last_hidden_state[0]
        torch.testing.assert_close(h, expected, atol=1e-5, rtol=0)
