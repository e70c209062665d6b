"""MoE routing: the router (softmax, top-k, renormalise), the grouping of (token, slot) pairs by
expert, and the weighted combine. Invariants of the grouping are checked on both
implementations before they are compared; Triton runs in the interpreter on CPU; the kernels
are also compiled for Hopper."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import triton

from qml_kernels import registry
from qml_kernels.moe_routing import (
    ALIGN_CASES,
    MOE_ALIGN_SPEC,
    MOE_COMBINE_SPEC,
    MOE_ROUTER_SPEC,
    MoERoutingConfig,
    _align_blocks,
    _combine_blocks,
    _moe_align_count_kernel,
    _moe_align_kernel,
    _moe_align_scan_kernel,
    _moe_align_scatter_kernel,
    _moe_combine_kernel,
    _moe_router_kernel,
    draw_expert_ids,
    moe_align,
    moe_align_ref,
    moe_align_triton,
    moe_combine,
    moe_combine_ref,
    moe_combine_triton,
    moe_router,
    moe_router_ref,
    moe_router_triton,
    padded_rows,
)
from qml_kernels.workbench.compile import compile_checks
from qml_kernels.workbench.spec import Case

# max |out - ref| / max |ref|, ref in fp32. Router weights are fp32 whatever the logits' dtype
# (the same logits in, a softmax of E terms out); the combine rounds once to the output dtype.
WEIGHT_TOL = 1e-6
TOLERANCES = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the interpreter computes bf16 wrongly without an error: bf16 is checked on the GPU only
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
IMPLS = {"triton": (moe_router_triton, moe_align_triton), "reference": (moe_router_ref, moe_align_ref)}


def _seeded() -> tuple[int, torch.Generator]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


# -- router ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_ROUTER_SPEC.cases, ids=lambda c: c.name)
def test_router_matches_reference(case, dtype):
    seed, gen = _seeded()
    inputs = MOE_ROUTER_SPEC.make_inputs(case, dtype, DEVICE, gen)
    T, k = inputs["logits"].shape[0], inputs["top_k"]
    out = (torch.full((T, k), float("nan"), device=DEVICE), torch.full((T, k), -1, dtype=torch.int32, device=DEVICE))
    weights, ids = moe_router_triton(**inputs, out=out)
    assert weights is out[0] and ids is out[1]
    ref_weights, ref_ids = moe_router_ref(**inputs)
    where = f"{case.name} ({case.edge}) {dtype} seed={seed}"
    # the choice first: ids equal exactly (ties included), each token's experts distinct
    assert torch.equal(ids, ref_ids), f"{where}: ids {ids.tolist()} != {ref_ids.tolist()}"
    assert all(len(set(row)) == k for row in ids.tolist()), f"{where}: an expert chosen twice"
    assert torch.isfinite(weights).all() and (weights >= 0).all(), f"{where}: weights {weights}"
    if inputs["renormalize"]:
        torch.testing.assert_close(weights.sum(-1), torch.ones(T, device=DEVICE), rtol=0, atol=1e-6)
    assert ((weights[:, :-1] >= weights[:, 1:]).all()), f"{where}: weights not in descending order"
    err = ((weights - ref_weights).abs().max() / ref_weights.abs().max()).item()
    assert err <= WEIGHT_TOL, f"{where}: weights rel err {err:.2e}"


@pytest.mark.parametrize("impl", IMPLS)
def test_router_ties_go_to_the_lower_expert(impl):
    router = IMPLS[impl][0]
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)  # [T=2, E=5]
    weights, ids = router(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3, device=DEVICE))
    weights, ids = router(logits, 2, False)
    assert ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(weights[1], torch.full((2,), 0.2, device=DEVICE))  # a fifth of the mass each


def test_router_reference_is_softmax_then_topk():
    """Without ties the reference is transformers' Qwen3-MoE router: fp32 softmax, torch.topk,
    divide by the sum of the chosen probabilities."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 128, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    top, idx = torch.topk(probs, 8, dim=-1)
    weights, ids = moe_router_ref(logits, 8, True)
    assert torch.equal(ids.long(), idx)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    weights, _ = moe_router_ref(logits, 8, False)
    torch.testing.assert_close(weights, top)


