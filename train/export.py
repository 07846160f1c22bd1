"""Export a finished Medusa run's heads for inference servers: ``<run>/export/vllm`` and ``<run>/export/tgi``.

    python train/export.py runs/medusa

The TGI config points at the run's base model (the stage-2 target export when there is one). A DFlash run's
``export/dflash`` is its saved model, written by the job; this command reloads it strictly and rewrites it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from train.finish import export_all, load_saved_run


def main(argv: list[str]) -> dict[str, str]:
    if not argv:
        raise SystemExit(__doc__)
    if (Path(argv[0]) / "export" / "dflash").exists():
        from models.export.dflash import export_dflash
        from train.dflash import load_saved_run as load_dflash_run
        drafter = load_dflash_run(argv[0], argv[1:])[3]
        path = export_dflash(drafter, Path(argv[0]) / "export" / "dflash")
        print(f"dflash: {path}")
        return {"dflash": str(path)}
    _, target, _, heads, extra = load_saved_run(argv[0], argv[1:])
    paths = export_all(Path(argv[0]), target, heads, extra["base_model"])
    for name, path in paths.items():
        print(f"{name}: {path}")
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
