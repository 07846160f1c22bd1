"""Export a finished run's heads for inference servers: ``<run>/export/vllm`` and ``<run>/export/tgi``.

    python train/export.py runs/medusa

The TGI config points at the run's base model (the stage-2 target export when there is one).
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.finish import export_all, load_saved_run


def main(argv: list[str]) -> dict[str, str]:
    if not argv:
        raise SystemExit(__doc__)
    _, target, _, heads, extra = load_saved_run(argv[0], argv[1:])
    paths = export_all(Path(argv[0]), target, heads, extra["base_model"])
    for name, path in paths.items():
        print(f"{name}: {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
