"""Data from files real users bring: formats, bad rows (lenient and strict), mixtures, the regeneration CLI's
accounting and the OpenAI-compatible server backend (a local fake server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from draftheads.data.conversations import BadRow, Chat, load_chats
from draftheads.data.generation import GenerationSettings
from draftheads.data.pipeline import self_distilled_rows
from draftheads.data.regenerate import OpenAIBackend, answer_turns
from draftheads.data.sources import PromptSource
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from draftheads.drafters import register_configs
from draftheads.training.config import DataConfig
from tests.helpers import CONF, launch_cmd, launch_env

register_configs()

GOOD = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                  {"role": "assistant", "content": "Hello."}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."},
                       {"from": "human", "value": "Another?"}, {"from": "gpt", "value": "Red."}]},
    {"messages": [{"role": "user", "content": "Count."}, {"role": "user", "content": "To three."},
                  {"role": "assistant", "content": "1 2 3"}, {"role": "assistant", "content": ""}]},
    {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 1, 1, 1]},
]
BAD = {  # reason -> the line that must be skipped for it
    "invalid_json": b'{"messages": [',
    "invalid_utf8": b'{"prompt": "caf\xe9"}',
    "missing_role": json.dumps({"messages": [{"content": "who am I?"}]}).encode(),
    "unknown_role": json.dumps({"messages": [{"role": "wizard", "content": "abracadabra"}]}).encode(),
    "non_string_content": json.dumps({"messages": [{"role": "user", "content": ["a", "list"]}]}).encode(),
    "empty_conversation": json.dumps({"messages": [{"role": "user", "content": "  "}]}).encode(),
    "no_assistant_turn": json.dumps({"messages": [{"role": "user", "content": "nobody answers"}]}).encode(),
    "too_long": json.dumps({"messages": [{"role": "user", "content": "long " * 200},
                                         {"role": "assistant", "content": "ok"}]}).encode(),
    "assistant_first": json.dumps({"messages": [{"role": "assistant", "content": "Welcome!"},
                                                {"role": "user", "content": "Thanks."},
                                                {"role": "assistant", "content": "Anytime."}]}).encode(),
    "bad_unfinished": json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Yo"}],
                                  "unfinished": [0]}).encode(),  # a user turn cannot be an unfinished answer
    "failed_regeneration": json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                       "error": "turn 0: APITimeoutError"}).encode(),
}
EXPECTED_FIELD = {"invalid_json": "<line>", "invalid_utf8": "<line>", "missing_role": "messages[0].role",
                  "unknown_role": "messages[0].role", "non_string_content": "messages[0].content",
                  "empty_conversation": "messages", "assistant_first": "messages", "bad_unfinished": "unfinished",
                  "failed_regeneration": "error"}


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def data_cfg(path, **overrides) -> DataConfig:
    base = {"source": "jsonl", "path": path and str(path), "num_train_prompts": 100, "num_val_prompts": 1,
            "max_length": 64, "overlong": "drop", "regenerate": False}
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), {**base, **overrides}))


@pytest.fixture
def mixed_file(tmp_path):
    """The good rows, every bad row, then one more good row (held out for validation)."""
    lines = [json.dumps(r).encode() for r in GOOD] + list(BAD.values()) + [json.dumps(GOOD[0]).encode()]
    return write_jsonl(tmp_path / "mixed.jsonl", lines)


def test_every_format_normalises_to_one_conversation_shape(mixed_file):
    chats = load_chats(PromptSource("jsonl", str(mixed_file)), "train", 4)
    assert [m["role"] for m in chats[0].messages] == ["system", "user", "assistant"]
    assert [m["role"] for m in chats[1].messages] == ["user", "assistant", "user", "assistant"]
    assert chats[2].messages == ({"role": "user", "content": "Count.\n\nTo three."},
                                 {"role": "assistant", "content": "1 2 3"})  # merged, empty turn dropped
    assert chats[3].tokens == ((5, 6, 7, 8, 9), (False, False, True, True, True))
    assert [c.row for c in chats] == [0, 1, 2, 3]


def test_lenient_mode_skips_and_counts_every_bad_row_and_loses_no_good_one(tiny, mixed_file):
    model, tokenizer = tiny
    train, val, report = self_distilled_rows(data_cfg(mixed_file), model, tokenizer, {}, "/unused", False)
    assert report.rows_in == len(GOOD) + len(BAD) + 1
    assert report.skipped == dict.fromkeys(BAD, 1)
    assert report.rows_out == len(train) + len(val) == len(GOOD) + 1
    assert report.rows_in == report.rows_out + sum(report.skipped.values()) + report.failed
    assert [r["row"] for r in val] == [len(GOOD) + len(BAD)]  # the last usable row is held out
    for reason, field in EXPECTED_FIELD.items():
        assert f"field {field!r}" in report.examples[reason]
    assert str(mixed_file) in report.examples["unknown_role"] and "row 4 (line 5)" in report.examples["invalid_json"]
    described = report.describe()
    assert f"{len(GOOD) + len(BAD) + 1} rows in -> 5 out" in described and "unknown_role 1" in described


@pytest.mark.parametrize("reason", ["invalid_json", "invalid_utf8", "unknown_role", "non_string_content",
                                    "empty_conversation", "missing_role", "assistant_first", "bad_unfinished",
                                    "failed_regeneration"])
def test_strict_mode_fails_on_the_first_bad_row_naming_file_line_and_field(tmp_path, reason):
    path = write_jsonl(tmp_path / "bad.jsonl", [json.dumps(GOOD[0]).encode(), BAD[reason]])
    with pytest.raises(BadRow) as err:
        load_chats(PromptSource("jsonl", str(path)), "train", 10, strict=True)
    assert (str(err.value).startswith(f"{path} row 1 (line 2): field {EXPECTED_FIELD[reason]!r}")
            and err.value.reason == reason)


@pytest.mark.parametrize("row, field", [
    ({"messages": [{"role": "user", "content": "an emoji cut in half: \ud83d"},
                   {"role": "assistant", "content": "ok"}]},
     "messages[0].content"),
    ({"prompt": "half an emoji \ud83d here"}, "prompt"),
])
def test_text_with_a_lone_surrogate_is_skipped_naming_the_field(tiny, tmp_path, row, field):
    """JSON can hold half a UTF-16 pair ("\\ud83d"); no tokenizer encodes it: a counted skip, not a crash."""
    model, tokenizer = tiny
    path = write_jsonl(tmp_path / "surrogate.jsonl", [json.dumps(row).encode()] + [json.dumps(GOOD[0]).encode()] * 2)
    train, val, report = self_distilled_rows(data_cfg(path), model, tokenizer, {}, "/unused", False)
    assert report.skipped == {"invalid_utf8": 1} and len(train) + len(val) == 2
    assert f"field {field!r}" in report.examples["invalid_utf8"] and "lone surrogate" in report.examples["invalid_utf8"]


def test_over_long_rows_are_truncated_by_default(tiny, tmp_path):
    model, tokenizer = tiny
    long_answer = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 300}]}
    path = write_jsonl(tmp_path / "long.jsonl", [json.dumps(long_answer).encode(), json.dumps(GOOD[0]).encode()])
    cfg = data_cfg(path, overlong="truncate", max_length=400)
    train, _, report = self_distilled_rows(cfg, model, tokenizer, {}, "/unused", False)
    assert report.truncated == 1 and len(train[0]["input_ids"]) == 400 and not report.skipped


def test_a_dataset_with_nothing_to_train_on_is_an_error(tiny, tmp_path):
    model, tokenizer = tiny
    path = write_jsonl(tmp_path / "none.jsonl", [BAD["no_assistant_turn"]] * 3 + [json.dumps(GOOD[0]).encode()])
    with pytest.raises(ValueError, match="nothing left to train on"):
        self_distilled_rows(data_cfg(path), model, tokenizer, {}, "/unused", False)


def test_mixtures_draw_rows_in_proportion_to_their_weights(tiny, tmp_path):
    model, tokenizer = tiny
    a = write_jsonl(tmp_path / "a.jsonl", [json.dumps(GOOD[0]).encode()] * 20)
    b = write_jsonl(tmp_path / "b.jsonl", [json.dumps(GOOD[1]).encode()] * 20)
    cfg = data_cfg(None, source="chitchat", num_train_prompts=12, num_val_prompts=4,  # no source of its own
                   mixture=[{"source": "jsonl", "path": str(a), "weight": 3}, {"source": "jsonl", "path": str(b)}])
    train, val, report = self_distilled_rows(cfg, model, tokenizer, {}, "/unused", False)
    assert [r["source"] for r in train] == [str(a)] * 9 + [str(b)] * 3
    assert [r["source"] for r in val] == [str(a)] * 3 + [str(b)]
    assert report.rows_in == 16


# ----------------------------------------------------------------------------------------------- server backend

class FakeServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat-completions endpoint: answers "echo: <last user turn>"; "flaky" fails with 500
    once, "broken" always (while ``broken`` is set); a turn starting with "think" also gets reasoning_content.
    ``last_body`` is the last request."""
    seen: dict[str, int] = {}
    broken = True
    last_body: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.last_body = body
        last = body["messages"][-1]["content"]
        FakeServer.seen[last] = FakeServer.seen.get(last, 0) + 1
        if (last == "flaky" and FakeServer.seen[last] == 1) or (last == "broken" and FakeServer.broken):
            self.send_response(500)
            self.end_headers()
            return
        message = {"role": "assistant", "content": f"echo: {last}"}
        if last.startswith("think"):  # a reasoning model: its reasoning apart from the answer (vLLM, SGLang)
            message["reasoning_content"] = f"pondering {last}"
        reply = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop" if len(last) < 40 else "length",
                              "message": message}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    FakeServer.seen, FakeServer.broken = {}, True
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_server_backend_answers_turn_by_turn_retries_and_reports_failures(server, tmp_path):
    backend = OpenAIBackend(server, "m", GenerationSettings(), concurrency=4, max_retries=1)
    two_turns = {"messages": [{"role": "user", "content": "one"}, {"role": "assistant", "content": "dataset's"},
                              {"role": "user", "content": "two"}]}
    rows = [two_turns, {"prompt": "flaky"}, {"prompt": "broken"},
            {"prompt": "a prompt that is longer than forty characters"}]
    path = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(r).encode() for r in rows])
    chats = load_chats(PromptSource("jsonl", str(path)), "train", 10)
    results = answer_turns(backend, chats)
    assert results[0].messages == [{"role": "user", "content": "one"}, {"role": "assistant", "content": "echo: one"},
                                   {"role": "user", "content": "two"}, {"role": "assistant", "content": "echo: two"}]
    assert results[1].messages[-1]["content"] == "echo: flaky" and FakeServer.seen["flaky"] == 2  # retried
    assert results[2].error.startswith("turn 0: InternalServerError") and FakeServer.seen["broken"] == 2
    long_prompt = results[3].messages[0]["content"]
    assert results[3].unfinished == [1] and results[3].messages[1]["content"] == f"echo: {long_prompt}"