# -- alignment -------------------------------------------------------------------------------

def assert_grouping_invariants(ids: torch.Tensor, num_experts: int, block: int, sorted_pairs: torch.Tensor,
                               offsets: torch.Tensor, inverse: torch.Tensor, where: str) -> None:
    """What every consumer of the grouping relies on, independent of any reference."""
    flat = ids.flatten().long().cpu()
    P = flat.numel()
    sorted_pairs, offsets, inverse = sorted_pairs.cpu().long(), offsets.cpu().long(), inverse.cpu().long()
    assert sorted_pairs.shape == (padded_rows(P, num_experts, block),), f"{where}: sorted_pairs shape"
    assert sorted_pairs.shape[0] % block == 0, f"{where}: sorted_pairs not a whole number of blocks"
    assert offsets.shape == (num_experts + 1,) and offsets[0] == 0, f"{where}: offsets {offsets.tolist()}"
    counts = torch.bincount(flat, minlength=num_experts)
    lengths = offsets[1:] - offsets[:-1]
    # each segment holds its expert's pairs, padded up to whole blocks (empty experts: 0 rows)
    assert torch.equal(lengths, (counts + block - 1) // block * block), f"{where}: segment lengths {lengths.tolist()}"
    assert offsets[-1] == P + int((lengths - counts).sum()), f"{where}: offsets[E] != pairs + padding"
    assert offsets[-1] <= sorted_pairs.shape[0], f"{where}: segments run past the buffer"
    for e in range(num_experts):
        segment = sorted_pairs[offsets[e]:offsets[e + 1]]
        n = int(counts[e])
        assert torch.equal(segment[:n], (flat == e).nonzero().flatten()), f"{where}: expert {e}'s pairs"
        assert (segment[n:] == -1).all(), f"{where}: expert {e}'s padding"
    assert (sorted_pairs[offsets[-1]:] == -1).all(), f"{where}: rows past the last segment"
    # the permutation inverts: inverse[p] is where pair p sits
    assert torch.equal(sorted_pairs[inverse], torch.arange(P)), f"{where}: sorted_pairs[inverse] != identity"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: c.name)
def test_align_invariants(case, impl):
    seed, gen = _seeded()
    inputs = MOE_ALIGN_SPEC.make_inputs(case, torch.float32, DEVICE, gen)
    result = IMPLS[impl][1](**inputs)
    assert_grouping_invariants(inputs["ids"], inputs["num_experts"], inputs["block_size"], *result,
                               where=f"{impl} {case.name} ({case.edge}) seed={seed}")


# the one-program path and the three-launch path (histogram, scan, scatter), each forced, with
# chunks of 16 pairs so that the small cases make many programs
ALIGN_CONFIGS = {
    "default": MoERoutingConfig(),
    "chunk16": MoERoutingConfig(align_chunk=16),
    "one-program": MoERoutingConfig(align_chunk=16, align_one_program_chunks=1 << 30),
    "programs-per-chunk": MoERoutingConfig(align_chunk=16, align_one_program_chunks=0),
}

# edges beyond the spec's cases (whose table the notebook prints)
EXTRA_ALIGN_CASES = (
    Case("hot-many-chunks", {"T": 300, "E": 8, "k": 1, "block": 16, "spread": "hot"},
         edge="all 300 pairs to expert 0: one segment over every chunk, 7 empty experts, a long tail of -1"),
    Case("sparse-prime", {"T": 97, "E": 61, "k": 4, "block": 16, "spread": "sparse"},
         edge="E=61, the 30 odd experts empty"),
    Case("prime-127", {"T": 200, "E": 127, "k": 8, "block": 64}, edge="E=127, 1600 pairs, 64-row blocks"),
    Case("block-128", {"T": 60, "E": 128, "k": 8, "block": 128},
         edge="block 128 > the padding tile's 64 columns: padding written in two column steps"),
    Case("odd-block", {"T": 45, "E": 12, "k": 3, "block": 24}, edge="block 24 (not a power of 2)"),
    Case("block-1", {"T": 50, "E": 9, "k": 2, "block": 1}, edge="block 1: no padding at all"),
)


def _align_inputs(case: Case, gen: torch.Generator) -> dict:
    return MOE_ALIGN_SPEC.make_inputs(case, torch.float32, DEVICE, gen)


