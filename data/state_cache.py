"""The target's states for every training row, written once to disk and read by any number of training runs.

Layout of a cache folder:
- ``shard-00000.safetensors`` ...: rows ``[k * shard_rows, (k + 1) * shard_rows)`` of the job's row list, one
  tensor per row (``row<i>``: ``[T_i, D]`` last hidden states, or ``[T_i, K*D]`` layer features), in the cache
  dtype (fp8: also ``row<i>.scale``, ``[T_i]`` float32, one scale per position: :func:`quantize_fp8`); each
  shard is written to a temporary name and renamed, then its ``.json`` (row indices, sha256);
- ``manifest.json``: what the states are for (:class:`CacheSpec`: target identity and weights fingerprint, layer
  ids, tokenizer, max length, data fingerprint, dtype) and every shard's checksum, written when all are there.

Each rank writes the shards ``k % world_size == rank``. A shard whose ``.json`` exists and matches its file is
complete and skipped by a resumed run; anything else is rewritten. Readers refuse a cache made for another
model, layers, tokenizer, max length, data or dtype, naming the field, and a shard whose checksum is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from draftheads.choice import Choice
from draftheads.data.batching import collate, rows_sha256
from draftheads.data.hidden_states import last_hidden_states, layer_features
from draftheads.models.partial import named_weights

MANIFEST = "manifest.json"


class StatesDtype(Choice):
    """Dtype of the state cache on disk (``data.target_states_dtype``); read back in the training dtype."""
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float8_e4m3fn = "float8_e4m3fn"
    """fp8 (e4m3, largest value 448) scaled per row and position: each position's states are divided by their
    largest magnitude over the features / 448 before rounding, and that scale is kept beside them in float32
    (:func:`quantize_fp8`). Relative error at most 2^-4 (6.25%) per element of at least the position's amax /
    28,672 (fp8's smallest normal, 2^-6, at 448), smaller ones within amax / 2^18; bytes per token: the width
    plus 4, about half of bf16's."""


FP8 = StatesDtype.float8_e4m3fn.value
STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          FP8: torch.float8_e4m3fn}
"""Each :class:`StatesDtype`'s element type on disk."""
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, W]`` states -> ``[T, W]`` float8_e4m3fn values and ``[T]`` float32 scales, ``values * scale``
    giving the states back: a scale per position (amax over the W features / 448), so a position's largest
    state lands on fp8's largest value and every state keeps fp8's 3-bit mantissa (the residual stream's
    magnitude differs by orders of magnitude between positions: one scale per row would flush the small ones).
    An all-zero position gets scale 1 (zeros stay zeros)."""
    x = states.float()
    scale = x.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)  # the division's rounding stays inside fp8's range
    return values.to(torch.float8_e4m3fn), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The states :func:`quantize_fp8` encoded, in ``dtype`` (computed in float32, rounded once)."""
    return (values.float() * scale.float()[:, None]).to(dtype)


def bytes_per_token(width: int, dtype: str) -> int:
    """Bytes one token's states take in a cache of ``dtype``: the width's elements, plus fp8's float32 scale."""
    return width * STORED[dtype].itemsize + (4 if dtype == FP8 else 0)