def test_server_backend_sends_every_sampling_field_a_server_could_take_from_generation_config(server):
    """vLLM's default --generation-config auto fills every sampling field a request leaves out from the model's
    generation_config.json (a repetition_penalty, top_k): each is sent, so the server decodes as configured."""
    settings = GenerationSettings(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=5, seed=3)
    answer_turns(OpenAIBackend(server, "m", settings, max_retries=0),
                 [Chat("t", 0, ({"role": "user", "content": "x"},))])
    sent = {k: FakeServer.last_body.get(k) for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                                                     "presence_penalty", "frequency_penalty", "max_tokens", "seed")}
    assert sent == {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 5, "seed": 3}
    answer_turns(OpenAIBackend(server, "m", GenerationSettings(), max_retries=0),
                 [Chat("t", 0, ({"role": "user", "content": "x"},))])
    assert FakeServer.last_body["top_k"] == -1 and FakeServer.last_body["temperature"] == 0.0  # -1: top-k off


@pytest.mark.parametrize("thinking, sent", [(None, None), (True, {"enable_thinking": True}),
                                            (False, {"enable_thinking": False})])
def test_server_backend_sends_each_rows_thinking_mode_to_the_servers_chat_template(server, thinking, sent):
    """``data.thinking_fraction``'s per-row mode reaches the server's chat template (vLLM and SGLang read
    ``chat_template_kwargs``); the template's default sends none, as before."""
    answer_turns(OpenAIBackend(server, "m", GenerationSettings(), max_retries=0),
                 [Chat("t", 0, ({"role": "user", "content": "x"},), thinking=thinking)])
    assert FakeServer.last_body.get("chat_template_kwargs") == sent


