"""The decode expert FFN (``moe_decode``: gate+up with SwiGLU, down with the combine, routing inside)
against its reference and ``moe_forward``'s grouped path (interpreter on CPU), and compiled for Hopper."""

from __future__ import annotations

import os

import pytest
import torch

from qml_kernels import moe_decode as md
from qml_kernels import moe_gemm, registry
from qml_kernels.moe_decode import (
    MAX_TOKENS,
    MOE_DECODE_SPEC,
    MoEDecodeConfig,
    _down_kernel,
    _gate_up_kernel,
    moe_decode_ref,
    moe_decode_triton,
)
from qml_kernels.moe_gemm import moe_forward_ref
from qml_kernels.workbench.compile import assert_compiled_for_hopper
from qml_kernels.workbench.spec import Case

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# max |out - ref| / max |ref|; the reference rounds h to the dtype as the kernels do, so what is
# left is fp32 summation order and the output rounding
TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CONFIGS = {
    "default": MoEDecodeConfig(),
    # one row and 16-wide K steps: many programs and many steps with tails
    "narrow": MoEDecodeConfig(gate_up_block_n=1, gate_up_block_k=16, gate_up_warps=1,
                              down_block_n=2, down_block_k=16, down_warps=1),
    "wide": MoEDecodeConfig(gate_up_block_n=8, gate_up_block_k=1024, down_block_n=16, down_block_k=512),
}

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def _upcast(inputs: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite values in the output (an unwritten row?)"
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# every case under every config, but the many-step case under the narrow tiles (minutes in the interpreter)
CASE_CONFIGS = [pytest.param(case, config, id=f"{case.name}-{name}") for case in MOE_DECODE_SPEC.cases
                for name, config in CONFIGS.items() if not (name == "narrow" and case.name == "all-experts")]


@pytest.mark.parametrize("inline", [True, False], ids=["route-inline", "moe-router-first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,config", CASE_CONFIGS)
def test_matches_reference(case, config, dtype, inline):
    seed, gen = _seeded()
    inputs = MOE_DECODE_SPEC.make_inputs(case, dtype, DEVICE, gen)
    inputs["router_logits"] = inputs["router_logits"].float()  # the same routing whatever the dtype
    ref = moe_decode_ref(**inputs)
    out = torch.full_like(ref, float("nan"))
    assert moe_decode_triton(**inputs, out=out, config=config, route_inline=inline) is out
    err = _rel_err(out, moe_decode_ref(**_upcast(inputs)) if dtype == torch.float32 else ref)
    assert err <= TOLERANCES[dtype], f"{case.name} ({case.edge}) {dtype} seed={seed}: rel err {err:.2e}"


def test_reference_is_the_moe_ffn():
    """moe_decode_ref and moe_forward_ref are the same function (in fp32, where h is not rounded)."""
    _, gen = _seeded()
    for case in MOE_DECODE_SPEC.cases:
        inputs = MOE_DECODE_SPEC.make_inputs(case, torch.float32, torch.device("cpu"), gen)
        torch.testing.assert_close(moe_decode_ref(**inputs), moe_forward_ref(**inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, MAX_TOKENS])
def test_equals_the_grouped_path(T):
    """The same FFN as route -> align -> two grouped GEMMs -> combine (forced to Triton: the interpreter)."""
    gen = torch.Generator().manual_seed(T)
    case = Case("grouped", {"T": T, "E": 16, "k": 4, "D": 64, "I": 32})
    inputs = MOE_DECODE_SPEC.make_inputs(case, torch.float32, DEVICE, gen)
    with registry.using(moe_router="triton", moe_align="triton", moe_gemm="triton", moe_combine="triton",
                        moe_route="reference"):
        with _decode_path(False):
            grouped = moe_gemm.moe_forward(**inputs)
    torch.testing.assert_close(moe_decode_triton(**inputs), grouped, rtol=1e-5, atol=1e-5)


class _decode_path:
    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        self.saved = md.MOE_DECODE
        md.MOE_DECODE = self.on

    def __exit__(self, *exc):
        md.MOE_DECODE = self.saved


def test_moe_forward_takes_it_for_few_tokens_when_switched_on(monkeypatch):
    """Switched on, moe_forward hands 1 to MAX_TOKENS tokens on a GPU to moe_decode (here a CPU tensor is
    made to look like one), and keeps the grouped path for more tokens, on CPU, or when switched off
    (the default, ``QML_MOE_DECODE`` unset: slower on the H200)."""
    assert not md.MOE_DECODE or os.environ.get("QML_MOE_DECODE") == "1"
    gen = torch.Generator().manual_seed(5)
    E, k, D, ffn = 8, 2, 32, 16
    w_gate_up = torch.randn(E, 2 * ffn, D, generator=gen) * D**-0.5
    w_down = torch.randn(E, D, ffn, generator=gen) * ffn**-0.5
    calls = []
    monkeypatch.setattr(moe_gemm, "moe_decode", lambda *a: calls.append(a[0].shape[0]) or moe_decode_ref(*a))
    for T in (1, MAX_TOKENS, MAX_TOKENS + 1):
        x, logits = torch.randn(T, D, generator=gen), torch.randn(T, E, generator=gen)
        assert not md.decode_applies(x, logits, w_gate_up, w_down, k)  # on CPU: never
        with _decode_path(True):
            monkeypatch.setattr(moe_gemm, "decode_applies",
                                lambda *a: md.MOE_DECODE and md._supported(*a))
            got = moe_gemm.moe_forward(x, logits, w_gate_up, w_down, k, True)
        torch.testing.assert_close(got, moe_forward_ref(x, logits, w_gate_up, w_down, k, True), rtol=1e-5, atol=1e-5)
    assert calls == [1, MAX_TOKENS]
    with _decode_path(False):
        moe_gemm.moe_forward(torch.randn(1, D), torch.randn(1, E), w_gate_up, w_down, k, True)
    assert calls == [1, MAX_TOKENS]


def test_launcher_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    inputs = MOE_DECODE_SPEC.make_inputs(MOE_DECODE_SPEC.cases[0], torch.float32, torch.device("cpu"), gen)
    too_many = dict(inputs, x=torch.randn(MAX_TOKENS + 1, inputs["x"].shape[1]),
                    router_logits=torch.randn(MAX_TOKENS + 1, inputs["router_logits"].shape[1]))
    with pytest.raises(AssertionError, match="needs 1-4 tokens"):
        moe_decode_triton(**too_many)
    with pytest.raises(AssertionError, match="needs 1-4 tokens"):
        moe_decode_triton(**dict(inputs, w_down=inputs["w_down"].transpose(1, 2)))  # [E, I, D]: wrong shape
    with pytest.raises(AssertionError, match="out:"):
        moe_decode_triton(**inputs, out=torch.empty(1, 3))
    with pytest.raises(ValueError, match="power of 2"):
        MoEDecodeConfig(down_block_n=3)


def test_the_op_dispatches_to_triton_where_it_applies():
    gen = torch.Generator().manual_seed(1)
    inputs = MOE_DECODE_SPEC.make_inputs(MOE_DECODE_SPEC.cases[0], torch.float32, DEVICE, gen)
    with registry.using(moe_decode="triton"):
        assert registry.select("moe_decode", *inputs.values()).name == "triton"
        got = md.moe_decode(**inputs)
    torch.testing.assert_close(got, moe_decode_ref(**inputs), rtol=1e-5, atol=1e-5)


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

def _variant(kernel, inline: bool, config: MoEDecodeConfig = MoEDecodeConfig()) -> dict:
    """A kernel as the launcher specialises it for Qwen3-30B-A3B (128 experts, top-8, D 2048, I 768)."""
    gate_up = kernel is _gate_up_kernel
    names = ["x_ptr" if gate_up else "h_ptr", "w_ptr", "h_ptr" if gate_up else "out_ptr", "logits_ptr", "ids_ptr",
             "weights_ptr", "T", "E", "FFN" if gate_up else "D", "K", "stride_x" if gate_up else "stride_h",
             "stride_we", "stride_wn", "stride_h" if gate_up else "stride_out", "stride_logits"]
    types = ["*bf16", "*bf16", "*bf16", "*bf16", "*i32", "*fp32"] + ["i32"] * 9
    signature = dict(zip(names, types))
    signature.update({name: "constexpr" for name in ("TOP_K", "RENORMALIZE", "ROUTE_INLINE", "BLOCK_E",
                                                      "BLOCK_TOPK", "BLOCK_N", "BLOCK_K")})
    block_n = config.gate_up_block_n if gate_up else config.down_block_n
    block_k = config.gate_up_block_k if gate_up else config.down_block_k
    constexprs = dict(TOP_K=8, RENORMALIZE=True, ROUTE_INLINE=inline, BLOCK_E=128, BLOCK_TOPK=8,
                      BLOCK_N=block_n, BLOCK_K=block_k)
    divisible = tuple(n for n in names if n.startswith("stride") or n in ("FFN", "D", "K"))
    return {"kernel": kernel, "signature": signature, "constexprs": constexprs,
            "num_warps": config.gate_up_warps if gate_up else config.down_warps, "divisible": divisible}


COMPILE_VARIANTS = {
    f"{name}-{'inline' if inline else 'router-first'}": _variant(kernel, inline)
    for name, kernel in (("gate-up", _gate_up_kernel), ("down", _down_kernel)) for inline in (True, False)
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = assert_compiled_for_hopper(compile_reports[name], name)
    # the weight streams are read 16 bytes a thread (8 bf16): the vector width a stream needs
    assert "ld.global.v4" in report.ptx or "ld.global.nc.v4" in report.ptx, f"{name}: no 128-bit loads"
