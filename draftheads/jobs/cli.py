"""The command line of the tools that work on a finished run (``train/evaluate.py``, ``train/export.py``,
``train/vllm_parity.py``): the run, a few options of the tool, and overrides of the run's saved config."""

from __future__ import annotations

from pathlib import Path


def parse_args(argv: list[str], options: tuple[str, ...], usage: str) -> tuple[Path, dict[str, str], list[str]]:
    """``(run_dir, {option: value}, config overrides)`` from ``argv``: the run as ``run_dir=`` or the first
    argument, ``key=value`` for each of ``options``, every other argument an override of the run's config.
    Raises ``SystemExit`` with ``usage`` when no run is given; prints it and exits 0 for ``-h``/``--help``."""
    if any(a in ("-h", "--help") for a in argv):
        print(usage)
        raise SystemExit(0)
    keys = tuple(f"{k}=" for k in ("run_dir", *options))
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in argv if a.startswith(keys)}
    rest = [a for a in argv if not a.startswith(keys)]
    if "run_dir" not in args:
        if not rest or "=" in rest[0]:
            raise SystemExit(usage)
        args["run_dir"], rest = rest[0], rest[1:]
    return Path(args.pop("run_dir")), args, rest