@pytest.mark.parametrize("mode, template, turn", [
    ("inline", None, {"content": "<think>\npondering think twice\n</think>\n\necho: think twice"}),
    ("field", None, {"content": "echo: think twice", "reasoning_content": "pondering think twice"}),
    ("drop", None, {"content": "echo: think twice"}),
    ("auto", "{% if '</think>' in message.content %}{% endif %}",
     {"content": "<think>\npondering think twice\n</think>\n\necho: think twice"}),
    ("auto", "{{ message.reasoning_content }}", {"content": "echo: think twice",
                                                   "reasoning_content": "pondering think twice"}),
])
def test_a_reasoning_models_reasoning_is_kept_where_the_template_renders_it(server, mode, template, turn):
    """Servers return a reasoning model's reasoning apart from the answer; it is trained and carried into the next
    turn's history as the template renders it (data.reasoning), not dropped."""
    from draftheads.data.regenerate import Reasoning, resolve_reasoning
    reasoning = resolve_reasoning(Reasoning(mode), template)
    backend = OpenAIBackend(server, "m", GenerationSettings(), max_retries=0, reasoning=reasoning)
    chat = Chat("test", 0, messages=({"role": "user", "content": "think twice"}, {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "next"}))
    (result,) = answer_turns(backend, [chat])
    assert result.messages[1] == {"role": "assistant", **turn}  # trained, and the history of the next turn
    assert result.messages[3] == {"role": "assistant", "content": "echo: next"}
    assert backend.name == f"openai+reasoning-{reasoning}"  # another mode never reads this mode's cache


