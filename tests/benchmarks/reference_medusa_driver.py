"""FasterDecoding/Medusa's own Medusa-1 trainer (``medusa-llm`` 0.1 from PyPI) on rows given as token ids; run by
``bench_reference.py`` inside the reference's environment (transformers 4.34), so it imports nothing from draftheads:

    <medusa-ref-venv>/bin/python tests/benchmarks/reference_medusa_driver.py SETTINGS.json

``SETTINGS.json`` (written by the benchmark): ``model`` (a folder transformers 4.34 loads), ``rows`` (a safetensors
file of ``input_ids``, ``labels``, ``attention_mask``, each ``[N, T]``), ``out`` (a folder) and ``args`` (keyword
arguments of the reference's ``TrainingArguments``, its Medusa fields included).

Follows ``medusa.train.train.train()`` step by step with the reference's own classes: the base model loaded in
bfloat16 without its KV cache and frozen, ``MedusaModel`` around it (per-head LM heads copied from the target's),
``CustomizedTrainer`` (an HF ``Trainer`` whose loss sums the heads' cross-entropies). Three steps differ, because the
rows come pre-tokenised and nothing may be unpickled later: the dataset is the given rows (already padded to one
length, so the Trainer's default collator makes the batches its padding collator would) instead of its
fastchat/vicuna preprocessing, ``MedusaModel`` gets the model folder as ``base_model_name_or_path`` (its default,
``lmsys/vicuna-7b-v1.3``, is a hub download), and the heads' state dict is written as safetensors
(``medusa_lm_head.safetensors``, keys ``{i}.0.linear.weight|bias`` and ``{i}.1.weight``) where ``train()``
``torch.save``-s ``medusa_lm_head.pt``. Left out with its data path: the tokenizer for preprocessing, RoPE scaling
for a ``model_max_length`` beyond the model's, the output folder's naming, resuming. Writes to ``out``: those
weights, the reference's ``MedusaConfig`` (``config.json``) and ``trainer.json`` (optimizer steps, the Trainer's own
runtime and mean loss).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from medusa.model.medusa_model import MedusaConfig, MedusaModel
from medusa.train.train import CustomizedTrainer, TrainingArguments
from safetensors.torch import load_file, save_file


class Rows(torch.utils.data.Dataset):
    """Pre-tokenised rows in the reference's dataset format (what its ``SupervisedDataset`` yields)."""

    def __init__(self, path: str):
        self.tensors = load_file(path)

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


def medusa_model(folder: str, args: TrainingArguments) -> MedusaModel:
    """The frozen base model in bfloat16 (``train()`` hard-codes that dtype) with fresh Medusa heads."""
    config = transformers.AutoConfig.from_pretrained(folder)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, config=config, low_cpu_mem_usage=True,
                                                              torch_dtype=torch.bfloat16)
    for param in model.base_model.parameters():
        param.requires_grad = False
    return MedusaModel(model, medusa_num_heads=args.medusa_num_heads, medusa_num_layers=args.medusa_num_layers,
                       base_model_name_or_path=folder)


def save_heads(model: MedusaModel, out: Path) -> None:
    """The heads as safetensors plus the reference's ``MedusaConfig``. Cloned: with more than one layer the
    reference repeats one ResBlock object, whose shared tensors safetensors refuses."""
    state = {k: v.detach().clone().contiguous() for k, v in model.medusa_head.state_dict().items()}
    save_file(state, str(out / "medusa_lm_head.safetensors"), metadata={"format": "pt"})
    MedusaConfig(medusa_num_heads=model.medusa, medusa_num_layers=model.medusa_num_layers,
                 base_model_name_or_path=model.base_model_name_or_path).save_pretrained(str(out))


def main(settings_path: str) -> None:
    """Train the reference's heads as ``settings_path`` says and write them (see the module docstring)."""
    settings = json.loads(Path(settings_path).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    args = TrainingArguments(**settings["args"])
    model = medusa_model(settings["model"], args)
    trainer = CustomizedTrainer(model=model, args=args, train_dataset=Rows(settings["rows"]))
    result = trainer.train()
    save_heads(model, out)
    (out / "trainer.json").write_text(json.dumps({
        "steps": trainer.state.global_step, "train_runtime": result.metrics["train_runtime"],
        "train_loss": result.training_loss}))


if __name__ == "__main__":
    main(sys.argv[1])