@pytest.mark.parametrize("config", ALIGN_CONFIGS.values(), ids=ALIGN_CONFIGS.keys())
@pytest.mark.parametrize("case", ALIGN_CASES + EXTRA_ALIGN_CASES, ids=lambda c: c.name)
def test_align_matches_reference_exactly(case, config):
    seed, gen = _seeded()
    inputs = _align_inputs(case, gen)
    ref = moe_align_ref(**inputs)
    poisoned = tuple(torch.full_like(t, -7) for t in ref)  # the kernels must write every row, padding too
    got = moe_align_triton(**inputs, out=poisoned, config=config)
    assert all(g is p for g, p in zip(got, poisoned))
    assert_grouping_invariants(inputs["ids"], inputs["num_experts"], inputs["block_size"], *got,
                               where=f"{case.name} ({case.edge}) seed={seed}")
    for name, g, r in zip(("sorted_pairs", "expert_offsets", "inverse"), got, ref):
        assert torch.equal(g, r), f"{case.name} ({case.edge}) seed={seed}: {name} differs"


def test_align_path_choice():
    """Which path each shape takes with the default config: one program at decode (one launch),
    a program per chunk from a few chunks on. Qwen3-30B-A3B: E=128, chunks of 64 pairs."""
    config = MoERoutingConfig()
    chunk = _align_blocks(128, 16, config)["BLOCK_P"]
    assert chunk == 64
    for T, one_program in ((1, True), (16, True), (17, False), (128, False), (8192, False)):
        assert (triton.cdiv(8 * T, chunk) <= config.align_one_program_chunks) == one_program, T


def test_align_scan_over_more_than_one_tile_of_chunks():
    """Over 1,024 chunks: the per-expert scan carries its count from one tile of chunks to the next."""
    seed, gen = _seeded()
    case = Case("many-chunks", {"T": 2100, "E": 8, "k": 8, "block": 16})
    inputs = _align_inputs(case, gen)
    config = MoERoutingConfig(align_chunk=16, align_one_program_chunks=0)
    assert triton.cdiv(inputs["ids"].numel(), 16) + 1 > 1024
    got = moe_align_triton(**inputs, config=config)
    for name, g, r in zip(("sorted_pairs", "expert_offsets", "inverse"), got, moe_align_ref(**inputs)):
        assert torch.equal(g, r), f"seed={seed}: {name} differs"


@pytest.mark.parametrize("config", ALIGN_CONFIGS.values(), ids=ALIGN_CONFIGS.keys())
def test_align_no_pairs(config):
    """T=0: no rows, offsets all zero."""
    ids = torch.empty(0, 8, dtype=torch.int32, device=DEVICE)
    sorted_pairs, offsets, inverse = moe_align_triton(ids, 16, 16, config=config)
    assert sorted_pairs.numel() == 0 and inverse.numel() == 0 and offsets.tolist() == [0] * 17


def test_align_single_pair_and_block_one():
    """One token routed to one expert, and a block of one row (no padding at all)."""
    ids = torch.tensor([[5]], dtype=torch.int32, device=DEVICE)
    sorted_pairs, offsets, inverse = moe_align_triton(ids, 7, 16)
    assert sorted_pairs.tolist() == [0] + [-1] * 15
    assert offsets.tolist() == [0] * 6 + [16, 16] and inverse.tolist() == [0]
    ids = torch.tensor([[2, 0], [2, 1]], dtype=torch.int32, device=DEVICE)
    sorted_pairs, offsets, inverse = moe_align_triton(ids, 3, 1)
    assert sorted_pairs.tolist() == [1, 3, 0, 2] and offsets.tolist() == [0, 1, 2, 4]
    assert inverse.tolist() == [2, 0, 3, 1]


def test_padded_rows_bounds_every_routing():
    """The host-side bound is reached by the worst routing (every used expert one row past a block)."""
    ids = torch.arange(8, dtype=torch.int32).repeat(17).view(17, 8)  # 17 pairs for each of 8 experts
    _, offsets, _ = moe_align_ref(ids, 128, 16)
    assert offsets[-1] == 8 * 32 and padded_rows(ids.numel(), 128, 16) >= 8 * 32
    assert padded_rows(8, 128, 64) == 8 * 64  # decode: 8 pairs can use at most 8 experts
    assert padded_rows(0, 128, 64) == 0


