#!/usr/bin/env python3
"""Strip the volatile parts of committed notebooks, keeping their outputs.

Notebooks are committed with the outputs of their run on the H200 (the docs show
them), so a re-run must change only what the run really changed. This removes what
changes every time without meaning anything:

- cell metadata written by front ends: execution timing (``execution``,
  ``ExecuteTime``) and view state (``scrolled``, ``collapsed``);
- widget state (notebook metadata ``widgets``) and the widget-view outputs that
  point into it by random model id (their ``text/plain`` fallback stays);
- the interpreter version in ``language_info`` and editor metadata (``vscode``);
- the kernelspec, reset to the standard ``python3`` one (a local kernel's name
  means nothing on another machine).

It then writes the notebook in Jupyter's own layout (nbformat: one-space indent,
sorted keys), so cleaning is idempotent and the diff of a re-run shows only real
changes. Execution counts, cell ids, tags and outputs are kept.

    python scripts/clean_notebooks.py notebooks            # clean in place
    python scripts/clean_notebooks.py --check notebooks    # CI: exit 1 if any would change
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

VOLATILE_NOTEBOOK_METADATA = ("widgets", "vscode")
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "scrolled", "collapsed")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}


def clean(nb: nbformat.NotebookNode) -> list[str]:
    """Clean ``nb`` in place; returns what was removed or reset, for the report."""
    changes = []
    for key in VOLATILE_NOTEBOOK_METADATA:
        if nb.metadata.pop(key, None) is not None:
            changes.append(f"metadata.{key}")
    if nb.metadata.get("language_info", {}).pop("version", None) is not None:
        changes.append("metadata.language_info.version")
    if nb.metadata.get("kernelspec") != KERNELSPEC:
        nb.metadata["kernelspec"] = nbformat.from_dict(KERNELSPEC)
        changes.append("metadata.kernelspec")
    for index, cell in enumerate(nb.cells):
        removed = [key for key in VOLATILE_CELL_METADATA if cell.metadata.pop(key, None) is not None]
        if removed:
            changes.append(f"cell {index}: metadata {', '.join(removed)}")
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.outputs:
            data = output.get("data")
            if data is not None and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                changes.append(f"cell {index}: widget view output")
                if not data:
                    continue
            kept.append(output)
        cell.outputs = kept
    return changes


def notebook_paths(paths: list[str]) -> list[Path]:
    found = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        elif path.suffix == ".ipynb" and path.is_file():
            found.append(path)
        else:
            raise ValueError(f"{name}: not a notebook or a directory")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["notebooks"], help="notebooks or directories (default: notebooks)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook would change")
    args = parser.parse_args(argv)

    try:
        paths = notebook_paths(args.paths)
    except ValueError as exc:
        parser.error(str(exc))
    dirty = 0
    for path in paths:
        text = path.read_text(encoding="utf-8")
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        changes = clean(nb)
        cleaned = nbformat.writes(nb)
        cleaned += "" if cleaned.endswith("\n") else "\n"
        if cleaned == text:
            continue
        dirty += 1
        what = "; ".join(changes) or "layout (not in nbformat's own JSON layout)"
        if args.check:
            print(f"{path}: would clean: {what}")
        else:
            path.write_text(cleaned, encoding="utf-8")
            print(f"{path}: cleaned: {what}")
    if args.check and dirty:
        print(f"{dirty} of {len(paths)} notebook(s) need cleaning: run python scripts/clean_notebooks.py "
              + " ".join(args.paths), file=sys.stderr)
        return 1
    if not paths:
        print(f"clean_notebooks: no notebooks under {', '.join(args.paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
