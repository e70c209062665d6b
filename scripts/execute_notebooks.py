"""Execute notebooks top to bottom and save them with their outputs (how the H200 outputs are made).

    python scripts/execute_notebooks.py notebooks/*.ipynb --out DIR [--timeout 900]

Each notebook runs in a fresh kernel from the notebooks/ directory; the executed copy is
written to DIR (the committed notebooks are then replaced by these copies and cleaned with
scripts/clean_notebooks.py). A failing notebook is still written, with the error in its
outputs, and the script exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for path in args.notebooks:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        t0 = time.perf_counter()
        try:
            client.execute()
            status = "ok"
        except CellExecutionError as exc:
            failed.append(path.name)
            status = f"FAILED: {str(exc).strip().splitlines()[-1]}"
        nbformat.write(nb, args.out / path.name)
        print(f"{path.name}: {status} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
