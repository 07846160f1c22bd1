"""vLLM's drafter trainer, ``speculators`` 0.9.0 from PyPI, run on CPU as its ``speculators train`` command runs;
started by ``bench_speculators.py`` inside speculators' own environment, so it imports nothing from draftheads:

    <speculators venv>/bin/python tests/benchmarks/speculators_driver.py SETTINGS.json

``SETTINGS.json`` (written by the benchmark): ``argv`` (the ``speculators train`` arguments, without ``--epochs``),
``steps`` (optimizer steps to take), ``out`` (a folder). The data folder named by ``--data-path`` is in
speculators' own offline format, written by the benchmark: a ``datasets`` folder of ``input_ids``, ``loss_mask``,
``seq_len`` (its ``prepare_data`` output, here saved from ``rows.safetensors`` by :func:`make_dataset`),
``hidden_states/hs_<i>.safetensors`` (``hidden_states`` ``[T, K + 1, D]``, the feature layers and last, and
``token_ids``: what its vLLM hidden-states connector writes) and ``token_freq.pt``.

Everything is speculators' own: its config resolution (``TrainConfig.resolve``, so unknown flags fail as on its
command line), its ``main()`` (draft model from the verifier, vocab mapping from ``token_freq.pt``, its data
loaders and multipack sampler, its ``Trainer``, checkpoints, validation every epoch). ``--epochs`` is the fewest
of its epochs that hold ``steps`` (its batches per epoch, counted with its own multipack sampler over its training
split: :func:`batches_per_epoch`), ``--max-steps`` stops it there: its trainer takes one more step in every epoch
that starts past ``--max-steps`` (``trainer.py:519,602``), so the epochs must not overshoot.

Its flags for hardware without flex attention and Triton (``--draft-attn-impl sdpa``, ``--loss-implementation
eager``) are the benchmark's to pass (``CPU_FLAGS`` there).

Patches, at run time, for a machine without an accelerator (speculators 0.9.0 assumes one); none touches its
training logic:

1. ``speculators/train/trainer.py:221,228``: the ``Trainer`` takes ``get_local_rank()`` (0) as its device and
   ``torch.accelerator.current_accelerator()`` as its autocast device type, which torch 2.13's CPU build answers
   ``cuda`` with no device present (else its fallback is ``"cuda"`` too), so ``self.model.to(self.local_rank)``
   (:348) fails (``RuntimeError: Found no NVIDIA driver on your system``) and ``autocast("cuda")`` would be
   switched off with a warning. Here ``get_local_rank`` (as the trainer module sees it) returns the CPU device, and
   the trainer's ``device_type`` is ``"cpu"`` (bf16 autocast on the CPU, as its ``hidden_states_dtype`` asks).
2. ``speculators/train/trainer.py:80,92`` (``_StepTimer``) calls ``torch.accelerator.synchronize()`` for its
   profile timings; without a device that raises the same error, so it is a no-op here (CPU work is
   synchronous).

Writes to ``out``: ``driver.json`` (the steps its trainer took, the parameters it trained, its batches per epoch,
epochs, the resolved arguments) beside speculators' own ``--save-path`` and ``--log-dir`` output.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

ROWS = "rows.safetensors"
"""The benchmark's rows beside the data folder's ``hidden_states``: ``input_ids`` and ``loss_mask`` of every row,
concatenated, with ``lengths``."""


def make_dataset(data_path: Path) -> None:
    """Speculators' preprocessed dataset (``datasets.save_to_disk``: ``input_ids``, ``loss_mask``, ``seq_len``)
    from the benchmark's ``rows.safetensors``, once."""
    from datasets import Dataset
    from safetensors.torch import load_file

    if (data_path / "dataset_info.json").exists():
        return
    rows = load_file(str(data_path / ROWS))
    ids, mask = rows["input_ids"].split(rows["lengths"].tolist()), rows["loss_mask"].split(rows["lengths"].tolist())
    dataset = Dataset.from_dict({"input_ids": [i.tolist() for i in ids], "loss_mask": [m.tolist() for m in mask],
                                 "seq_len": rows["lengths"].tolist()})
    dataset.with_format("torch").save_to_disk(str(data_path))


def patch_for_cpu() -> None:
    """The two run-time patches of the module docstring."""
    from speculators.train import cli, trainer

    if torch.accelerator.is_available():
        return
    trainer.get_local_rank = lambda: torch.device("cpu")
    torch.accelerator.synchronize = lambda *args, **kwargs: None

    class CPUTrainer(trainer.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.device_type = "cpu"

    cli.Trainer = CPUTrainer


def batches_per_epoch(cfg) -> int:
    """Speculators' training batches per epoch for ``cfg``: its multipack sampler over its training split (the
    first ``int(rows * train_data_ratio)`` rows), as its ``create_train_val_loaders`` builds it."""
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import (
        MultipackDistributedBatchSamplerV2,
    )

    lengths = list(load_from_disk(cfg.data.data_path).with_format(None)["seq_len"])
    lengths = lengths[:int(len(lengths) * cfg.data.train_data_ratio)]
    return len(MultipackDistributedBatchSamplerV2(batch_max_length=cfg.data.total_seq_len, lengths=lengths,
                                                  num_replicas=1, rank=0, seed=cfg.seed))


def main(settings_path: str) -> None:
    settings = json.loads(Path(settings_path).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    argv = list(settings["argv"])
    data_path = Path(argv[argv.index("--data-path") + 1])
    make_dataset(data_path)
    patch_for_cpu()
    from speculators.train import cli
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    per_epoch = batches_per_epoch(TrainConfig.resolve(argv))
    epochs = math.ceil(settings["steps"] / per_epoch)
    cfg = TrainConfig.resolve([*argv, "--epochs", str(epochs), "--max-steps", str(settings["steps"])])
    taken = {}

    class Counted(cli.Trainer):  # records the steps its trainer took and the parameters it trained
        def run_training(self):
            super().run_training()
            taken["steps"] = self.global_step
            taken["trained"] = sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    cli.Trainer = Counted
    train(cfg)
    (out / "driver.json").write_text(json.dumps({
        **taken, "batches_per_epoch": per_epoch, "epochs_run": epochs, "epochs": taken["steps"] / per_epoch,
        "config": cfg.flatten()}, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
