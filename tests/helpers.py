"""Pieces several test modules share (no test module imports another): the repository's config folder and the
smoke job's settings, the training jobs as functions, a stub drafter base, a real 2-process launch under any
engine, a packed step checked against the padded one, and the chi-square test of lossless sampling."""

import json
import math
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import pytest
import torch
from draftheads.data.batching import collate, pack
from draftheads.data.hidden_states import attach_hidden_states
from draftheads.data.templates import stop_token_ids
from draftheads.models.speculative import Sampling
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from draftheads.drafters import register_configs
from draftheads.runs.life import train

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
SMOKE_STAGES = ["stage1.epochs=4", "stage2.epochs=1", "stage2.unfreeze_last_n_layers=2"]
"""Medusa smoke stages: enough steps on the tiny target for the loss to fall and stage 2 to change layers."""

register_configs()
run_medusa = partial(train, "medusa")
run_dflash = partial(train, "dflash")
run_eagle3 = partial(train, "eagle3")


VLLM_VENV = os.environ.get("DRAFTHEADS_VLLM_VENV")
"""vLLM's environment for the tests that run vLLM (skipped without it)."""
VLLM_TINY = ["model.tiny.hidden_size=128", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=1",
             "model.tiny.intermediate_size=256"]
"""The smoke target as vLLM's CPU attention takes it (head_dim >= 32; the smoke target has 16)."""


SHORT = {
    "medusa": ("stage1.epochs=1", "stage2.epochs=0.5", "stage2.unfreeze_last_n_layers=1"),
    "dflash": ("train.epochs=1", "dflash.block_size=8", "eval.peer_runs=[]"),
    "dspark": ("train.epochs=1", "eval.peer_runs=[]"),
    "dflash2": ("train.epochs=1", "dflash2.selector_rank=16", "dflash2.selector_top_k=8", "eval.peer_runs=[]"),
    # a draft vocabulary under the target's: the d2t map is trained and exported
    "eagle3": ("train.epochs=1", "eagle3.ttt_steps=2", "eagle3.gamma=3", "eagle3.draft_vocab_size=256",
               "eval.peer_runs=[]"),
}
"""Per registered drafter, the Hydra overrides that make its job short on a tiny target: every stage for an epoch
or less, its own sizes small, peer runs (which such a run has not made) off. The tests over every drafter run its
job with these and only keys every job declares; a new drafter adds its line here
(``tests/jobs/test_every_drafter.py`` fails naming a registered drafter without one)."""


def short_settings(job: str) -> tuple[str, ...]:
    """:data:`SHORT` for ``job``; ``KeyError`` naming what to add for a registered drafter without a line."""
    if job not in SHORT:
        raise KeyError(f"{job}: registered, but tests/helpers.py SHORT has no short settings for it; add them")
    return SHORT[job]


def smoke(job: str, output_dir, cache_dir, *overrides: str):
    """``job``'s config with ``+experiment=smoke`` (tiny target, no tracker), the run in ``output_dir``."""
    with initialize_config_dir(config_dir=CONF, version_base=None):
        return compose(job, overrides=["+experiment=smoke", f"output_dir={output_dir}", f"cache_dir={cache_dir}",
                                       *overrides])


class StubDrafter:
    """The ChainDrafter protocol's bookkeeping for test drafters that read only the last hidden state;
    subclasses set ``gamma`` and define ``draft_logits``."""
    name, target_layer_ids = "test", ()

    def start(self) -> None:
        pass


ENGINES = {
    "ddp": ["--multi_gpu"],
    "fsdp": ["--config_file", str(ROOT / "launch" / "fsdp.yaml")],
    "zero2": ["--config_file", str(ROOT / "launch" / "deepspeed_zero2.yaml")],
    "zero3": ["--config_file", str(ROOT / "launch" / "deepspeed_zero3.yaml")],
}
"""accelerate launch arguments per engine. accelerate runs FSDP and DeepSpeed on GPUs only: on CPU they go
through tests/cpu_sharding (see its sitecustomize), which lifts that one gate."""


def needs_deepspeed():
    """The mark of the sharding tests' DeepSpeed cases: skipped, naming the error, where DeepSpeed does not import
    (the FSDP2 cases run without it; pip install -e '.[test]' brings it). Imported only by the modules that ask."""
    try:
        import deepspeed  # noqa: F401
    except ImportError as e:
        return pytest.mark.skipif(True, reason=f"DeepSpeed does not import: {e}")
    return pytest.mark.skipif(False, reason="DeepSpeed imports")


def weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``folder``, by name."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5, loose: dict[str, float] | None = None) -> None:
    """Every tensor within ``atol``, but those whose name holds a key of ``loose``, within its value (each
    tolerance that is wider than ``atol`` says why where it is given)."""
    assert a.keys() == b.keys() and a
    tolerance = {k: next((t for part, t in (loose or {}).items() if part in k), atol) for k in a}
    off = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    bad = {k: (d, tolerance[k]) for k, d in off.items() if not d < tolerance[k]}
    assert not bad, bad


def assert_same_curve(a: list[dict], b: list[dict], key: str) -> None:
    """Two logged curves at the same steps with ``key`` equal to a relative 1e-5."""
    assert [x["step"] for x in a] == [x["step"] for x in b]
    assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5)


def launch_env(cache_dir, engine: str = "ddp") -> dict:
    """The environment of a job launched on CPU under ``engine``: the test cache, one thread per process, and for
    FSDP or DeepSpeed the tests/cpu_sharding gate."""
    env = {**os.environ, "DRAFTHEADS_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    if engine != "ddp":
        env |= {"DRAFTHEADS_SHARDING_ON_CPU": "1",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "cpu_sharding"), env.get("PYTHONPATH", "")])}
    return env


