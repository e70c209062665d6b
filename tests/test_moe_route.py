"""The fused decode routing (``moe_route``): router and expert grouping in one launch, equal to
``moe_router`` then ``moe_align``. Triton runs in the interpreter on CPU (fp32, fp16); the
kernel is also compiled for Hopper."""

from __future__ import annotations

import os

import pytest
import torch

from qml_kernels import moe_gemm, moe_route, registry
from qml_kernels.moe_route import (
    MOE_ROUTE_SPEC,
    _blocks,
    _moe_route_kernel,
    _num_warps,
    _supported,
    moe_route_ref,
    moe_route_triton,
)
from qml_kernels.workbench import check
from qml_kernels.workbench.compile import assert_compiled_for_hopper

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# (tokens, experts, top-k, block rows, logits): the edges of routing and grouping
CASES = {
    "decode-qwen3-30b-a3b": (1, 128, 8, 16, "random"),
    "batch-16-qwen3-30b-a3b": (16, 128, 8, 16, "random"),
    "batch-3-odd": (3, 128, 8, 16, "random"),
    "prime-experts": (5, 61, 3, 16, "random"),
    "top-1": (9, 32, 1, 8, "random"),
    "all-to-one-expert": (7, 16, 2, 4, "hot"),
    "ties": (4, 64, 8, 16, "ties"),
    "block-1": (2, 8, 8, 1, "random"),  # every expert chosen by every token
}


