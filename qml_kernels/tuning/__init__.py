"""Tuning tables: per shape, which implementation of an op was fastest on one GPU model, and
with which launch config, measured on that GPU and committed as JSON beside this module.

A table is ``<op>_<gpu>.json``::

    {"op": "linear", "device": "H200", "version": 1,
     "entries": [{"dtype": "bfloat16", "N": 4096, "K": 4096, "T": 2048,
                  "impl": "triton", "config": {"block_m": 128, "block_n": 256, ...}}]}

``device`` is matched as a substring of ``torch.cuda.get_device_name()``. Each entry holds the
op's key fields (for linear: dtype, N, K and the token bucket T, ``token_bucket``), the implementation's registry
name, and the launch-config fields for it (null for a vendor library). A shape that no entry
names gets the op's default; an op decides what that is (for linear: cuBLAS).

Only verified choices go in: the sweep that writes a table checks every candidate against
the reference before timing it (``qml_kernels.workbench.sweep``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_DIR = Path(__file__).parent
VERSION = 1


@dataclass(frozen=True)
class TuningEntry:
    impl: str
    config: Any = None  # the op's launch-config dataclass, or None


@dataclass(frozen=True)
class TuningTable:
    op: str
    device: str
    entries: Mapping[tuple, TuningEntry]
    source: str = ""

    def lookup(self, *key) -> TuningEntry | None:
        return self.entries.get(tuple(key))


def token_bucket(T: int) -> int:
    """The bucket a token count falls in: the next power of two (T = 1, 2, 4, ..., 2048, ...), except
    from 129 to 256 tokens, where it is the next multiple of 32 (160, 192, 224, 256).

    Why the finer steps there: a conversation's next turn (~130-220 new tokens, run in the prefill
    graphs of 160, 192 and 256 tokens) is where how a kernel's tiles fit T decides its speed (cuBLAS's
    96-token tiles compute 160 tokens as 192; ``qml_kernels.linear_narrow`` as 128 + 32).

    A table entry for bucket b was measured at T = b, the largest T it covers."""
    if 128 < T <= 256:
        return -(-T // 32) * 32
    return 1 if T <= 1 else 1 << (T - 1).bit_length()


def load_table(path: str | Path, op: str, key_fields: tuple[str, ...], impls: tuple[str, ...],
               make_config: Callable[..., Any] | None = None) -> TuningTable:
    """Read and validate one table; ``make_config(**fields)`` turns an entry's config into the op's dataclass."""
    path = Path(path)
    data = json.loads(path.read_text())

    def fail(why: str):
        raise ValueError(f"tuning table {path}: {why}")

    if data.get("version") != VERSION:
        fail(f"version {data.get('version')!r}, expected {VERSION}")
    if data.get("op") != op:
        fail(f"op {data.get('op')!r}, expected {op!r}")
    entries: dict[tuple, TuningEntry] = {}
    for i, row in enumerate(data.get("entries", [])):
        missing = [f for f in (*key_fields, "impl") if f not in row]
        if missing:
            fail(f"entry {i} lacks {missing}")
        if row["impl"] not in impls:
            fail(f"entry {i}: impl {row['impl']!r} is not one of {impls}")
        config = row.get("config")
        if config is not None and make_config is not None:
            try:
                config = make_config(**config)
            except (TypeError, ValueError) as exc:
                fail(f"entry {i}: bad config: {exc}")
        key = tuple(row[f] for f in key_fields)
        if key in entries:
            fail(f"entry {i} repeats the key {dict(zip(key_fields, key))}")
        entries[key] = TuningEntry(row["impl"], config)
    return TuningTable(op=op, device=str(data.get("device", "")), entries=entries, source=str(path))


def write_table(path: str | Path, op: str, device: str, entries: list[dict], about: str = "") -> Path:
    """Write a table from rows of key fields + ``impl`` + ``config`` (a launch-config dataclass or None)."""
    rows = [dict(row, config=dataclasses.asdict(row["config"]) if dataclasses.is_dataclass(row.get("config"))
                 else row.get("config")) for row in entries]
    data = {"op": op, "device": device, "version": VERSION, "about": about, "entries": rows}
    path = Path(path)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def find_table(op: str, device_name: str, **load_args) -> TuningTable | None:
    """The committed table of ``op`` for the GPU called ``device_name``, or None."""
    for path in sorted(TABLE_DIR.glob(f"{op}_*.json")):
        table = load_table(path, op, **load_args)
        if table.device and table.device in device_name:
            return table
    return None
