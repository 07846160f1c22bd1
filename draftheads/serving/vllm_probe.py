"""Runs inside a vLLM environment: prints, as one JSON line, the installed vLLM's ``version`` and the speculative
``methods`` its ``SpeculativeConfig`` accepts (``vllm/config/speculative.py``: ``SpeculativeMethod``, a
``Literal`` of ``Literal`` aliases in 0.32 and 0.33).

    <vllm venv>/bin/python draftheads/serving/vllm_probe.py

Read from the source without importing vLLM (an import takes ~13 s on 2 CPU cores); imported only when the source
does not declare the methods that way. Standard library only; imports nothing from draftheads.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path


def _assignments(path: Path) -> dict[str, ast.expr]:
    """Module-level ``NAME = value`` (and ``NAME: T = value``) of a source file."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            found |= {t.id: node.value for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node.value
    return found


def _literal(node: ast.expr, names: dict[str, ast.expr]) -> list[str]:
    """The strings of a ``Literal[...]`` whose members are strings or names of other such aliases."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Name) and node.id in names:
        return _literal(names[node.id], names)
    if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Literal":
        members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return [value for member in members for value in _literal(member, names)]
    raise ValueError(f"not a Literal of strings: {ast.dump(node)[:80]}")


def probe() -> dict:
    root = Path(importlib.util.find_spec("vllm").origin).parent  # the package, not imported
    version = _assignments(root / "_version.py").get("__version__") if (root / "_version.py").exists() else None
    try:
        names = _assignments(root / "config" / "speculative.py")
        methods = list(dict.fromkeys(_literal(names["SpeculativeMethod"], names)))
    except (KeyError, ValueError, OSError, SyntaxError):
        from typing import get_args

        from vllm.config.speculative import SpeculativeMethod
        methods = list(get_args(SpeculativeMethod))
    if isinstance(version, ast.Constant):
        version = version.value
    else:
        import vllm
        version = vllm.__version__
    return {"version": version, "methods": methods}


if __name__ == "__main__":
    print(json.dumps(probe()))