def source_dtype(dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype states are computed into before writing a cache of ``dtype``: that dtype, or for fp8 the
    target's own (each position is scaled from the unrounded states, then rounded once)."""
    return model_dtype if dtype == FP8 else STORED[dtype]


@dataclass(frozen=True)
class CacheSpec:
    """Everything the cached states depend on; a reader compares it field by field."""
    model: dict
    """The target's identity (``models.target.model_identity``) plus ``weights_sha256`` of its parameters."""
    layer_ids: list[int] | None
    """Decoder layers whose outputs are cached (DFlash), or None for the last hidden states (Medusa)."""
    tokenizer: dict
    """name, vocabulary size, sha256 of the chat template."""
    max_length: int
    data_sha256: str
    """Hash of every row's token ids and thinking mode, in order (:func:`~draftheads.data.batching.rows_sha256`)."""
    dtype: str


def weights_fingerprint(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name, shape and bytes (seconds for a 135M model; run once per cache and
    per run that reads it; a partial target's unloaded tensors are read from its checkpoint one at a time)."""
    h = hashlib.sha256()
    for name, shape, values in named_weights(model):
        h.update(f"{name}{tuple(shape)}{values.dtype}".encode())
        h.update(values.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def cache_spec(model, identity: dict, tokenizer, rows: list[dict], layer_ids: Sequence[int] | None,
               max_length: int, dtype: str) -> CacheSpec:
    """The spec of states for ``rows`` from this target."""
    template = hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()
    return CacheSpec({**identity, "weights_sha256": weights_fingerprint(model)},
                     list(layer_ids) if layer_ids is not None else None,
                     {"name": tokenizer.name_or_path, "vocab_size": len(tokenizer), "chat_template_sha256": template},
                     max_length, rows_sha256(rows), dtype)


def estimated_bytes(rows: list[dict], width: int, dtype: str) -> int:
    """Disk size of the states: tokens x :func:`bytes_per_token` (safetensors headers left out)."""
    return sum(len(r["input_ids"]) for r in rows) * bytes_per_token(width, dtype)


def footprint(folder: str | Path, rows: list[dict], width: int, read_dtype: torch.dtype) -> dict:
    """What a complete cache of ``rows`` costs: ``tokens``, ``disk_bytes`` (its shard files, headers included)
    and per token, and ``ram_bytes_per_token`` of the states training holds once it has read them back (in
    ``read_dtype``, dequantised: fp8 saves disk, not RAM)."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    tokens = sum(len(r["input_ids"]) for r in rows)
    disk = sum((Path(folder) / s["file"]).stat().st_size for s in manifest["shards"])
    return {"dtype": manifest["spec"]["dtype"], "tokens": tokens, "disk_bytes": disk,
            "disk_bytes_per_token": disk / max(tokens, 1), "ram_bytes_per_token": width * read_dtype.itemsize}


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in 16 MiB blocks (shards and checkpoints of any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


def _complete(folder: Path, k: int) -> bool:
    info = folder / (_shard_name(k) + ".json")
    path = folder / _shard_name(k)
    return info.exists() and path.exists() and json.loads(info.read_text())["sha256"] == file_sha256(path)


StateSource = Callable[[list[dict]], list[torch.Tensor]]
"""Target states for a list of rows: one ``[T_i, width]`` tensor per row, in the rows' order."""


def forward_states(model, layer_ids: Sequence[int] | None, batch_size: int, pad_token_id: int,
                   dtype: torch.dtype) -> StateSource:
    """States from forwards of ``model`` in process: the last hidden state after the final norm (``layer_ids``
    None) or the outputs of decoder layers ``layer_ids``, on the CPU in ``dtype``; rows run sorted by length,
    ``batch_size`` at a time, right-padded (padding leaves positions unchanged)."""
    device = next(model.parameters()).device

    def states(rows: list[dict]) -> list[torch.Tensor]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]["input_ids"]))  # little padding per forward
        out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
        for s in range(0, len(order), batch_size):
            chunk = order[s:s + batch_size]
            batch = collate([rows[i] for i in chunk], pad_token_id)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            got = (last_hidden_states(model, ids, mask) if layer_ids is None
                   else layer_features(model, ids, mask, layer_ids)).to("cpu", dtype)
            for j, i in enumerate(chunk):
                out[i] = got[j, :len(rows[i]["input_ids"])]
        return out
    return states


def pending_shards(folder: str | Path, n_rows: int, shard_rows: int, rank: int = 0, world_size: int = 1) -> list[int]:
    """This rank's shard indices not yet complete in ``folder``."""
    return [k for k in range(-(-n_rows // shard_rows)) if k % world_size == rank and not _complete(Path(folder), k)]


def shard_indices(k: int, n_rows: int, shard_rows: int) -> list[int]:
    """The row indices shard ``k`` holds."""
    return list(range(k * shard_rows, min((k + 1) * shard_rows, n_rows)))


def write_cache(states: StateSource, rows: list[dict], folder: str | Path, spec: CacheSpec, shard_rows: int,
                rank: int = 0, world_size: int = 1, show_progress: bool = True) -> list[int]:
    """Write this rank's shards (skipping complete ones) from ``states`` (:func:`forward_states`, or states
    vLLM extracted: :mod:`draftheads.data.vllm_states`); returns the shard indices written now.

    The caller writes the manifest (:func:`write_manifest`) once every rank is done.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mine = pending_shards(folder, len(rows), shard_rows, rank, world_size)
    for k in tqdm(mine, desc="caching target states", unit="shard", disable=not show_progress):
        indices = shard_indices(k, len(rows), shard_rows)
        got = states([rows[i] for i in indices])
        tensors = {}
        for i, t in zip(indices, got):
            tensors |= _encode(f"row{i}", t.to("cpu"), spec.dtype)
        path = folder / _shard_name(k)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        info = path.with_name(path.name + ".json")
        info.with_name(info.name + ".tmp").write_text(json.dumps({"rows": indices, "sha256": file_sha256(path)}))
        info.with_name(info.name + ".tmp").replace(info)
    return mine


def _encode(name: str, states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """One row's tensors in a shard: ``name`` in ``dtype``, and for fp8 ``name.scale`` besides."""
    if dtype != FP8:
        return {name: states.to(STORED[dtype]).contiguous()}
    values, scale = quantize_fp8(states)
    return {name: values.contiguous(), f"{name}.scale": scale.contiguous()}


def _decode(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype | None) -> torch.Tensor:
    """One row's states from a shard, in ``dtype`` (default: the cache's; float32 for fp8)."""
    if f"{name}.scale" in tensors:
        return dequantize_fp8(tensors[name], tensors[f"{name}.scale"], dtype or torch.float32)
    return tensors[name].to(dtype) if dtype is not None else tensors[name]


def write_manifest(folder: str | Path, spec: CacheSpec, n_rows: int, shard_rows: int) -> Path:
    """``manifest.json`` from the shards' records. Raises ``FileNotFoundError`` naming a missing shard."""
    folder = Path(folder)
    shards = []
    for k in range(-(-n_rows // shard_rows)):
        info = folder / (_shard_name(k) + ".json")
        if not info.exists():
            raise FileNotFoundError(f"{folder / _shard_name(k)} was not written (a rank failed?); run again")
        shards.append({"file": _shard_name(k), **json.loads(info.read_text())})
    path = folder / MANIFEST
    path.with_name(MANIFEST + ".tmp").write_text(json.dumps({"spec": asdict(spec), "num_rows": n_rows,
                                                             "shard_rows": shard_rows, "shards": shards}, indent=1))
    path.with_name(MANIFEST + ".tmp").replace(path)
    return path


def read_cache(folder: str | Path, spec: CacheSpec, rows: list[dict], indices: Sequence[int] | None = None,
               dtype: torch.dtype | None = None) -> None:
    """Attach cached states to ``rows`` in place (``hidden_states`` or ``target_features``, cast to ``dtype``,
    default the cache's; fp8 dequantised, float32 by default), only those at ``indices`` (default: all), reading
    and verifying just the shards that hold them.

    Raises:
        FileNotFoundError: no manifest (the cache was never completed: run train/cache_hidden_states.py).
        ValueError: the cache was made for something else (names the field, cache vs run), or a shard's
            checksum or contents are wrong (names the shard).
    """
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        raise FileNotFoundError(f"{folder} holds no complete hidden-state cache ({MANIFEST} missing): run "
                                f"accelerate launch train/cache_hidden_states.py with the same config first")
    manifest = json.loads((folder / MANIFEST).read_text())
    cached = manifest["spec"]
    for name, value in asdict(spec).items():
        if cached.get(name) != value:
            raise ValueError(f"{folder}: the cache was made for another {name}: cache {cached.get(name)!r}, this run "
                             f"{value!r}; rebuild it with train/cache_hidden_states.py and this job's config "
                             f"(--config-name <drafter> and the same overrides)")
    key = "hidden_states" if spec.layer_ids is None else "target_features"
    wanted = set(range(len(rows)) if indices is None else indices)
    for shard in manifest["shards"]:
        needed = wanted & set(shard["rows"])
        if not needed:
            continue
        path = folder / shard["file"]
        if not path.exists() or file_sha256(path) != shard["sha256"]:
            raise ValueError(f"{path}: missing or corrupt (checksum differs from {MANIFEST}); rebuild the cache "
                             f"(complete shards are kept)")
        tensors = load_file(str(path))
        for i in needed:
            if tensors[f"row{i}"].shape[0] != len(rows[i]["input_ids"]):
                raise ValueError(f"{path}: row {i} has {tensors[f'row{i}'].shape[0]} states for "
                                 f"{len(rows[i]['input_ids'])} tokens")
            rows[i][key] = _decode(tensors, f"row{i}", dtype)
