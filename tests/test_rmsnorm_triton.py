"""The Triton RMSNorm and fused add+RMSNorm against their references (interpreter on CPU), and
their compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.rmsnorm import (
    ADD_RMSNORM_SPEC,
    RMSNORM_SPEC,
    RMSNormConfig,
    _rmsnorm_kernel,
    add_rmsnorm,
    add_rmsnorm_ref,
    add_rmsnorm_triton,
    rmsnorm,
    rmsnorm_ref,
    rmsnorm_triton,
)
from qml_kernels.workbench.compile import compile_checks

# max |out - ref| / max |ref|, ref computed in fp32; fp16/bf16 allow a few output roundings
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
CONFIGS = {
    "default": RMSNormConfig(),
    # 64-wide chunks send every case wider than 64 through the two-pass path, 2 rows per program
    "chunked": RMSNormConfig(block_d=64, block_t=2),
}


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _upcast(inputs: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", RMSNORM_SPEC.cases, ids=lambda c: c.name)
def test_rmsnorm_matches_reference(case, dtype, config):
    seed, gen = _seeded()
    inputs = RMSNORM_SPEC.make_inputs(case, dtype, DEVICE, gen)
    out = _poisoned(inputs["x"])
    returned = rmsnorm_triton(**inputs, out=out, config=config)
    assert returned is out
    err = _rel_err(out, rmsnorm_ref(**_upcast(inputs)))
    assert err <= TOLERANCES[dtype], f"{case.name} ({case.edge}) {dtype} seed={seed}: rel err {err:.2e}"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ADD_RMSNORM_SPEC.cases, ids=lambda c: c.name)
def test_add_rmsnorm_matches_reference(case, dtype, config):
    seed, gen = _seeded()
    inputs = ADD_RMSNORM_SPEC.make_inputs(case, dtype, DEVICE, gen)
    out = (_poisoned(inputs["x"]), _poisoned(inputs["x"]))
    normed, summed = add_rmsnorm_triton(**inputs, out=out, config=config)
    assert normed is out[0] and summed is out[1]
    ref_normed, ref_summed = add_rmsnorm_ref(**_upcast(inputs))
    where = f"{case.name} ({case.edge}) {dtype} seed={seed}"
    err = _rel_err(normed, ref_normed)
    assert err <= TOLERANCES[dtype], f"{where}: normed rel err {err:.2e}"
    err = _rel_err(summed, ref_summed)
    assert err <= TOLERANCES[dtype], f"{where}: summed rel err {err:.2e}"
    # the returned sum is exactly what the unfused add would store in this dtype
    torch.testing.assert_close(summed, (inputs["x"].float() + inputs["residual"].float()).to(dtype),
                               rtol=0, atol=0, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_in_place(config):
    """``rmsnorm(..., out=x)`` and ``add_rmsnorm(..., out=(x, residual))`` overwrite their inputs."""
    seed, gen = _seeded()
    case = RMSNORM_SPEC.cases[1]
    inputs = ADD_RMSNORM_SPEC.make_inputs(case, torch.float32, DEVICE, gen)
    ref_normed, ref_summed = add_rmsnorm_ref(**inputs)
    x, residual = inputs["x"].clone(), inputs["residual"].clone()
    add_rmsnorm_triton(x, residual, inputs["weight"], inputs["eps"], inputs["offset"],
                       out=(x, residual), config=config)
    assert _rel_err(x, ref_normed) <= 1e-5, f"seed={seed}"
    assert _rel_err(residual, ref_summed) <= 1e-5, f"seed={seed}"

    x = inputs["x"].clone()
    ref = rmsnorm_ref(x, inputs["weight"], inputs["eps"], inputs["offset"])
    rmsnorm_triton(x, inputs["weight"], inputs["eps"], inputs["offset"], out=x, config=config)
    assert _rel_err(x, ref) <= 1e-5, f"seed={seed}"


def test_strided_rows():
    """Rows of a wider tensor (row stride > D), written into a strided output."""
    seed, gen = _seeded()
    wide = torch.randn(6, 200, generator=gen).to(DEVICE)  # [T, 200]
    x, residual, target = wide[:, :72], wide[:, 100:172], torch.full_like(wide, float("nan"))
    weight = torch.randn(72, generator=gen).to(DEVICE)
    normed, summed = add_rmsnorm_triton(x, residual, weight, 1e-6, out=(target[:, :72], target[:, 100:172]))
    ref_normed, ref_summed = add_rmsnorm_ref(x, residual, weight, 1e-6)
    assert _rel_err(normed, ref_normed) <= 1e-5 and _rel_err(summed, ref_summed) <= 1e-5, f"seed={seed}"
    assert target[:, 72:100].isnan().all() and target[:, 172:].isnan().all(), "wrote outside the rows"


def test_launcher_rejects_bad_arguments():
    x = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="weight must be"):
        rmsnorm_triton(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="last dimension must be contiguous"):
        rmsnorm_triton(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="residual: shape"):
        add_rmsnorm_triton(x, x[:2], torch.ones(64, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="out: dtype"):
        rmsnorm_triton(x, torch.ones(64, device=DEVICE), 1e-6, out=x.half())


def test_public_functions_dispatch_to_triton():
    """What the engine calls (``rmsnorm``, ``add_rmsnorm``) runs the kernel when triton is selected."""
    seed, gen = _seeded()
    inputs = ADD_RMSNORM_SPEC.make_inputs(RMSNORM_SPEC.cases[3], torch.float16, DEVICE, gen)
    x, residual, weight, eps, offset = (inputs[k] for k in ("x", "residual", "weight", "eps", "offset"))
    with registry.using("triton"):
        assert registry.select("rmsnorm", x, weight, eps, offset).name == "triton"
        assert registry.select("add_rmsnorm", x, residual, weight, eps, offset).name == "triton"
        out = rmsnorm(x, weight, eps, offset)
        normed, summed = add_rmsnorm(x, residual, weight, eps, offset)
    assert _rel_err(out, rmsnorm_ref(x.float(), weight.float(), eps, offset)) <= TOLERANCES[torch.float16]
    ref_normed, ref_summed = add_rmsnorm_ref(x.float(), residual.float(), weight.float(), eps, offset)
    assert _rel_err(normed, ref_normed) <= TOLERANCES[torch.float16], f"seed={seed}"
    assert _rel_err(summed, ref_summed) <= TOLERANCES[torch.float16], f"seed={seed}"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_SIGNATURE = {
    "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
    "T": "i32", "D": "i32", "stride_x": "i32", "stride_res": "i32", "stride_out": "i32", "stride_res_out": "i32",
    "eps": "fp32", "offset": "fp32",
    "BLOCK_T": "constexpr", "BLOCK_D": "constexpr", "ONE_CHUNK": "constexpr", "ADD_RESIDUAL": "constexpr",
}


def _variant(T: int, D: int, add: bool, config: RMSNormConfig = RMSNormConfig()) -> dict:
    """The bf16 kernel exactly as the launcher would specialise it for [T, D] rows."""
    block_t, block_d = config.tile(T, D)
    constexprs = {"BLOCK_T": block_t, "BLOCK_D": block_d, "ONE_CHUNK": D <= block_d, "ADD_RESIDUAL": add}
    # a real launch tells the compiler which sizes and strides are multiples of 16 (all of these are)
    divisible = ("D", "stride_x", "stride_res", "stride_out", "stride_res_out")
    return {"signature": _SIGNATURE, "constexprs": constexprs, "num_warps": config.num_warps,
            "divisible": divisible}


COMPILE_VARIANTS = {
    "rmsnorm-llama-4096": _variant(8192, 4096, add=False),
    "add_rmsnorm-llama-4096": _variant(8192, 4096, add=True),
    "rmsnorm-qk-norm-128": _variant(8192 * 32, 128, add=False),
    "add_rmsnorm-two-pass-16384": _variant(8192, 16384, add=True),
}

@pytest.fixture(scope="module")
def compile_reports() -> dict:
    requests = [dict(kernel=_rmsnorm_kernel, **variant) for variant in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in compile_checks(requests))))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    # a memory-bound row kernel needs few registers; spilling would add local-memory traffic
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    assert report["registers"] is None or report["registers"] <= 128, f"{name}: {report['registers']} registers"
    assert report["shared_bytes"] <= 1024, f"{name}: {report['shared_bytes']} B shared (only the row reduction)"
