"""What a drafter is, as data: :class:`DrafterSpec`, the frozen declaration each recipe carries (``recipe.spec``).

Everything a caller needs to know about a drafter without running any of it (its name, config schema, checkpoint
stages, the folders it saves and exports, which servers load them, the decoding methods its runs offer) is read
here; what it does lives in the behaviour protocols of :mod:`draftheads.drafters.contract`. The model is
SpecForge's split of a speculative algorithm's declaration from its implementations.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass
from pathlib import Path

from draftheads.serving.matrix import Served
from draftheads.training.config import RunConfig


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter's declaration. Fields left empty take the defaults of a drafter on target layers (one
    stage of its name, its export ``export/<name>``, vLLM's method its name). Raises ``ValueError`` where it is
    built for what would break later: a name outside ``[a-z][a-z0-9]*`` or a Python keyword, a schema that is no
    ``RunConfig`` subclass, a field that should be a tuple and is not (a string would be read one character at a
    time), no method or one that is no regular expression, an export folder outside the run's ``export/``, two
    serving rows for one folder and variant, serving rows none of which is for ``vllm_weights``."""
    name: str
    """Registry name, recorded as ``drafter`` in every run's config (``[a-z][a-z0-9]*``, not a keyword)."""
    schema: type
    """Its :class:`~draftheads.training.config.RunConfig` subclass (``conf/<name>.yaml`` extends it)."""
    methods: tuple[str, ...]
    """The report names of the decoding methods its runs offer, as regular expressions: its chain's and its peers'.
    ``eval.peers`` is checked against every drafter's before any work
    (:func:`draftheads.drafters.check_method_names`)."""
    stages: tuple[str, ...] = ()
    """Checkpoint stage names, in training order (resume refuses a checkpoint of any other); default ``(name,)``."""
    vllm_weights: str = ""
    """The export folder (relative to the run) that vLLM loads, read back for parity; default ``export/<name>``."""
    vllm_method: str = ""
    """vLLM's speculative method for that export (``speculative_config`` ``method``); default the name. A drafter
    that runs on another's runtime says which (DFlash 2: ``dflash``, the export's architecture choosing the
    speculator)."""
    llamacpp_spec: str | None = None
    """llama-server's ``--spec-type`` for its export (``draft-eagle3``, ``draft-dflash``, ``draft-dspark``: llama.cpp
    b11434 ``common/arg.cpp``), which llama.cpp's converter makes a GGUF of (``export/llama.cpp``); None: llama.cpp
    serves no such drafter."""
    saved_entries: tuple[str, ...] = ()
    """What its save writes in the run's folder beside ``export/`` (an overwriting run deletes them too)."""
    serving: tuple[Served, ...] = ()
    """Its rows of the serving matrix (``docs/serving.md``), declared in its folder's ``serving.py``: for each
    export folder it writes (and each variant of one), which server loads it, with the line of that server's
    source that says so (:class:`~draftheads.serving.matrix.Served`); written as ``serving.json`` beside the run's
    exports, and the vLLM jobs refuse a vLLM without its method from them."""
    fresh: tuple[str, ...] = ()
    """Patterns (``fnmatch``) of tensor names that may start fresh when a warm start's source lacks them, and of the
    source's that are dropped when this drafter lacks them (:func:`~draftheads.training.warm_start.load_source`)."""

    def __post_init__(self) -> None:
        name = self.name
        if not (isinstance(name, str) and re.fullmatch(r"[a-z][a-z0-9]*", name)) or keyword.iskeyword(name):
            raise ValueError(f"drafter name {name!r}: [a-z][a-z0-9]*, not a Python keyword (it names train/<name>.py, "
                             "conf/<name>.yaml and the config section)")
        if not (isinstance(self.schema, type) and issubclass(self.schema, RunConfig)):
            raise ValueError(f"drafter {name!r}: schema {self.schema!r} is no RunConfig subclass "
                             "(draftheads/training/config.py; conf/<name>.yaml extends it)")
        for field in ("methods", "stages", "saved_entries", "serving", "fresh"):
            if not isinstance(getattr(self, field), tuple):
                raise ValueError(f"drafter {name!r}: {field} must be a tuple, not {getattr(self, field)!r}")
        if not self.methods:
            raise ValueError(f"drafter {name!r}: methods names none (at least its chain's report name)")
        for pattern in self.methods:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"drafter {name!r}: method {pattern!r} is no regular expression: {e}") from None
        for field, default in (("stages", (name,)), ("vllm_weights", f"export/{name}"), ("vllm_method", name)):
            if not getattr(self, field):
                object.__setattr__(self, field, default)
        keys = [(row.export, row.variant) for row in self.serving]
        if len(set(keys)) != len(keys):
            raise ValueError(f"drafter {name!r}: two serving rows for one export folder and variant: {keys}")
        outside = [e for e in [self.vllm_weights, *(row.export for row in self.serving)]
                   if not e.startswith("export/") or ".." in Path(e).parts]
        if outside:
            raise ValueError(f"drafter {name!r}: export folders {outside} must lie under the run's export/ (an "
                             "overwriting run keeps only what a run writes there)")
        if self.serving and self.vllm_weights not in {row.export for row in self.serving}:
            raise ValueError(f"drafter {name!r}: no serving row for {self.vllm_weights}, the export vLLM loads (the "
                             "vLLM preflight and parity read it)")

    def served(self, export: str, variant: str = "") -> Served:
        """Its :attr:`serving` row for the folder ``export`` (relative to the run) and ``variant``, else the plain
        row. ``KeyError`` naming the folder when it declares none."""
        rows = {(row.export, row.variant): row for row in self.serving}
        row = rows.get((export, variant)) or rows.get((export, ""))
        if row is None:
            raise KeyError(f"drafter {self.name!r} declares no serving row for {export} (its spec's `serving`, "
                           f"draftheads/drafters/{self.name}/serving.py; docs/serving.md)")
        return row
