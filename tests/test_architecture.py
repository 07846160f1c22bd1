"""The shape of the house: one import namespace, imports that only point down, thin doors, self-contained tests,
and an install that adds nothing but ``draftheads`` to site-packages."""

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

FOLDERS = {"draftheads": ROOT / "draftheads", "draftheads.models": ROOT / "models", "draftheads.data": ROOT / "data"}
"""Where each part of the namespace lives on disk (pyproject's package-dir)."""

LAYERS = ["draftheads.choice", "draftheads.packaged", "draftheads.run_folder", "draftheads.models",
          "draftheads.data", "draftheads.evaluation", "draftheads.serving", "draftheads.training",
          "draftheads.drafters", "draftheads.runs", "draftheads.jobs", "train"]
"""Bottom to top: a module may import its own layer and those below it, never one above. Evaluation (what
measures tau), serving (the servers: vLLM's environment, probe, runner, parity, preflight, the serving matrix)
and training (the spine, objectives, config) are apart: the drafter contract (``draftheads.drafters``) is where
they meet."""

APART = {"draftheads.training": ("draftheads.evaluation", "draftheads.serving")}
"""Layers that import nothing from some below them."""

RUN_FOLDER_NAMES = ('"report.json"', '"config.yaml"', '"progress.json"', '"target.json"')
"""Entry names of a run's folder, spelled only in :mod:`draftheads.run_folder`."""


