"""The MoE layer's decode entry and exit fused with the norms beside them (``moe_norm_route``,
``moe_combine_rmsnorm``): equal to the ops they replace, the entry's done-counter left at zero, the
limits, and compiled for Hopper. Triton runs in the interpreter on CPU (fp32, fp16)."""

from __future__ import annotations

import os

import pytest
import torch

from qml_kernels import moe_fused_norms, registry
from qml_kernels.linear import linear_ref
from qml_kernels.moe_fused_norms import (
    MOE_COMBINE_RMSNORM_SPEC,
    MOE_NORM_ROUTE_SPEC,
    PendingCombine,
    _counter,
    _moe_combine_rmsnorm_kernel,
    _moe_norm_route_kernel,
    combine_add_rmsnorm,
    fused_ffn_applies,
    moe_combine_rmsnorm_ref,
    moe_combine_rmsnorm_triton,
    moe_norm_route_ref,
    moe_norm_route_triton,
)
from qml_kernels.moe_route import _blocks as route_blocks
from qml_kernels.moe_route import moe_route_ref
from qml_kernels.rmsnorm import add_rmsnorm_ref
from qml_kernels.workbench import check
from qml_kernels.workbench.compile import assert_compiled_for_hopper

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])

# (tokens, hidden, experts, top-k, router rows per program): the entry's edges
ENTRY = {
    "decode-qwen3-30b-a3b": (1, 2048, 128, 8, 8),
    "four-tokens": (4, 256, 128, 8, 8),
    "prime-experts-odd-width": (3, 200, 61, 3, 4),  # 16 programs, the last one partly past E
    "one-program": (2, 64, 8, 2, 8),  # the only program is also the last
    "many-programs": (1, 96, 64, 4, 1),  # 64 programs of one router row each
}


def _entry_inputs(T, D, E, dtype, gen):
    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype)

    return randn(T, D), randn(T, D, scale=2.0), randn(D, scale=0.1) + 1.0, randn(E, D, scale=D**-0.5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ENTRY)
def test_entry_equals_norm_then_router_then_route(name, dtype):
    T, D, E, k, block_en = ENTRY[name]
    seed = int.from_bytes(os.urandom(4), "little")
    h, residual, norm_w, router = _entry_inputs(T, D, E, dtype, torch.Generator().manual_seed(seed))
    config = moe_fused_norms.MoEFusedNormsConfig(block_en=block_en)
    for renorm in (True, False):
        got = moe_norm_route_triton(h, residual, norm_w, 1e-6, router, k, renorm, 16, config=config)
        where = f"{name} {dtype} renorm={renorm} seed={seed}"
        x_want, s_want = add_rmsnorm_ref(h, residual, norm_w, 1e-6)
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got[1], s_want, rtol=0, atol=0, msg=where)  # the same add, rounded once
        torch.testing.assert_close(got[0].float(), x_want.float(), rtol=tol, atol=tol, msg=where)
        # the routing of the kernel's own x (the router's sum order aside, what the unfused ops would do)
        want = moe_route_ref(linear_ref(got[0], router), k, renorm, 16)
        torch.testing.assert_close(got[2], want[0], rtol=1e-3, atol=1e-4, msg=where)
        for i, part in enumerate(("ids", "sorted_pairs", "expert_offsets", "inverse"), start=1):
            assert torch.equal(got[2 + i].cpu(), want[i].cpu()), f"{where}: {part} differ"
        assert _counter(h.device).item() == 0, f"{where}: the done-counter must be back at 0"