def test_regenerate_cli_accounts_for_every_row_and_resumes(server, tmp_path, cache_dir):
    """written + failed + skipped == read; a rerun retries only the failed rows and completes the output."""
    from draftheads.jobs.regenerate import regenerate_data as run
    lines = [json.dumps({"messages": [{"role": "user", "content": t}]}).encode() for t in ("a", "broken", "c")]
    source = write_jsonl(tmp_path / "in.jsonl", lines + [BAD["unknown_role"], BAD["invalid_json"]])
    out = tmp_path / "out.jsonl"
    overrides = ["model=tiny", f"cache_dir={cache_dir}", "data.source=jsonl", f"data.path={source}",
                 f"data.server.base_url={server}", "data.server.max_retries=0", f"output={out}"]
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("regenerate", overrides=overrides)
    assert run(cfg) == {"read": 5, "written": 2, "failed": 1, "skipped": 2}
    assert not out.exists()  # written once every row succeeded
    FakeServer.broken = False
    calls_before = dict(FakeServer.seen)
    assert run(cfg) == {"read": 5, "written": 3, "failed": 0, "skipped": 2}
    assert FakeServer.seen["a"] == calls_before["a"] and FakeServer.seen["broken"] == calls_before["broken"] + 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"][-1]["content"] for r in rows] == ["echo: a", "echo: broken", "echo: c"]
    with initialize_config_dir(config_dir=CONF, version_base=None):  # other settings never mix into this output
        other = compose("regenerate", overrides=overrides + ["data.generation.max_new_tokens=5"])
    with pytest.raises(ValueError, match="was made from other data, target or generation settings"):
        run(other)