def modules() -> dict[str, Path]:
    """Every library module and entry script by its import name (``train.<door>`` for the doors)."""
    found = {}
    for prefix, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            if prefix == "draftheads" and path.relative_to(folder).parts[0] in ("models", "data"):
                continue
            parts = [*prefix.split("."), *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    found |= {f"train.{p.stem}": p for p in (ROOT / "train").glob("*.py")}
    return found


def imports(path: Path) -> set[str]:
    """Absolute module names a file imports (``from x import y`` counts ``x`` and ``x.y``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def layer(name: str) -> int | None:
    """The layer index of a module name, None outside draftheads and the doors."""
    return max((i for i, top in enumerate(LAYERS) if name == top or name.startswith(top + ".")), default=None)


EXTENDS = {"dspark": "dflash", "dflash2": "dflash"}
"""A drafter that is another drafter plus heads (as vLLM's ``qwen3_dspark.py`` extends ``qwen3_dflash.py``) may
import that one's folder, by subclassing, never the reverse or any other folder."""


def drafter_of(name: str) -> str | None:
    """The drafter folder a module is in (``draftheads.drafters.<name>``), None for any other (the registry and
    the contract beside it included)."""
    parts = name.split(".")
    inside = len(parts) > 2 and parts[:2] == ["draftheads", "drafters"]
    return parts[2] if inside and (ROOT / "draftheads" / "drafters" / parts[2]).is_dir() else None


def forbidden(edges: list[tuple[str, str]]) -> list[str]:
    """The edges that break the house's rules, each said in words."""
    bad = []
    for src, dst in edges:
        if dst.split(".")[0] in ("models", "data", "train") and not src.startswith("train."):
            bad.append(f"{src} imports {dst}: outside the draftheads namespace (or an entry script)")
        elif src.startswith("train.") and dst.startswith("train"):
            bad.append(f"{src} imports {dst}: an entry script imports another")
        elif layer(dst) is not None and layer(src) is not None and layer(dst) > layer(src):
            bad.append(f"{src} imports {dst}: {LAYERS[layer(dst)]} is above {LAYERS[layer(src)]}")
        elif layer(src) is not None and layer(dst) is not None and LAYERS[layer(dst)] in APART.get(
                LAYERS[layer(src)], ()):
            bad.append(f"{src} imports {dst}: {LAYERS[layer(src)]} stays apart from {LAYERS[layer(dst)]}")
        elif drafter_of(src) and drafter_of(dst) and drafter_of(dst) not in (drafter_of(src),
                                                                          EXTENDS.get(drafter_of(src))):
            bad.append(f"{src} imports {dst}: one drafter's folder imports another's")
    return bad


def test_imports_point_down_and_doors_are_thin():
    found = modules()
    edges = [(name, dst) for name, path in found.items() for dst in imports(path)]
    assert forbidden(edges) == []
    for name, path in found.items():
        if name.startswith("train."):
            tree = ast.parse(path.read_text())
            assert ast.get_docstring(tree), f"{path}: an entry script opens with its usage"
            defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
            assert len(defs) <= 1 and len(path.read_text().splitlines()) < 60, f"{path} is not a thin door"


def circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Every set of two or more modules that import each other, directly or round a circle (Tarjan's strongly
    connected components), each sorted."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_round_a_circle():
    """Not even inside a layer, nor through an import inside a function or under ``TYPE_CHECKING``."""
    found = modules()
    edges = [(name, dst) for name, path in found.items() for dst in imports(path) if dst in found and dst != name]
    assert circles(edges) == []


def test_a_circle_is_found():
    assert circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]


def test_each_run_folder_name_is_spelled_in_one_module():
    spelled = {name: sorted(str(path.relative_to(ROOT)) for path in modules().values() if name in path.read_text())
               for name in RUN_FOLDER_NAMES}
    assert spelled == {name: ["draftheads/run_folder.py"] for name in RUN_FOLDER_NAMES}


@pytest.mark.parametrize("edge, rule", [
    (("draftheads.training.spine", "draftheads.serving.matrix"), "stays apart"),
    (("draftheads.training.config", "draftheads.evaluation.context"), "stays apart"),
    (("draftheads.evaluation.evaluator", "draftheads.serving.parity"), "is above"),
    (("draftheads.models.target", "draftheads.data.sources"), "is above"),
    (("draftheads.training.spine", "draftheads.drafters.medusa.recipe"), "is above"),
    (("draftheads.drafters.medusa.recipe", "draftheads.runs.life"), "is above"),
    (("draftheads.runs.life", "draftheads.jobs.evaluate"), "is above"),
    (("draftheads.drafters.dflash.recipe", "draftheads.drafters.medusa.heads"), "another's"),
    (("draftheads.drafters.dflash.model", "draftheads.drafters.dspark.model"), "another's"),
    (("draftheads.drafters.dspark.model", "draftheads.drafters.eagle3.model"), "another's"),
    (("draftheads.runs.life", "train.medusa"), "outside the draftheads namespace"),
    (("train.export", "train.evaluate"), "an entry script imports another"),
    (("draftheads.data.pipeline", "models.target"), "outside the draftheads namespace"),
])
def test_a_forbidden_edge_is_named(edge, rule):
    assert rule in " ".join(forbidden([edge]))


def test_no_test_module_imports_another():
    for path in (ROOT / "tests").rglob("*.py"):
        tests = {n for n in imports(path) if n.startswith("tests.") and not n.startswith("tests.helpers")}
        assert not tests, f"{path} imports {tests}: shared pieces belong in tests/helpers.py"


def test_a_non_editable_install_adds_only_the_draftheads_namespace(tmp_path):
    """``pip install .`` (a wheel) holds draftheads.* only, and every package folder on disk is in it (a new
    drafter's folder missing from pyproject's package list fails here, not on a user's machine)."""
    source = tmp_path / "source"  # a copy: setuptools builds inside the source tree (build/); keep ours clean
    for name in ("draftheads", "models", "data"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
                   check=True, capture_output=True)
    (wheel,) = tmp_path.glob("draftheads-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"draftheads"}
    packages = {str(Path(n).parent).replace("/", ".") for n in names if n.endswith("__init__.py")}
    on_disk = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert on_disk == packages
    shipped = {p.name for p in (ROOT / "models" / "chat_templates").glob("*.jinja")}
    assert shipped and {Path(n).name for n in names if n.startswith("draftheads/models/chat_templates/")} == shipped
