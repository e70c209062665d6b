"""What the workbench needs to know about an op to check and benchmark it.

Each op module declares one ``OpSpec`` and passes it to ``register_spec``:
- a shape table (``cases``: small shapes, each naming the edge it hits; run on CPU
  in the Triton interpreter and on the GPU) and ``model_cases`` (real model sizes,
  GPU only);
- ``make_inputs``: fresh random inputs for a case as keyword arguments of the op;
- ``reference``: the op's ``_ref`` function, called on the same inputs upcast to fp32;
- ``bytes_moved`` / ``flops``: the traffic and work of one call, written out in code,
  from which GB/s and TFLOP/s are reported;
- ``exact``: compare bit for bit (dequantization) instead of by relative error;
- ``out_arg``: the name of the op's optional output argument; the check passes a
  NaN-poisoned tensor there, so an element the kernel forgets to write fails.
- ``launch_config``: the frozen dataclass of the Triton launcher's tunables
  (block sizes, warps, stages), which the tuning panel edits; None if it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Case:
    name: str
    dims: dict[str, Any]
    edge: str = ""  # which edge this case exercises (odd size, one token, page boundary...)


@dataclass(frozen=True)
class OpSpec:
    op: str
    reference: Callable
    make_inputs: Callable[[Case, torch.dtype, torch.device, torch.Generator], dict[str, Any]]
    cases: tuple[Case, ...]
    model_cases: tuple[Case, ...] = ()
    bytes_moved: Callable[[dict[str, Any]], int] = lambda inputs: 0
    flops: Callable[[dict[str, Any]], int] = lambda inputs: 0
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    exact: bool = False
    out_arg: str | None = "out"
    launch_config: type | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


_SPECS: dict[str, OpSpec] = {}


def register_spec(spec: OpSpec) -> OpSpec:
    _SPECS[spec.op] = spec
    return spec


def spec_for(op: str) -> OpSpec:
    if op not in _SPECS:
        raise KeyError(f"no OpSpec registered for {op!r} (registered: {', '.join(sorted(_SPECS))})")
    return _SPECS[op]


def all_specs() -> dict[str, OpSpec]:
    return dict(_SPECS)