def launch_cmd(job: str, launch_args: list[str], *args: str) -> list[str]:
    """``accelerate launch <launch_args> train/<job>.py <args>`` as the tests run it on CPU: one machine, no mixed
    precision, no dynamo, a free port for the ranks to meet on (two workers' launches at once would both take
    29500) (``launch_args``: the engine and ``--num_processes``)."""
    return [sys.executable, "-m", "accelerate.commands.launch", *launch_args, "--num_machines", "1",
            "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
            str(ROOT / "train" / f"{job}.py"), *args]


def launch(job: str, output_dir: Path, cache_dir, *overrides: str, engine: str = "ddp") -> dict:
    """``accelerate launch <engine> --num_processes 2 train/<job>.py +experiment=smoke ...`` on CPU (gloo);
    asserts it succeeded and returns its report."""
    cmd = launch_cmd(job, [*ENGINES[engine], "--num_processes", "2"], "+experiment=smoke", *overrides,
                     f"output_dir={output_dir}")
    proc = subprocess.run(cmd, env=launch_env(cache_dir, engine), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((Path(output_dir) / "report.json").read_text())


def cut_back(run_dir: Path, checkpoint: str, dest: Path) -> Path:
    """``dest`` holding only ``run_dir``'s checkpoint ``checkpoint`` (as if the run had been killed right after
    writing it), to resume from."""
    shutil.copytree(run_dir / "checkpoints" / checkpoint, dest / "checkpoints" / checkpoint)
    return dest


def feature_rows(model, lengths: tuple[int, ...], layer_ids: list[int] | None) -> list[dict]:
    """Rows of random token ids, trained from position 6, for a drafter reading target layers: with ``layer_ids``
    their ``target_features`` attached (cached), without them for features computed online."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(4, model.config.vocab_size, (n,), generator=g),
             "loss_mask": torch.arange(n) >= 6} for n in lengths]
    if layer_ids is not None:
        attach_hidden_states(model, rows, 8, 0, show_progress=False, layer_ids=layer_ids)
    return rows


def assert_packed_trains_as_padded(strategy, rows: list[dict]) -> None:
    """One step of a training ``strategy`` on ``rows`` packed (:func:`pack`) gives the loss, metrics and gradients
    of the same rows padded (:func:`collate`), the global RNG seeded alike for both (DFlash draws its anchors
    from it); gradients are left cleared."""
    results = []
    for batch in (collate(rows, 0), pack(rows)):
        torch.manual_seed(0)
        strategy.module.zero_grad(set_to_none=True)
        loss, metrics = strategy.forward_loss(strategy.module, batch)
        loss.backward()
        results.append((loss.detach(), {k: v.float() for k, v in metrics.items()},
                        [p.grad.clone() for p in strategy.module.parameters() if p.requires_grad]))
    strategy.module.zero_grad(set_to_none=True)
    (padded, padded_metrics, padded_grads), (packed, packed_metrics, packed_grads) = results
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed_metrics, padded_metrics, atol=1e-5, rtol=1e-4)
    assert len(packed_grads) == len(padded_grads) > 0
    for a, b in zip(packed_grads, padded_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def greedy_lossless(metrics: dict) -> bool:
    """Whether a greedy method's output is the target's own on every prompt (``greedy_match`` 1.0), a first
    difference at a near-tie of the target's top-2 logits excepted (``mismatch["tie"]``: within the evaluator's
    tie tolerance or the logits' resolution in their dtype). A multi-token verification and one-token steps, or
    two CPUs' SIMD kernels, may break such a tie either way; any other difference is a broken contract."""
    mismatches = metrics["mismatches"]
    return (metrics["greedy_match"] == 1.0) == (not mismatches) and all(m["tie"] for m in mismatches)


Z_999 = 3.0902  # standard normal quantile for 1 - 1e-3


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-3."""
    return df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3


def chi2_rejects(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test of observed ``counts`` against ``probs`` (cells with expected < 5 pooled); no
    observation at all rejects too."""
    n = counts.sum()
    if n == 0:
        return True
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat > chi2_critical(int(keep.sum()) - 1)


def exact_joint(model, prompt: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """``[V * V]``: the target's probability of each (first, second) generated token pair."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        first = sampling.probs(model(prompt[None]).logits[0, -1])
        seconds = torch.stack([sampling.probs(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1])
                               for a in range(vocab)])
    return (first[:, None] * seconds).flatten()


def pair_counts(decode, n: int, vocab: int) -> torch.Tensor:
    """``[V * V]`` counts of the (first, second) tokens of ``n`` runs of ``decode()``."""
    counts = torch.zeros(vocab * vocab, dtype=torch.long)
    for _ in range(n):
        a, b = decode().tokens
        counts[a * vocab + b] += 1
    return counts


@contextmanager
def quick_to_end(model, tokenizer):
    """The target's stop tokens made likely (about one draw in seven each, through a hook on its LM head): a random
    tiny target otherwise ends about one sampled message in six within 64 tokens, and its tests sampled dozens of
    batches for a few prompts. The sampling, caching and filtering under test are the same."""
    stop = sorted(stop_token_ids(tokenizer, model.generation_config))

    def boost(module, args, logits):
        logits[..., stop] += math.log(logits.shape[-1] / 7)
        return logits

    hook = model.get_output_embeddings().register_forward_hook(boost)
    try:
        yield
    finally:
        hook.remove()