def test_chat_template_option_takes_jinja_text_or_a_file(tmp_path, cache_dir):
    from draftheads.models.target import TINY, TargetSpec, load_tokenizer
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = tmp_path / "template"
    path.write_text(template)
    for value in (template, str(path)):
        tokenizer, _ = load_tokenizer(TargetSpec(name_or_path=TINY, chat_template=value), cache_dir)
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>hi"
    with pytest.raises(FileNotFoundError, match="model.chat_template='/no/such/template' is neither"):
        load_tokenizer(TargetSpec(name_or_path=TINY, chat_template="/no/such/template"), cache_dir)


@pytest.mark.slow
def test_two_ranks_share_the_regeneration_and_match_one_process(tmp_path):
    """accelerate launch with 2 processes: each rank answers its share, rank 0 merges; the cached answers
    equal those of a 1-process run with its own cache (greedy, so the same)."""
    import subprocess
    files, logs = {}, {}
    for procs, name in ((["--multi_gpu", "--num_processes", "2"], "two"), (["--num_processes", "1"], "one")):
        cache = tmp_path / f"cache_{name}"
        cmd = launch_cmd("medusa", procs, "+experiment=smoke", "stage1.max_steps=1", "stage2.enabled=false",
                         "eval.enabled=false", "export=false", f"output_dir={tmp_path / name}")
        proc = subprocess.run(cmd, env=launch_env(cache), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (files[name],) = (cache / "regenerated").glob("*.jsonl")
        logs[name] = proc.stdout
        assert not list((cache / "regenerated").glob("*.partial*"))  # merged and cleaned up
    assert "[rank 0] answered 28 conversations" in logs["two"] and "[rank 1] answered 28 conversations" in logs["two"]
    assert files["two"].name == files["one"].name  # the same cache key
    assert files["two"].read_text() == files["one"].read_text()


def test_a_regenerated_file_trains_exactly_what_the_regenerating_job_trains(tiny, tmp_path):
    """train/regenerate.py's file read back as training data (``data.regenerate=false``) trains each answer's ids
    as the target generated them, and no end-of-turn token after an answer its token budget cut: the rows of the
    in-job path, token for token and mask for mask."""
    from draftheads.data.batching import DataReport, rows_from_chats
    from draftheads.data.regenerate import TransformersBackend, regenerate
    model, tokenizer = tiny
    chats = [Chat("test", i, ({"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}?"},
                              {"role": "assistant", "content": "x"}, {"role": "user", "content": "And then?"}))
             for i in range(4)]
    answered = regenerate(TransformersBackend(model, tokenizer, GenerationSettings(max_new_tokens=6)), chats, 8,
                          tmp_path / "answers.jsonl", show_progress=False)
    in_job = rows_from_chats(tokenizer, answered, 512, DataReport())
    train, val, report = self_distilled_rows(data_cfg(tmp_path / "answers.jsonl", max_length=512), model, tokenizer,
                                             {}, "/unused", False)
    assert report.unfinished_answers == sum(len(r.unfinished) for r in answered) > 0
    for key in ("input_ids", "loss_mask"):
        assert [r[key].tolist() for r in train + val] == [r[key].tolist() for r in in_job]


def test_too_long_and_no_assistant_turn_name_the_row_as_every_other_reason_does(tiny, tmp_path):
    """Issue 52 row 16: these two gave a 0-based row and no line, unlike the rows read_jsonl names."""
    model, tokenizer = tiny
    long_answer = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 300}]}
    path = write_jsonl(tmp_path / "rows.jsonl", [json.dumps(GOOD[0]).encode(), json.dumps(long_answer).encode(),
                                                 BAD["no_assistant_turn"], json.dumps(GOOD[0]).encode(),
                                                 json.dumps(GOOD[0]).encode()])
    _, _, report = self_distilled_rows(data_cfg(path), model, tokenizer, {}, "/unused", False)
    assert report.examples["too_long"].startswith(f"{path} row 1 (line 2): ")
    assert report.examples["no_assistant_turn"].startswith(f"{path} row 2 (line 3): ")