# -- combine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", MOE_COMBINE_SPEC.cases, ids=lambda c: c.name)
def test_combine_matches_reference(case, dtype):
    seed, gen = _seeded()
    inputs = MOE_COMBINE_SPEC.make_inputs(case, dtype, DEVICE, gen)
    T = inputs["weights"].shape[0]
    out = torch.full((T, inputs["y"].shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    assert moe_combine_triton(**inputs, out=out) is out
    ref = moe_combine_ref(inputs["y"].float(), inputs["weights"])
    assert torch.isfinite(out).all(), f"seed={seed}: unwritten outputs"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOLERANCES[dtype], f"{case.name} ({case.edge}) {dtype} seed={seed}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T, k, D", [(1, 8, 2048), (3, 8, 700), (40, 6, 96), (2, 5, 1030)],
                         ids=["decode-qwen3", "odd-width-3-tokens", "k6", "k5-odd-blocks"])
def test_combine_shapes(T, k, D, dtype):
    """k not a power of 2 (masked slots), narrow column blocks at few tokens, out a strided view."""
    seed, gen = _seeded()
    y = torch.randn(T * k, D, generator=gen).to(DEVICE, dtype)
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1).to(DEVICE)
    buffer = torch.full((T, D + 16), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[:, 8:8 + D]  # rows of stride D + 16
    assert moe_combine_triton(y, weights, out=out) is out
    assert torch.isnan(buffer[:, :8]).all() and torch.isnan(buffer[:, 8 + D:]).all(), "wrote outside out"
    ref = moe_combine_ref(y.float(), weights)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert torch.isfinite(out).all() and err <= TOLERANCES[dtype], f"{T}x{k}x{D} {dtype} seed={seed}: {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_combine_reads_grouped_rows_through_the_inverse(dtype):
    """y in grouped-row order (padded segments, as moe_gemm's sorted_out writes it, NaN in every row no pair
    owns): with the alignment's inverse as ``rows``, the same sums as from y in pair order."""
    seed, gen = _seeded()
    T, E, k, D, block = 13, 6, 3, 96, 16
    ids = draw_expert_ids(T, E, k, gen)
    sorted_pairs, _, inverse = moe_align_ref(ids, E, block)
    y_pairs = torch.randn(T * k, D, generator=gen)
    y_grouped = torch.full((sorted_pairs.shape[0], D), float("nan"))
    y_grouped[inverse.long()] = y_pairs
    weights = torch.softmax(torch.randn(T, k, generator=gen), dim=-1).to(DEVICE)
    ref = moe_combine_ref(y_pairs.to(DEVICE), weights)
    out = moe_combine_triton(y_grouped.to(DEVICE, dtype), weights, inverse.to(DEVICE))
    assert torch.isfinite(out).all(), f"seed={seed}: a padding row was read"
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOLERANCES[dtype], f"{dtype} seed={seed}: rel err {err:.2e}"
    torch.testing.assert_close(moe_combine_ref(y_grouped, weights.cpu(), inverse), ref.cpu())


def test_combine_blocks():
    """Qwen3-30B-A3B (D=2048): 8 programs of 256 columns at one token, 1,024 columns from 64 tokens."""
    config = MoERoutingConfig()
    assert _combine_blocks(1, 2048, config) == (256, 1)
    assert _combine_blocks(16, 2048, config) == (256, 1)
    assert _combine_blocks(32, 2048, config) == (512, 2)
    assert _combine_blocks(128, 2048, config) == (1024, 4)
    assert _combine_blocks(8192, 2048, config) == (1024, 4)
    assert _combine_blocks(1, 96, config) == (128, 1)


def test_combine_reference_is_the_weighted_sum():
    gen = torch.Generator().manual_seed(1)
    y, w = torch.randn(12, 5, generator=gen), torch.rand(4, 3, generator=gen)
    expected = torch.einsum("tk,tkd->td", w, y.view(4, 3, 5))
    torch.testing.assert_close(moe_combine_ref(y, w), expected)


# -- launchers and dispatch -----------------------------------------------------------------------

def test_launchers_reject_bad_arguments():
    logits = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="top_k must be"):
        moe_router_triton(logits, 9, True)
    with pytest.raises(AssertionError, match="contiguous"):
        moe_router_triton(logits.t(), 2, True)
    with pytest.raises(AssertionError, match="ids must be contiguous int32"):
        moe_align_triton(torch.zeros(3, 2, dtype=torch.int64, device=DEVICE), 4, 16)
    with pytest.raises(AssertionError, match="y must be"):
        moe_combine_triton(torch.randn(5, 4, device=DEVICE), torch.rand(3, 2, device=DEVICE))
    with pytest.raises(AssertionError, match="weights must be contiguous fp32"):
        moe_combine_triton(torch.randn(6, 4, device=DEVICE), torch.rand(3, 2, device=DEVICE).half())


