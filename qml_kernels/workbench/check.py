"""check(): an implementation of an op against its reference, case by case.

Each run draws fresh random inputs (the seed is in the report, so a failure can be
replayed with ``seed=``), poisons the outputs with NaN (or -1 for integers) so an
element the kernel forgets to write fails, runs the reference on the same inputs
upcast to fp32, and compares by the error relative to the reference's largest
magnitude, against a tolerance per dtype. Dequantization compares bit for bit.
NaN never passes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from qml_kernels import registry
from qml_kernels.workbench.spec import Case, spec_for

# max |got - ref| / max |ref|: a few units in the last place of each dtype, with room
# for reductions of a few thousand terms
TOLERANCES = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class CaseResult:
    case: Case
    dtype: torch.dtype
    seed: int
    ok: bool
    error: float  # relative to max |ref|; 0 or 1 in exact mode
    tolerance: float
    worst: list[tuple[tuple[int, ...], float, float]] = field(default_factory=list)  # (index, got, expected)
    message: str = ""

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        dt = str(self.dtype).removeprefix("torch.")
        text = f"{status} {self.case.name:<28} {dt:<9} err {self.error:.2e} (tol {self.tolerance:.0e}) seed {self.seed}"
        if self.message:
            text += f"  {self.message}"
        for idx, got, exp in self.worst if not self.ok else []:
            text += f"\n       at {idx}: got {got!r}, expected {exp!r}"
        return text


@dataclass
class CheckReport:
    op: str
    impl: str
    device: str
    results: list[CaseResult]

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(r.ok for r in self.results)

    def __str__(self) -> str:
        head = f"check {self.op}/{self.impl} on {self.device}: " + ("all passed" if self.ok else "FAILED")
        return "\n".join([head, *(r.line() for r in self.results)])

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(str(self))


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        # always a copy: a reference that writes in place (caches) must not touch the impl's inputs
        return value.to(torch.float32, copy=True)
    if isinstance(value, dict):
        return {k: _upcast(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_upcast(v) for v in value)
    return value


def _poison(like: torch.Tensor) -> torch.Tensor:
    fill = float("nan") if like.is_floating_point() else -1
    return torch.full_like(like, fill)


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _compare(got: torch.Tensor, expected: torch.Tensor, exact: bool, tol: float):
    """(ok, error, worst elements, message) for one output tensor."""
    if got.shape != expected.shape:
        return False, float("inf"), [], f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if exact:
        exp = expected.to(got.dtype)
        if got.is_floating_point():
            same = (got == exp) | (got.isnan() & exp.isnan())
            same &= torch.signbit(got) == torch.signbit(exp)  # -0.0 vs 0.0 counts too
        else:
            same = got == exp
        bad = (~same).nonzero()
        worst = [(tuple(i.tolist()), got[tuple(i)].item(), exp[tuple(i)].item()) for i in bad[:5]]
        return bad.numel() == 0, float(bad.shape[0] > 0), worst, f"{bad.shape[0]} elements differ" if len(bad) else ""
    g, e = got.double(), expected.double()
    if not torch.isfinite(g).all():
        where = (~torch.isfinite(g)).nonzero()[:5]
        return False, float("nan"), [(tuple(i.tolist()), g[tuple(i)].item(), e[tuple(i)].item()) for i in where], \
            "non-finite output"
    diff = (g - e).abs()
    scale = e.abs().max().item() or 1.0
    err = diff.max().item() / scale
    order = diff.flatten().topk(min(5, diff.numel())).indices
    worst = [(tuple(torch.unravel_index(i, diff.shape)[k].item() for k in range(diff.dim())),
              g.flatten()[i].item(), e.flatten()[i].item()) for i in order]
    return err <= tol, err, worst, ""


def check(op: str, impl: str = "triton", cases: list[Case] | None = None, dtypes=None, device=None,
          seed: int | None = None, config: Any = None) -> CheckReport:
    """Run ``op``'s implementation ``impl`` on each case and dtype and compare with the reference.

    ``cases`` defaults to the op's small shape table; ``dtypes`` to the spec's, minus
    bf16 when Triton runs in the CPU interpreter (which computes bf16 wrongly);
    ``config`` is passed to the launcher (tuning).
    """
    spec = spec_for(op)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fn = registry.get_impl(op, impl).fn
    if dtypes is None:
        dtypes = [d for d in spec.dtypes if not (dev.type == "cpu" and impl == "triton" and d == torch.bfloat16)]
    extra = {} if config is None else {"config": config}
    out_args = _as_tuple(spec.out_arg) if spec.out_arg else ()
    results = []
    for case in cases or spec.cases:
        for dtype in dtypes:
            case_seed = seed if seed is not None else random.getrandbits(48)
            gen = torch.Generator(dev).manual_seed(case_seed)
            inputs = spec.make_inputs(case, dtype, dev, gen)
            expected = _as_tuple(spec.reference(**_upcast(inputs)))
            kwargs = dict(inputs, **extra)
            if out_args:
                probe = _as_tuple(fn(**kwargs))  # learn the output shapes and dtypes
                poisoned = [_poison(p) for p in probe]
                if len(out_args) == 1:
                    kwargs[out_args[0]] = poisoned[0] if len(poisoned) == 1 else tuple(poisoned)
                else:
                    kwargs.update(zip(out_args, poisoned))
            got = _as_tuple(fn(**kwargs))
            tol = 0.0 if spec.exact else TOLERANCES.get(dtype, 1e-2)
            outcomes = [_compare(g, e, spec.exact, tol) for g, e in zip(got, expected)]
            # report the first failing output, else the one with the largest error
            failing = [o for o in outcomes if not o[0]]
            ok, err, worst, msg = failing[0] if failing else max(outcomes, key=lambda o: o[1])
            if len(got) != len(expected):
                ok, msg = False, f"{len(got)} outputs, the reference has {len(expected)}"
            results.append(CaseResult(case, dtype, case_seed, ok, err, tol, worst, msg))
    return CheckReport(op, impl, str(dev), results)