def _logits(T: int, E: int, kind: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(T, E, generator=gen)
    if kind == "hot":  # expert 0 first, expert 1 second for every token
        x[:, 0] += 50
        x[:, 1] += 25
    elif kind == "ties":  # a few values only: many equal logits, which go to the lower id
        x = (x * 2).round() / 2
    return x.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_fused_route_equals_router_then_align(name, dtype):
    T, E, k, block, kind = CASES[name]
    seed = int.from_bytes(os.urandom(4), "little")
    logits = _logits(T, E, kind, dtype, torch.Generator().manual_seed(seed))
    assert _supported(logits, k, True, block)
    for renorm in (True, False):
        got = moe_route_triton(logits, k, renorm, block)
        want = moe_route_ref(logits, k, renorm, block)
        where = f"{name} renorm={renorm} seed={seed}"
        torch.testing.assert_close(got[0].cpu(), want[0].cpu(), rtol=1e-6, atol=1e-6, msg=where)
        for i, part in enumerate(("ids", "sorted_pairs", "expert_offsets", "inverse"), start=1):
            assert torch.equal(got[i].cpu(), want[i].cpu()), f"{where}: {part} differ"


def test_the_workbench_check_passes_with_poisoned_outputs():
    """The op's shape table through ``check``: fresh inputs, outputs poisoned (NaN, -1) before the
    run, so an entry the kernel leaves unwritten fails."""
    report = check("moe_route", "triton", dtypes=DTYPES)
    assert len(report.results) == len(MOE_ROUTE_SPEC.cases) * len(DTYPES)
    report.raise_if_failed()


def test_out_must_match_the_result():
    logits = torch.randn(2, 16, device=DEVICE)
    good = moe_route_ref(logits, 4, True, 8)
    bad = (good[0], good[1].long(), *good[2:])
    with pytest.raises(AssertionError, match=r"out\[1\] must be contiguous torch.int32"):
        moe_route_triton(logits, 4, True, 8, out=bad)


def test_only_few_tokens_are_fused():
    logits = torch.zeros(17, 128, device=DEVICE)
    assert not _supported(logits, 8, True, 16)  # past MAX_TOKENS
    assert _supported(logits[:16], 8, True, 16)
    assert not _supported(torch.zeros(16, 256, device=DEVICE), 8, True, 16)  # a one-hot tile past MAX_TILE
    assert not _supported(logits[:4].t(), 8, True, 16)  # experts not contiguous
    with pytest.raises(AssertionError, match="use moe_router"):
        moe_route_triton(logits, 8, True, 16)


def test_moe_forward_takes_the_fused_path_when_switched_on(monkeypatch):
    """``QML_FUSED_MOE_ROUTE`` (on by default): moe_forward routes through ``moe_route`` (forced to Triton
    here, so the interpreter runs it on CPU) and gives the same output as the two-op path (switched off)."""
    gen = torch.Generator().manual_seed(3)
    T, E, k, D, inner = 2, 16, 4, 32, 24
    # on the device: the Triton kernel takes its tensors (on the H200 a CPU tensor is refused)
    x = torch.randn(T, D, generator=gen).to(DEVICE)
    logits = torch.randn(T, E, generator=gen).to(DEVICE)
    w_gate_up = (torch.randn(E, 2 * inner, D, generator=gen) * D**-0.5).to(DEVICE)
    w_down = (torch.randn(E, D, inner, generator=gen) * inner**-0.5).to(DEVICE)
    monkeypatch.setattr(moe_route, "FUSED_MOE_ROUTE", False)
    want = moe_gemm.moe_forward(x, logits, w_gate_up, w_down, k, True)
    calls = []
    real = moe_route.moe_route_triton
    monkeypatch.setattr(moe_route, "FUSED_MOE_ROUTE", True)
    monkeypatch.setattr(moe_gemm, "fused_route_applies",
                        lambda *a: moe_route.FUSED_MOE_ROUTE and _supported(*a))
    monkeypatch.setattr(moe_gemm, "moe_route", lambda *a: calls.append(a) or real(*a))
    got = moe_gemm.moe_forward(x, logits, w_gate_up, w_down, k, True)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_moe_forward_takes_the_fused_path_only_for_a_few_tokens():
    # Qwen3-30B-A3B: 128 experts, top-8; timed on the H200 at 1 token, taken by default up to 4
    assert [moe_route.within_default_tile(T, 128, 8, 16) for T in (1, 2, 4, 5, 8, 16)] == [True] * 3 + [False] * 3
    assert not moe_route.fused_route_applies(torch.randn(1, 128), 8, True, 16)  # a CPU tensor: the two ops


def test_the_op_dispatches_to_triton_where_it_applies():
    logits = torch.randn(1, 128, device=DEVICE)
    with registry.using(moe_route="triton"):
        assert registry.select("moe_route", logits, 8, True, 16).name == "triton"
        got = moe_route.moe_route(logits, 8, True, 16)
    want = moe_route_ref(logits, 8, True, 16)
    assert all(torch.equal(a, b) for a, b in zip(got[1:], want[1:]))
    if DEVICE.type == "cuda":  # past one program's tile: the reference (moe_forward keeps the two ops)
        assert registry.select("moe_route", torch.randn(64, 128, device=DEVICE), 8, True, 16).name == "reference"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_SIG = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "sorted_pairs_ptr": "*i32",
        "offsets_ptr": "*i32", "inverse_ptr": "*i32", "T": "i32", "E": "i32", "R": "i32", "stride_logits": "i32",
        "TOP_K": "constexpr", "RENORMALIZE": "constexpr", "ALIGN": "constexpr", "BLOCK_T": "constexpr",
        "BLOCK_E": "constexpr", "BLOCK_K": "constexpr", "PAD_COLS": "constexpr", "BLOCK_TAIL": "constexpr"}


def _variant(T: int) -> dict:
    blocks = _blocks(T, 128, 8, 16)
    return {"kernel": _moe_route_kernel, "signature": _SIG, "num_warps": _num_warps(blocks),
            "constexprs": dict(TOP_K=8, RENORMALIZE=True, ALIGN=16, **blocks)}


COMPILE_VARIANTS = {"route-qwen3-30b-a3b-decode": _variant(1), "route-qwen3-30b-a3b-16-tokens": _variant(16)}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = assert_compiled_for_hopper(compile_reports[name], name)
    assert report.registers is None or report.registers <= 255, f"{name}: {report.registers} registers"