def test_public_functions_dispatch_to_triton():
    seed, gen = _seeded()
    logits = torch.randn(6, 12, generator=gen).to(DEVICE, torch.float16)
    with registry.using("triton"):
        assert registry.select("moe_router", logits, 3, True).name == "triton"
        weights, ids = moe_router(logits, 3, True)
        grouping = moe_align(ids, 12, 16)
        y = torch.randn(18, 40, generator=gen).to(DEVICE)
        out = moe_combine(y, weights)
        assert registry.select("moe_align", ids, 12, 16).name == "triton"
        assert registry.select("moe_combine", y, weights).name == "triton"
    ref_weights, ref_ids = moe_router_ref(logits, 3, True)
    assert torch.equal(ids, ref_ids), f"seed={seed}"
    assert all(torch.equal(a, b) for a, b in zip(grouping, moe_align_ref(ref_ids, 12, 16))), f"seed={seed}"
    torch.testing.assert_close(out, moe_combine_ref(y, ref_weights))


def test_draw_expert_ids_spreads():
    gen = torch.Generator().manual_seed(3)
    for spread in ("uniform", "hot", "sparse"):
        ids = draw_expert_ids(20, 10, 3, gen, spread)
        assert ids.shape == (20, 3) and ids.dtype == torch.int32
        assert all(len(set(r)) == 3 for r in ids.tolist())
    assert (draw_expert_ids(20, 10, 3, gen, "hot")[:, 0] == 0).all()
    assert (draw_expert_ids(20, 10, 3, gen, "sparse") % 2 == 0).all()


# -- compilation for the H200 (sm_90a) -------------------------------------------------------

_ROUTER_SIG = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i32", "T": "i32", "E": "i32",
               "stride_logits": "i32", "TOP_K": "constexpr", "RENORMALIZE": "constexpr", "BLOCK_T": "constexpr",
               "BLOCK_E": "constexpr", "BLOCK_K": "constexpr"}
_ALIGN_BLOCKS = {"ALIGN": "constexpr", "BLOCK_P": "constexpr", "BLOCK_E": "constexpr", "PAD_COLS": "constexpr",
                 "BLOCK_TAIL": "constexpr"}
_ALIGN_SIG = {"ids_ptr": "*i32", "sorted_pairs_ptr": "*i32", "offsets_ptr": "*i32", "inverse_ptr": "*i32",
              "P": "i32", "E": "i32", "R": "i32", **_ALIGN_BLOCKS}
_ALIGN_COUNT_SIG = {"ids_ptr": "*i32", "counts_ptr": "*i32", "P": "i32", "E": "i32", "BLOCK_P": "constexpr",
                    "BLOCK_E": "constexpr"}
_ALIGN_SCAN_SIG = {"counts_ptr": "*i32", "num_chunks": "i32", "E": "i32", "BLOCK_C": "constexpr"}
_ALIGN_SCATTER_SIG = {"ids_ptr": "*i32", "counts_ptr": "*i32", "sorted_pairs_ptr": "*i32", "offsets_ptr": "*i32",
                      "inverse_ptr": "*i32", "P": "i32", "E": "i32", "R": "i32", "num_chunks": "i32", **_ALIGN_BLOCKS}