def test_entry_runs_again_from_the_reset_counter():
    """Two launches in a row give the same result: the last program of the first put the counter back."""
    gen = torch.Generator().manual_seed(1)
    h, residual, norm_w, router = _entry_inputs(1, 128, 32, torch.float32, gen)
    first = moe_norm_route_triton(h, residual, norm_w, 1e-6, router, 4, True, 16)
    second = moe_norm_route_triton(h, residual, norm_w, 1e-6, router, 4, True, 16)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_entry_counter_left_wrong_is_seen():
    """A counter not at zero (a launch that died mid-way) leaves no program to route: the check must see
    it, so the test above is not vacuous. The counter is then reset for the rest of the session."""
    gen = torch.Generator().manual_seed(2)
    h, residual, norm_w, router = _entry_inputs(1, 128, 32, torch.float32, gen)
    counter = _counter(h.device)
    counter.fill_(1000)  # past any program count: no program sees itself last
    try:
        got = moe_norm_route_triton(h, residual, norm_w, 1e-6, router, 4, True, 16,
                                    out=moe_norm_route_ref(h, residual, norm_w, 1e-6, router, 4, True, 16))
        programs = -(-32 // moe_fused_norms.DEFAULT_CONFIG.block_en)
        assert counter.item() == 1000 + programs  # every program counted, none was last
        del got
    finally:
        counter.zero_()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, D, k", [(1, 2048, 8), (4, 200, 3), (2, 64, 1)])
def test_exit_equals_combine_then_add_rmsnorm(T, D, k, dtype):
    gen = torch.Generator().manual_seed(T * 1000 + D + k)
    weights = torch.rand(T, k, generator=gen)
    weights = (weights / weights.sum(1, keepdim=True)).to(DEVICE)
    y = torch.randn(T * k, D, generator=gen).to(DEVICE, dtype)
    residual = (2 * torch.randn(T, D, generator=gen)).to(DEVICE, dtype)
    norm_w = (1 + 0.1 * torch.randn(D, generator=gen)).to(DEVICE, dtype)
    got = moe_combine_rmsnorm_triton(y, weights, residual, norm_w, 1e-6)
    want = moe_combine_rmsnorm_ref(y, weights, residual, norm_w, 1e-6)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("op, spec", [("moe_norm_route", MOE_NORM_ROUTE_SPEC),
                                      ("moe_combine_rmsnorm", MOE_COMBINE_RMSNORM_SPEC)])
def test_the_workbench_check_passes_with_poisoned_outputs(op, spec):
    """Each op's shape table through ``check``: outputs poisoned before the run, so an entry the kernel
    leaves unwritten (a padding row of sorted_pairs, a column past a program's block) fails."""
    report = check(op, "triton", dtypes=DTYPES)
    assert len(report.results) == len(spec.cases) * len(DTYPES)
    report.raise_if_failed()


def test_limits():
    h = torch.zeros(5, 64, device=DEVICE)
    router = torch.zeros(128, 64, device=DEVICE)
    assert not fused_ffn_applies(h, router, 8)  # 5 tokens: past MAX_TOKENS
    assert fused_ffn_applies(h[:4], router, 8) is moe_fused_norms.FUSED_MOE_NORM
    assert not fused_ffn_applies(torch.zeros(1, 8200), torch.zeros(128, 8200), 8)  # wider than one chunk
    with pytest.raises(AssertionError, match="needs 1-4 rows"):
        moe_norm_route_triton(h, h, torch.ones(64, device=DEVICE), 1e-6, router, 8, True, 16)
    y, w = torch.zeros(40, 64, device=DEVICE), torch.zeros(5, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="needs 1-4 rows"):
        moe_combine_rmsnorm_triton(y, w, h, torch.ones(64, device=DEVICE), 1e-6)


def test_fused_ffn_is_off_with_the_switch_or_moe_decode(monkeypatch):
    from qml_kernels import moe_decode

    h, router = torch.zeros(1, 64), torch.zeros(16, 64)
    monkeypatch.setattr(moe_fused_norms, "FUSED_MOE_NORM", True)
    assert fused_ffn_applies(h, router, 4)
    monkeypatch.setattr(moe_decode, "MOE_DECODE", True)
    assert not fused_ffn_applies(h, router, 4)
    monkeypatch.setattr(moe_decode, "MOE_DECODE", False)
    monkeypatch.setattr(moe_fused_norms, "FUSED_MOE_NORM", False)
    assert not fused_ffn_applies(h, router, 4)


def test_combine_add_rmsnorm_takes_either_form():
    gen = torch.Generator().manual_seed(4)
    y, weights = torch.randn(6, 32, generator=gen), torch.rand(2, 3, generator=gen)
    residual, norm_w = torch.randn(2, 32, generator=gen), torch.ones(32)
    pending = PendingCombine(y, weights)
    assert pending.shape == (2, 32)
    fused = combine_add_rmsnorm(pending, residual, norm_w, 1e-6)
    from qml_kernels.moe_routing import moe_combine_ref

    plain = combine_add_rmsnorm(moe_combine_ref(y, weights), residual, norm_w, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_ops_dispatch_to_triton_where_they_apply():
    gen = torch.Generator().manual_seed(5)
    h, residual, norm_w, router = _entry_inputs(1, 128, 32, torch.float32, gen)
    with registry.using(moe_norm_route="triton"):
        assert registry.select("moe_norm_route", h, residual, norm_w, 1e-6, router, 4, True, 16).name == "triton"
    if DEVICE.type == "cuda":  # past the fused sizes: the reference (the model keeps the separate ops there)
        big = torch.zeros(8, 128, device=DEVICE)
        assert registry.select("moe_norm_route", big, big, norm_w, 1e-6, router, 4, True, 16).name == "reference"


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_ENTRY_SIG = {
    "h_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "router_ptr": "*bf16", "x_ptr": "*bf16",
    "res_out_ptr": "*bf16", "logits_ptr": "*bf16", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32",
    "sorted_pairs_ptr": "*i32", "offsets_ptr": "*i32", "inverse_ptr": "*i32", "T": "i32", "D": "i32", "E": "i32",
    "R": "i32", "stride_h": "i32", "stride_res": "i32", "stride_router": "i32", "stride_x": "i32",
    "stride_res_out": "i32", "eps": "fp32", "offset": "fp32",
    **dict.fromkeys(("TOP_K", "RENORMALIZE", "ALIGN", "BLOCK_T", "BLOCK_D", "BLOCK_EN", "BLOCK_KC", "BLOCK_E",
                     "BLOCK_K", "PAD_COLS", "BLOCK_TAIL"), "constexpr"),
}
_EXIT_SIG = {
    "y_ptr": "*bf16", "weights_ptr": "*fp32", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "x_ptr": "*bf16",
    "res_out_ptr": "*bf16", "D": "i32", "stride_y": "i32", "stride_res": "i32", "stride_x": "i32",
    "stride_res_out": "i32", "eps": "fp32", "offset": "fp32",
    "TOP_K": "constexpr", "BLOCK_K": "constexpr", "BLOCK_D": "constexpr",
}


def _entry_variant(T: int) -> dict:
    config = moe_fused_norms.MoEFusedNormsConfig()
    return {"kernel": _moe_norm_route_kernel, "signature": _ENTRY_SIG, "num_warps": config.entry_warps,
            "constexprs": dict(TOP_K=8, RENORMALIZE=True, ALIGN=16, BLOCK_D=2048, BLOCK_EN=config.block_en,
                               BLOCK_KC=config.block_kc, **route_blocks(T, 128, 8, 16))}


COMPILE_VARIANTS = {
    "entry-qwen3-30b-a3b-decode": _entry_variant(1),
    "entry-qwen3-30b-a3b-4-tokens": _entry_variant(4),
    "exit-qwen3-30b-a3b-decode": {"kernel": _moe_combine_rmsnorm_kernel, "signature": _EXIT_SIG,
                                  "num_warps": moe_fused_norms.MoEFusedNormsConfig().exit_warps,
                                  "constexprs": dict(TOP_K=8, BLOCK_K=8, BLOCK_D=2048)},
}


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = assert_compiled_for_hopper(compile_reports[name], name)
    assert report.registers is None or report.registers <= 255, f"{name}: {report.registers} registers"
    if name.startswith("entry"):
        # the count that hands the routing to the last program: acq_rel at GPU scope, and a CTA barrier
        # between the program's logits stores and the count, so every thread's stores precede it
        lines = report.ptx.splitlines()
        count = next(i for i, line in enumerate(lines) if "atom.global" in line and ".add." in line)
        assert ".gpu" in lines[count] and ".acq_rel" in lines[count], lines[count]
        last_store = max(i for i, line in enumerate(lines[:count]) if "st.global" in line)
        assert any("bar.sync" in line for line in lines[last_store:count]), "no barrier between stores and count"
