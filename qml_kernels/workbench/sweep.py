"""sweep(): time an op's Triton launcher over a grid of launch configs, to pick defaults on the GPU."""

from __future__ import annotations

import itertools
from dataclasses import fields
from typing import Any

import torch
from triton.runtime.errors import OutOfResources

from qml_kernels.workbench.bench import BenchResult, bench
from qml_kernels.workbench.check import check
from qml_kernels.workbench.spec import Case, spec_for


def config_grid(op: str, **choices: list[Any]) -> list[Any]:
    """Every combination of the given field values, as the op's launch config dataclass."""
    cls = spec_for(op).launch_config
    names = [f.name for f in fields(cls)]
    unknown = set(choices) - set(names)
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    keys = list(choices)
    return [cls(**dict(zip(keys, values))) for values in itertools.product(*(choices[k] for k in keys))]


def sweep(op: str, configs: list[Any], cases: list[Case] | None = None, dtype: torch.dtype = torch.bfloat16,
          impl: str = "triton") -> list[tuple[Any, BenchResult]]:
    """(config, result) for every config that passes the op's check on its small cases, on each case."""
    rows = []
    for config in configs:
        try:
            if not check(op, impl, dtypes=[dtype], config=config).ok:
                continue  # a fast wrong config is not a candidate
            rows += [(config, r) for r in bench(op, impl, cases=cases, dtype=dtype, config=config)]
        except OutOfResources:
            continue  # more shared memory or registers than the GPU has: not a candidate either
    return rows


def best_per_case(rows: list[tuple[Any, BenchResult]]) -> dict[str, tuple[Any, BenchResult]]:
    best: dict[str, tuple[Any, BenchResult]] = {}
    for config, r in rows:
        if r.case not in best or r.ms < best[r.case][1].ms:
            best[r.case] = (config, r)
    return best