_COMBINE_SIG = {"y_ptr": "*bf16", "weights_ptr": "*fp32", "rows_ptr": "*i32", "out_ptr": "*bf16", "D": "i32",
                "stride_y": "i32", "stride_out": "i32", "TOP_K": "constexpr", "BLOCK_K": "constexpr",
                "BLOCK_D": "constexpr", "HAS_ROWS": "constexpr"}
_CONFIG = MoERoutingConfig()
# the launchers' tiles for Qwen3-30B-A3B (128 experts, top-8, hidden 2048): decode (16-row blocks)
# and prefill (64-row blocks; 65,536 pairs at 8,192 tokens: 1,024 chunks)
_ALIGN_DECODE = dict(ALIGN=16, **_align_blocks(128, 16, _CONFIG))
_ALIGN_PREFILL = dict(ALIGN=64, **_align_blocks(128, 64, _CONFIG))


def _combine_variant(T: int, has_rows: bool = False) -> dict:
    block_d, num_warps = _combine_blocks(T, 2048, _CONFIG)
    return {"kernel": _moe_combine_kernel, "signature": _COMBINE_SIG, "num_warps": num_warps,
            "constexprs": {"TOP_K": 8, "BLOCK_K": 8, "BLOCK_D": block_d, "HAS_ROWS": has_rows},
            "divisible": ("D", "stride_y", "stride_out")}


COMPILE_VARIANTS = {
    "router-qwen3-30b-a3b": {"kernel": _moe_router_kernel, "signature": _ROUTER_SIG, "constexprs": {
        "TOP_K": 8, "RENORMALIZE": True, "BLOCK_T": _CONFIG.router_rows, "BLOCK_E": 128, "BLOCK_K": 8}},
    "align-one-program-qwen3-30b-a3b": {"kernel": _moe_align_kernel, "signature": _ALIGN_SIG,
                                        "constexprs": _ALIGN_DECODE},
    "align-count-qwen3-30b-a3b": {"kernel": _moe_align_count_kernel, "signature": _ALIGN_COUNT_SIG, "constexprs": {
        "BLOCK_P": _ALIGN_PREFILL["BLOCK_P"], "BLOCK_E": 128}},
    "align-scan-qwen3-30b-a3b": {"kernel": _moe_align_scan_kernel, "signature": _ALIGN_SCAN_SIG,
                                 "constexprs": {"BLOCK_C": 1024}},
    "align-scatter-qwen3-30b-a3b": {"kernel": _moe_align_scatter_kernel, "signature": _ALIGN_SCATTER_SIG,
                                    "constexprs": _ALIGN_PREFILL},
    "combine-qwen3-30b-a3b-decode": _combine_variant(1),
    "combine-qwen3-30b-a3b-prefill": _combine_variant(8192),
    "combine-qwen3-30b-a3b-prefill-grouped-rows": _combine_variant(26900, has_rows=True),
}


@pytest.fixture(scope="module")
def compile_reports() -> dict:
    requests = [dict({"num_warps": _CONFIG.num_warps}, **v) for v in COMPILE_VARIANTS.values()]
    return dict(zip(COMPILE_VARIANTS, (dataclasses.asdict(r) for r in compile_checks(requests))))


@pytest.mark.parametrize("name", COMPILE_VARIANTS)
def test_compiles_for_hopper(compile_reports, name):
    report = compile_reports[name]
    assert report["ok"], report["error"]
    assert ".target sm_90a" in report["ptx"]
    assert report["spills"] in (0, None), f"{name}: {report['spills']} spill bytes"
    assert report["registers"] is None or report["registers"] <= 255, f"{name}: {report['registers']} registers"


def test_combine_issues_every_row_load_before_using_one(compile_reports):
    """The point of the 2-D load: in the PTX, the k rows' vector loads all come before the first
    conversion of a loaded value (a loop of loads let later requests wait on earlier data)."""
    for name in ("combine-qwen3-30b-a3b-decode", "combine-qwen3-30b-a3b-prefill"):
        ptx = compile_reports[name]["ptx"]
        loads = [i for i, line in enumerate(ptx.splitlines()) if "ld.global.v4" in line]
        first_use = next(i for i, line in enumerate(ptx.splitlines()) if "cvt.f32.bf16" in line)
        assert len(loads) >= 8 and max(loads) < first_use, f"{name}: loads at lines {loads}, first use {first_use}"
