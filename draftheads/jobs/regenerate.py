"""Answer a dataset's user turns with the target itself, turn by turn, into a JSONL file (self-distillation),
every input row accounted for, resumable, and tied to its inputs."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

from draftheads.data.batching import DataReport
from draftheads.data.pipeline import make_backend, read_chats, with_thinking
from draftheads.data.regenerate import cache_key, regenerate
from draftheads.models.target import load_generation_config, load_target, load_tokenizer
from draftheads.serving.vllm_env import ensure_vllm
from draftheads.training.config import RegenerateConfig, apply_generation_defaults, to_schema


def regenerate_data(cfg: DictConfig) -> dict[str, int]:
    """Regenerate ``cfg.data`` into ``cfg.output``; returns the accounting (read, written, failed, skipped)."""
    conf: RegenerateConfig = to_schema(cfg)
    check_output(Path(conf.output))  # before the target loads
    if conf.data.server.base_url:  # the server answers: only the tokenizer (chat template) is needed here
        target, (tokenizer, path) = None, load_tokenizer(conf.model, conf.cache_dir)
    else:
        target, tokenizer, path = load_target(conf.model, conf.cache_dir)
    apply_generation_defaults(conf, target.generation_config if target is not None else
                              load_generation_config(conf.model, conf.cache_dir))
    report = DataReport()
    chats = read_chats(conf.data, tokenizer, report, "train", conf.limit if conf.limit is not None else 2 ** 62)
    tokenized = [c for c in chats if c.tokens is not None]
    for c in tokenized:
        report.skip("tokenized_row", f"{c.where}: pre-tokenised rows cannot be regenerated")
    chats = with_thinking([c for c in chats if c.tokens is None], conf.data.thinking_fraction,
                          conf.data.generation.seed, tokenizer)  # each row's mode, written with it
    backend = make_backend(conf.data, target, tokenizer, lambda: (ensure_vllm(conf.vllm.venv), path,
                                                                     conf.vllm.engine()))
    reused = claim_output(conf, chats, backend.name, tokenizer.chat_template)
    results = regenerate(backend, chats, conf.data.generation.batch_size, conf.output)
    failed = [r for r in results if r.error]
    counts = {"read": report.rows_in, "written": len(results) - len(failed), "failed": len(failed),
              "skipped": sum(report.skipped.values())}
    if counts["written"] + counts["failed"] + counts["skipped"] != counts["read"]:
        raise RuntimeError(f"rows lost between reading and writing: {counts}")
    print(f"target: {path}\nregenerated {conf.output}: {counts['read']} read = {counts['written']} written + "
          f"{counts['failed']} failed + {counts['skipped']} skipped "
          f"({', '.join(f'{k} {v}' for k, v in sorted(report.skipped.items())) or 'none skipped'})")
    if reused:
        print(f"  {conf.output} was already complete for this data, target and settings: reused, nothing generated")
    for reason, example in report.examples.items():
        print(f"  first {reason}: {example}")
    for r in failed[:5]:
        print(f"  failed {r.source} row {r.row}: {r.error}")
    if failed:
        print(f"  {conf.output} is written once every row succeeds: run again to retry the {len(failed)} failed "
              f"(the {counts['written']} answered are kept in {conf.output}.partial)")
    return counts


def check_output(out: Path) -> None:
    """``ValueError`` for an ``output`` that is there but not a regular file (a folder, ``/dev/full``, a socket),
    ``OSError`` naming it for a folder this job cannot write its answers, ``.partial`` and ``.key`` into: before
    the target loads or any answer is generated."""
    if out.exists() and not out.is_file():
        raise ValueError(f"output={out} is not a regular file (a folder or a device): name the .jsonl file to write, "
                         f"e.g. output=answers.jsonl")
    probe = out.with_name(f".write-probe-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"output={out}: cannot write beside it in {out.parent} ({e.strerror}): choose a "
                               f"writable folder") from e


def claim_output(conf: RegenerateConfig, chats: list, backend: str, chat_template: str | None) -> bool:
    """Tie ``output`` to what produced it through ``<output>.key`` (a hash of the conversations, target,
    template, generation settings and backend): a rerun with the same inputs resumes or reuses it, one with
    other inputs is refused instead of mixing answers. Returns whether the output is already complete."""
    out = Path(conf.output)
    target = {"name_or_path": conf.model.name_or_path, "revision": conf.model.revision, "dtype": conf.model.dtype,
              "server_model": conf.data.server.model if conf.data.server.base_url else None}
    key = cache_key(target, chats, conf.data.generation, backend, chat_template)
    marker = out.with_name(out.name + ".key")
    partial = out.with_name(out.name + ".partial")
    made_by = marker.read_text() if marker.exists() else None
    if made_by != key and (made_by is not None or out.exists() or partial.exists()):
        raise ValueError(f"{out} was made from other data, target or generation settings (or by an unknown run): "
                         f"choose another output, or delete {out}, {partial} and {marker}")
    out.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(key)
    return out.exists()