@pytest.mark.parametrize("row", [{"system": "Answer in French.", "prompt": "Hello there"},
                                 {"system_prompt": "Answer in French.", "instruction": "Hello there"},
                                 {"system": "Answer in French.",
                                  "conversations": [{"from": "human", "value": "Hello there"},
                                                    {"from": "gpt", "value": "Bonjour"}]}])
def test_a_row_level_system_prompt_leads_the_conversation_in_every_format(tmp_path, row):
    """Issue 52 row 16: a row's system prompt held beside its prompt or turns was dropped (the evaluator then
    measured the prompt without it)."""
    path = write_jsonl(tmp_path / "eval.jsonl", [json.dumps(row).encode()])
    (chat,) = load_chats(PromptSource("jsonl", str(path)), "eval", 1, strict=True)
    assert chat.messages[0] == {"role": "system", "content": "Answer in French."}
    assert chat.messages[1] == {"role": "user", "content": "Hello there"}
    both = {**row, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    with pytest.raises(BadRow, match="system_prompt|system"):
        load_chats(PromptSource("jsonl", str(write_jsonl(tmp_path / "both.jsonl", [json.dumps(both).encode()]))),
                   "eval", 1, strict=True)


@pytest.mark.parametrize("output", ["/dev/full", "folder"])
def test_regenerating_into_something_that_is_no_file_is_refused_before_the_target_loads(tmp_path, cache_dir,
                                                                                       monkeypatch, output):
    """Issue 52 row 10: output=/dev/full blamed "other data" and advised deleting /dev/full."""
    from draftheads.jobs import regenerate
    if output == "/dev/full" and not Path(output).exists():
        pytest.skip("no /dev/full here")
    out = Path(output) if output.startswith("/") else tmp_path / output
    out.mkdir(exist_ok=True) if output == "folder" else None
    monkeypatch.setattr(regenerate, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    with initialize_config_dir(config_dir=CONF, version_base=None):
        cfg = compose("regenerate", overrides=["model=tiny", f"cache_dir={cache_dir}", f"output={out}"])
    with pytest.raises(ValueError, match=rf"output={out} is not a regular file .* name the .jsonl file"):
        regenerate.regenerate_data(cfg)


@pytest.mark.parametrize("ceiling, stops", [(0.01, True), (0.5, False)])
def test_regeneration_stops_past_its_failed_fraction_naming_the_rows(server, tiny, tmp_path, ceiling, stops):
    """Issue 53: the rows the regeneration failed on were dropped with no ceiling (1 of 3 here)."""
    model, tokenizer = tiny
    rows = [{"prompt": "a"}, {"prompt": "broken"}, {"prompt": "c"}, {"prompt": "d"}]
    path = write_jsonl(tmp_path / "chats.jsonl", [json.dumps(r).encode() for r in rows])
    cfg = data_cfg(path, num_val_prompts=1, max_failed_fraction=ceiling, max_length=256, regenerate=True,
                   server={"base_url": server, "max_retries": 0})
    run = lambda: self_distilled_rows(cfg, model, tokenizer, {}, tmp_path / "cache", False)  # noqa: E731
    if stops:
        with pytest.raises(RuntimeError, match=rf"failed on 1 of 4 conversations \(25.0% > data.max_failed_fraction="
                                               rf"0.01\): {path} row 1 \(line 2\): turn 0: InternalServerError"):
            run()
    else:
        train, val, report = run()
        assert report.failed == 1 and len(train) + len(val) == 3
