"""The workbench itself: check() must catch what it claims to catch, bench() and compile_check() must run."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from qml_kernels import registry
from qml_kernels.workbench import Case, OpSpec, bench, check, compile_check, register_spec


def _double_ref(x, out=None):
    assert x.dtype == torch.float32, "the reference must see inputs upcast to fp32"
    return x * 2


def _good(x, out=None):
    out = torch.empty_like(x) if out is None else out
    return torch.mul(x, 2, out=out)


def _lazy(x, out=None):  # forgets the last element: only a poisoned output reveals it
    out = torch.empty_like(x) if out is None else out
    out[:-1] = x[:-1] * 2
    return out


def _off(x, out=None):
    return x * 2 + 0.01 * x.abs().max()


def _nan(x, out=None):
    y = x * 2
    y[0] = float("nan")
    return y


TOY = "toy_double"
CASES = (Case("one", {"n": 1}, "a single element"), Case("odd", {"n": 333}, "odd length"))
register_spec(OpSpec(op=TOY, reference=_double_ref, cases=CASES,
                     make_inputs=lambda case, dtype, dev, gen: {"x": torch.randn(case.dims["n"], generator=gen,
                                                                                  device=dev).to(dtype)},
                     bytes_moved=lambda inp: 2 * inp["x"].numel() * inp["x"].element_size()))
for name, fn in [("reference", _double_ref), ("good", _good), ("lazy", _lazy), ("off", _off), ("nan", _nan)]:
    registry.register(TOY, name, fn, devices=("cpu", "cuda"))


def test_check_passes_a_correct_implementation():
    report = check(TOY, "good")
    assert report.ok, str(report)
    assert {r.dtype for r in report.results} == {torch.float32, torch.float16, torch.bfloat16}


@pytest.mark.parametrize("impl, why", [("lazy", "non-finite"), ("off", "err"), ("nan", "non-finite")])
def test_check_catches_bad_implementations(impl, why):
    report = check(TOY, impl, dtypes=[torch.float32])
    assert not report.ok
    assert why in str(report)
    with pytest.raises(AssertionError):
        report.raise_if_failed()


def test_check_reports_seeds_that_replay():
    a = check(TOY, "good", dtypes=[torch.float32], seed=123)
    assert all(r.seed == 123 for r in a.results)


def test_bench_on_cpu_reports_bytes_and_rates():
    results = bench(TOY, "good", dtype=torch.float32)
    assert [r.case for r in results] == ["one", "odd"]
    assert results[1].bytes == 2 * 333 * 4 and results[1].ms > 0 and results[1].gbps > 0


def test_forced_implementation_and_errors():
    run = registry.dispatch(TOY)
    x = torch.randn(5)
    with registry.using(**{TOY: "off"}):
        assert registry.select(TOY, x).name == "off"
        assert not torch.equal(run(x), x * 2)
    assert registry.select(TOY, x).name == "reference"  # CPU default, and the setting was restored
    with registry.using(**{TOY: "missing"}), pytest.raises(registry.KernelUnavailable, match="no implementation"):
        run(x)


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    tl.store(y_ptr + offs, (2 * x).to(y_ptr.dtype.element_ty), mask=mask)


def test_compile_check_for_hopper_without_a_gpu():
    sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "n": "i32", "BLOCK": "constexpr"}
    good = compile_check(_scale_kernel, sig, {"BLOCK": 1024})
    assert good.ok, good.error
    assert ".target sm_90a" in good.ptx
    assert good.registers and good.registers > 0 and good.spills == 0
    assert not good.has_wgmma and not good.has_tma
    bad = compile_check(_scale_kernel, sig, {"BLOCK": 1000})  # arange needs a power of two
    assert not bad.ok and "power of 2" in bad.error
