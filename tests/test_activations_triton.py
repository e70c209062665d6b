"""The Triton SwiGLU and GeGLU against their references (interpreter on CPU), and their
compilation for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from qml_kernels import registry
from qml_kernels.activations import (
    GEGLU_SPEC,
    SWIGLU_SPEC,
    GatedActivationConfig,
    _gated_activation_kernel,
    geglu,
    geglu_ref,
    geglu_triton,
    swiglu,
    swiglu_ref,
    swiglu_triton,
)
from qml_kernels.workbench.compile import compile_checks

# max |out - ref| / max |ref|, ref computed in fp32; fp16/bf16 allow a few output roundings
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
OPS = {"swiglu": (SWIGLU_SPEC, swiglu_triton, swiglu), "geglu": (GEGLU_SPEC, geglu_triton, geglu)}
CONFIGS = {
    "default": GatedActivationConfig(),
    # 16-column blocks: every case spans several column blocks per row
    "narrow-blocks": GatedActivationConfig(block_i=16, num_warps=1),
}

# the gates reach the tail where the sigmoid's exp(-z) overflows to inf on purpose (the result
# is then exactly 0); numpy, which runs the interpreter, warns about that
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten NaN-poisoned element?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SWIGLU_SPEC.cases, ids=lambda c: c.name)
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, case, dtype, config):
    spec, launcher, _ = OPS[op]
    seed, gen = _seeded()
    inputs = spec.make_inputs(case, dtype, DEVICE, gen)
    T, two_i = inputs["gate_up"].shape
    out = torch.full((T, two_i // 2), float("nan"), dtype=dtype, device=DEVICE)
    returned = launcher(**inputs, out=out, config=config)
    assert returned is out
    err = _rel_err(out, spec.reference(inputs["gate_up"].float()))
    assert err <= TOLERANCES[dtype], f"{op} {case.name} ({case.edge}) {dtype} seed={seed}: rel err {err:.2e}"


@pytest.mark.parametrize("op", OPS)
def test_strided_rows(op):
    """gate_up as the first 2I columns of a wider row (row stride > 2I), into a strided output."""
    spec, launcher, _ = OPS[op]
    seed, gen = _seeded()
    wide = torch.randn(5, 300, generator=gen).to(DEVICE)  # [T, 300]
    target = torch.full((5, 100), float("nan"), device=DEVICE)
    out = launcher(wide[:, :120], out=target[:, 10:70])
    assert _rel_err(out, spec.reference(wide[:, :120])) <= 1e-5, f"seed={seed}"
    assert target[:, :10].isnan().all() and target[:, 70:].isnan().all(), "wrote outside the output rows"


def test_saturating_gates_are_exact():
    """Far negative gates give exactly 0 (the exp overflows to inf, never to NaN); far positive ones
    give gate * up."""
    gate_up = torch.tensor([[-200.0, -1e4, 200.0, 50.0, 3.0, 3.0, 2.0, 0.5]], device=DEVICE)  # [1, 2I]
    for launcher in (swiglu_triton, geglu_triton):
        out = launcher(gate_up)
        assert out[0, :2].eq(0).all() and torch.isfinite(out).all(), f"{launcher.__name__}: {out}"
        torch.testing.assert_close(out[0, 2:], torch.tensor([400.0, 25.0], device=DEVICE))


def test_launcher_rejects_bad_arguments():
    gate_up = torch.randn(4, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="must be even"):
        swiglu_triton(torch.randn(4, 63, device=DEVICE))
    with pytest.raises(AssertionError, match="last dimension must be contiguous"):
        swiglu_triton(gate_up.t())
    with pytest.raises(AssertionError, match=r"out: shape"):
        geglu_triton(gate_up, out=torch.empty(4, 64, device=DEVICE))
    with pytest.raises(AssertionError, match="out: dtype"):
        geglu_triton(gate_up, out=torch.empty(4, 32, device=DEVICE, dtype=torch.float16))


@pytest.mark.parametrize("op", OPS)
def test_public_function_dispatches_to_triton(op):
    """What the engine calls (``swiglu``, ``geglu``) runs the kernel when triton is selected."""
    spec, _, public = OPS[op]
    seed, gen = _seeded()
    gate_up = spec.make_inputs(spec.cases[2], torch.float16, DEVICE, gen)["gate_up"]
    with registry.using("triton"):
        assert registry.select(op, gate_up).name == "triton"
        out = public(gate_up)
    assert _rel_err(out, spec.reference(gate_up.float())) <= TOLERANCES[torch.float16], f"seed={seed}"


def test_references_are_the_textbook_formulas():
    """The fp32 references against the formulas written out, so the kernel is not checked
    against a wrong reference."""
    gate_up = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    g, u = gate_up[:, :10], gate_up[:, 10:]
    torch.testing.assert_close(swiglu_ref(gate_up), g / (1 + torch.exp(-g)) * u)
    gelu = 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g**3)))
    torch.testing.assert_close(geglu_ref(gate_up), gelu * u)


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_SIGNATURE = {"gate_up_ptr": "*bf16", "out_ptr": "*bf16", "I": "i32", "stride_in": "i32", "stride_out": "i32",
              "GELU_TANH": "constexpr", "BLOCK_I": "constexpr"}
COMPILE_VARIANTS = {
    op: {"signature": _SIGNATURE, "constexprs": {"GELU_TANH": op == "geglu", "BLOCK_I": config.block_i},
         "num_warps": config.num_warps}
    for op, config in (("swiglu", GatedActivationConfig()), ("geglu", GatedActivationConfig()))
}

@pytest.fixture(scope="module")
def compile_reports() -> dict:
    requests = [dict(kernel=_gated_activation_kernel, **variant) for variant in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in compile_checks(requests))))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    assert report["registers"] is None or report["registers"] <= 64, f"{name}: {report['registers']} registers"
    assert report["shared_bytes"] == 0, f"{name}: an elementwise kernel needs no shared memory"
