"""Our evaluator and vLLM side by side, greedy, on a run's held-out prompts: what the export does when served.

    python train/vllm_parity.py runs/medusa                 # the Medusa export (export/vllm) as vLLM serves it
    python train/vllm_parity.py runs/dflash serve=true      # the DFlash export, also through the OpenAI server
    python train/vllm_parity.py runs/medusa vllm_venv=/opt/vllm eval.max_new_tokens=64

Both sides decode the same prompt token ids greedily with the same drafter: our chain evaluator with the
export read back by its strict loader, and vLLM's CPU build (offline ``LLM`` API; with ``serve=true`` also
its OpenAI server queried with the openai client). Medusa in vLLM proposes top-1 chains, so it is compared with
our Medusa chain (not the tree); DFlash drafts block size - 1 tokens in one pass on both sides.

Printed per eval set: output agreement (token-identical; the server's answers as text), tau = 1 + accepted /
drafts (accepted drafts counted before the token budget cuts them, as vLLM counts), and per-position acceptance
(accepted at position i / drafts). Parity holds when every output agrees and tau differs by at most
``tolerance`` (0.02: float32 kernels differ between vLLM and PyTorch, and a flipped near-tie changes one
acceptance, ~0.004 of tau over a 250-draft set). Exits 1 when it does not.

The vLLM environment is made on first use at ``$DRAFTHEADS_CACHE/vllm-venv`` (``vllm_venv=`` to choose):
vLLM pins its own transformers, so it never shares ours; the wheels it pulls that do not import beside the CPU
torch build (torchvision, torchaudio, torchcodec) are removed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from train.vllm_env import VLLM, ensure_vllm

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.02


def load(run_dir: Path, overrides: list[str]):
    """``(method, target folder, vLLM speculative config, eval config, target, tokenizer, chain drafter)`` of a
    finished run, the drafter read from the export vLLM loads."""
    from models.target import resolve_target_path
    if (run_dir / "export" / "dflash").exists():
        from models.dflash import DFlashDrafter
        from train.dflash import load_saved_run
        conf, target, tokenizer, model = load_saved_run(run_dir, overrides)
        spec = {"method": "dflash", "model": str((run_dir / "export" / "dflash").resolve()),
                "num_speculative_tokens": model.block_size - 1}
        return ("dflash", resolve_target_path(conf.model, conf.cache_dir), spec, conf.eval, target, tokenizer,
                DFlashDrafter(model))
    from models.speculative import MedusaDrafter
    from train.finish import load_saved_run
    conf, target, tokenizer, heads, extra = load_saved_run(run_dir, overrides, "export/vllm")
    spec = {"method": "medusa", "model": str((run_dir / "export" / "vllm").resolve()),
            "num_speculative_tokens": heads.num_heads}
    return ("medusa_chain", extra["base_model"], spec, conf.eval, target, tokenizer,
            MedusaDrafter(heads, target.get_output_embeddings()))


def our_side(target, tokenizer, drafter, prompt_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Our chain decoding of every prompt: outputs and vLLM-style counters."""
    from models.speculative import speculative_decode
    outputs, steps = [], []
    device = next(target.parameters()).device
    for ids in prompt_ids:
        r = speculative_decode(target, drafter, torch.tensor(ids, device=device), max_new_tokens,
                               tokenizer.eos_token_id)
        outputs.append(r.tokens)
        steps += r.accepted_per_step
    return {"outputs": outputs, "metrics": {
        "drafts": len(steps), "accepted": sum(steps),
        "accepted_per_pos": [sum(n > i for n in steps) for i in range(drafter.gamma)]}}


def run_vllm(python: Path, job: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
        subprocess.run([python, str(ROOT / "train" / "vllm_runner.py"), str(job_file), str(result_file)], env=env,
                       check=True, stdout=sys.stderr)
        return json.loads(result_file.read_text())


def acceptance(metrics: dict) -> tuple[float, list[float]]:
    """tau = 1 + accepted / drafts, and accepted at each position / drafts."""
    drafts = max(metrics.get("drafts", 0), 1)
    return 1 + metrics.get("accepted", 0) / drafts, [a / drafts for a in metrics.get("accepted_per_pos", [])]


def compare(name: str, ours: dict, theirs: dict, decode=None) -> dict:
    """One row of the parity table; ``decode`` turns our token ids into text (the server answers in text)."""
    mine = [decode(o) for o in ours["outputs"]] if decode else ours["outputs"]
    same = sum(a == b for a, b in zip(mine, theirs["outputs"])) / len(mine)
    (tau_ours, pos_ours), (tau_vllm, pos_vllm) = acceptance(ours["metrics"]), acceptance(theirs["metrics"])
    return {"set": name, "identical": same, "tau_ours": tau_ours, "tau_vllm": tau_vllm,
            "per_position_ours": pos_ours, "per_position_vllm": pos_vllm, "drafts_ours": ours["metrics"]["drafts"],
            "drafts_vllm": theirs["metrics"].get("drafts", 0),
            "parity": same == 1.0 and abs(tau_ours - tau_vllm) <= TOLERANCE}


def main(argv: list[str]) -> list[dict]:
    from data.regenerate import prompt_ids
    from train.finish import load_eval_sets
    from train.evaluate import parse_args
    run_dir, options, rest = parse_args(argv, ("vllm_venv", "serve"), __doc__)
    cache = Path(os.environ.get("DRAFTHEADS_CACHE", Path.home() / ".cache" / "draftheads")).expanduser()
    python = ensure_vllm(Path(options.get("vllm_venv", cache / "vllm-venv")))
    method, target_path, spec, eval_cfg, target, tokenizer, drafter = load(run_dir, rest)
    rows = []
    for name, prompts in load_eval_sets(dataclasses.replace(eval_cfg, enabled=True)).items():
        ids = [prompt_ids(tokenizer, p.text) for p in prompts]
        ours = our_side(target, tokenizer, drafter, ids, eval_cfg.max_new_tokens)
        job = {"target": str(target_path), "speculative_config": spec, "prompts": ids, "max_tokens":
               eval_cfg.max_new_tokens, "messages": [[{"role": "user", "content": p.text}] for p in prompts],
               "port": 8011}
        rows.append({"mode": "offline", **compare(name, ours, run_vllm(python, {**job, "mode": "offline"}))})
        if options.get("serve", "false").lower() == "true":
            served = run_vllm(python, {**job, "mode": "serve"})
            rows.append({"mode": "serve", **compare(name, ours, served,
                                                    lambda t: tokenizer.decode(t, skip_special_tokens=True))})
    print(f"\n{method} in vLLM ({VLLM}) vs draftheads, greedy, {eval_cfg.max_new_tokens} new tokens; "
          f"parity: identical outputs and |tau difference| <= {TOLERANCE}")
    print(f"{'set':<12}{'vLLM via':<10}{'identical':>10}{'tau ours':>10}{'tau vLLM':>10}  per-position (ours | vLLM)")
    for r in rows:
        pos = " ".join(f"{a:.2f}" for a in r["per_position_ours"][:5]) + " | " + \
              " ".join(f"{b:.2f}" for b in r["per_position_vllm"][:5])
        print(f"{r['set']:<12}{r['mode']:<10}{r['identical']:>10.2f}{r['tau_ours']:>10.3f}{r['tau_vllm']:>10.3f}  {pos}"
              f"{'' if r['parity'] else '   <- NO PARITY'}")
    (run_dir / "vllm_parity.json").write_text(json.dumps({"method": method, "vllm": VLLM, "rows": rows}, indent=1))
    if not all(r["parity"] for r in rows):
        raise SystemExit(1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
