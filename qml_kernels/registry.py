"""Op registry and dispatch: every op has a reference and may have faster implementations.

An implementation is registered under (op, name) with the devices it runs on and
an optional ``supports(*args, **kwargs)`` predicate for dtypes and shapes it can
handle. At call time the first registered implementation that runs on the
arguments' device and supports them is used; the reference is always last.

Forcing an implementation (for checks, benchmarks, or to run Triton in the
interpreter on CPU):

- environment: ``QML_KERNELS=triton`` (every op) or ``QML_KERNELS=rmsnorm=triton,rope=reference``;
- API: ``set_impl("triton")``, ``set_impl(rmsnorm="triton")``, or the context
  manager ``using("reference")``.

A forced implementation that cannot run the arguments raises ``KernelUnavailable``
rather than silently falling back: a check must test what it says it tests.
Triton on CPU tensors needs the interpreter (``TRITON_INTERPRET=1`` set before
Triton kernels are imported).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

REFERENCE = "reference"


class KernelUnavailable(RuntimeError):
    pass


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class Impl:
    op: str
    name: str
    fn: Callable
    devices: tuple[str, ...]
    supports: Callable[..., bool] | None = None

    def runs_on(self, device_type: str) -> bool:
        if device_type in self.devices:
            return True
        # Triton kernels run on CPU tensors under the interpreter
        return device_type == "cpu" and self.name == "triton" and triton_interpreter_on()

    def why_not(self, device_type: str, args, kwargs) -> str | None:
        if not self.runs_on(device_type):
            hint = " (set TRITON_INTERPRET=1 before importing qml_kernels)" if self.name == "triton" else ""
            return f"{self.op}/{self.name} does not run on {device_type}{hint}"
        if self.supports is not None and not self.supports(*args, **kwargs):
            return f"{self.op}/{self.name} does not support these arguments"
        return None


@dataclass
class _Registry:
    impls: dict[str, dict[str, Impl]] = field(default_factory=dict)
    forced: dict[str, str] = field(default_factory=dict)  # op (or "*") -> impl name


_REG = _Registry()


def register(op: str, name: str, fn: Callable, devices: tuple[str, ...] = ("cuda",),
             supports: Callable[..., bool] | None = None) -> Callable:
    """Add an implementation; returns ``fn`` so it can be used as a plain function too."""
    if name == REFERENCE:
        devices = ("cpu", "cuda")
    _REG.impls.setdefault(op, {})[name] = Impl(op, name, fn, devices, supports)
    return fn


def get_impl(op: str, name: str) -> Impl:
    if op not in _REG.impls:
        raise KeyError(f"unknown op {op!r} (known: {', '.join(sorted(_REG.impls))})")
    if name not in _REG.impls[op]:
        raise KernelUnavailable(f"{op} has no implementation {name!r} (it has {', '.join(_REG.impls[op])})")
    return _REG.impls[op][name]


def implementations(op: str) -> list[str]:
    return list(_REG.impls[op])


def ops() -> list[str]:
    return list(_REG.impls)


def _parse_setting(text: str) -> dict[str, str]:
    forced = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        op, _, name = part.rpartition("=")
        forced[op or "*"] = name
    return forced


def set_impl(default: str | None = None, **per_op: str) -> None:
    """Force implementations: ``set_impl("triton")``, ``set_impl(rope="reference")``; ``set_impl()`` clears."""
    if default is None and not per_op:
        _REG.forced.clear()
        return
    if default is not None:
        _REG.forced["*"] = default
    _REG.forced.update(per_op)


@contextlib.contextmanager
def using(default: str | None = None, **per_op: str):
    saved = dict(_REG.forced)
    try:
        set_impl(default, **per_op)
        yield
    finally:
        _REG.forced.clear()
        _REG.forced.update(saved)


def forced_impl(op: str) -> str | None:
    """The implementation forced for ``op``: its own setting, else the global one if ``op`` has it."""
    if op in _REG.forced:
        return _REG.forced[op]
    name = _REG.forced.get("*")
    return name if name in _REG.impls.get(op, {}) else None


def _device_type(args, kwargs) -> str:
    """Where the op runs: the first tensor not in host memory. An op may take pinned host memory
    beside device tensors (``page_save`` writes into host rows passed first), and the device's
    implementation is the one that reads or writes it in place; the reference would copy it
    through pageable memory on the calling thread (3 GB in ~3 s on the H200)."""
    for value in args:  # (called for every kernel launch: no lists built, the first device tensor wins)
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device.type
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            return value.device.type
    return "cpu"


def select(op: str, *args: Any, **kwargs: Any) -> Impl:
    """The implementation that will run ``op`` on these arguments."""
    table = _REG.impls[op]
    device = _device_type(args, kwargs)
    name = forced_impl(op)
    if name is not None:
        if name not in table:
            raise KernelUnavailable(f"{op} has no implementation {name!r} (it has {', '.join(table)})")
        reason = table[name].why_not(device, args, kwargs)
        if reason:
            raise KernelUnavailable(reason)
        return table[name]
    if device == "cpu":
        return table[REFERENCE]
    for impl in table.values():
        if impl.name != REFERENCE and impl.why_not(device, args, kwargs) is None:
            return impl
    return table[REFERENCE]


def dispatch(op: str) -> Callable:
    """A function that runs ``op`` with the implementation ``select`` picks for each call."""

    def run(*args, **kwargs):
        return select(op, *args, **kwargs).fn(*args, **kwargs)

    run.__name__ = op
    return run


_REG.forced.update(_parse_setting(os.environ.get("QML_KERNELS", "")))
