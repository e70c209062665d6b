"""The router and the expert grouping of a decode step in one launch (``moe_route``).

A Qwen3-30B-A3B decode step runs ``moe_router`` then ``moe_align`` in each of its 48 MoE
layers: two launches of a few microseconds each that move almost nothing (one token: 128
logits in, 8 weights, 8 ids and ~150 row indices out). On the H200 their graph profile read
160 us (router) + 212 us (alignment) a step, 3.3 and 4.4 us a launch, of a 3.7 ms step
(``benchmarks/results/serve-h200-qwen3-30b-a3b-2026-12-01.md``). Here one program does both:

1. the router's tile (``moe_routing._route_tile``: softmax in fp32, top-k with ties to the lower
   expert id, renormalisation), for every token at once, with the weights and ids stored as
   ``moe_router`` stores them;
2. the grouping straight from those ids in registers: the pairs ``p = t·k + j`` as a
   ``[T·k, E]`` one-hot tile, whose column sums are the experts' counts and whose running sums
   down the pairs are each pair's rank within its expert; the segments, offsets and padding are
   ``moe_align``'s (``_segments``, ``_write_offsets_and_padding``, ``_write_tail``).

So the ids never make a round trip through memory between two launches. Outputs are exactly
``moe_router`` followed by ``moe_align`` (the reference is that composition): the same pairs in
the same rows, the same padding, the same inverse.

Limits: one program holds the ``[BLOCK_T·BLOCK_K, BLOCK_E]`` one-hot tile, so the op applies to
few tokens (``MAX_TOKENS``: 16 tokens of top-8 over 128 experts is a 16,384-entry tile); larger
batches keep the two ops. ``moe_gemm.moe_forward`` takes it by default on CUDA up to 4 tokens of
top-8 over 128 experts (``FUSED_DEFAULT_MAX_TILE``; only 1 token has been timed)
(``QML_FUSED_MOE_ROUTE=0`` keeps the two ops): on the H200 it took Qwen3-30B-A3B's batch-1 decode step
from 3.706 to 3.538 ms (648 -> 600 launches; one 4.6 us launch a layer in place of 3.3 + 4.4 us), with
the transformers check unchanged (fp32 exact, bf16 within transformers' own spread;
benchmarks/results/engine-h200-qwen3-30b-a3b-fusedroute-2026-12-01.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.moe_routing import (
    _FLOAT_DTYPES,
    _route_tile,
    _segments,
    _write_offsets_and_padding,
    _write_tail,
    moe_align_ref,
    moe_router_ref,
    padded_rows,
)
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

FUSED_MOE_ROUTE = os.environ.get("QML_FUSED_MOE_ROUTE", "1") != "0"
MAX_TOKENS = 16  # tokens one program routes and groups
MAX_TILE = 16384  # entries of the one-hot tile (BLOCK_T x BLOCK_K x BLOCK_E) one program holds


@triton.jit
def _moe_route_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr, T, E, R, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    rows = tl.arange(0, BLOCK_T)
    sel_w, sel_id = _route_tile(logits_ptr, rows, T, E, stride_logits, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E,
                                BLOCK_K)
    _store_route(sel_w, sel_id, rows, T, E, R, weights_ptr, ids_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr,
                 TOP_K, ALIGN, BLOCK_T, BLOCK_E, BLOCK_K, PAD_COLS, BLOCK_TAIL)


@triton.jit
def _store_route(sel_w, sel_id, rows, T, E, R, weights_ptr, ids_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr,
                 TOP_K: tl.constexpr, ALIGN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_K: tl.constexpr, PAD_COLS: tl.constexpr, BLOCK_TAIL: tl.constexpr):
    """The chosen (weights, ids) [BLOCK_T, BLOCK_K] in registers -> ``moe_router``'s two outputs and
    ``moe_align``'s three (also the tail of ``moe_fused_norms``' entry kernel)."""
    slots = tl.arange(0, BLOCK_K)
    pair = rows[:, None] * TOP_K + slots[None, :]  # [BLOCK_T, BLOCK_K]: p = t·k + j
    keep = (rows[:, None] < T) & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + pair, sel_w, mask=keep)
    tl.store(ids_ptr + pair, sel_id, mask=keep)

    # the pairs in (t, j) order, which is p's: a running count down them ranks each within its expert
    flat_pair = tl.reshape(pair, [BLOCK_T * BLOCK_K])
    flat_id = tl.reshape(tl.where(keep, sel_id, -1), [BLOCK_T * BLOCK_K])
    experts = tl.arange(0, BLOCK_E)
    onehot = (flat_id[:, None] == experts[None, :]).to(tl.int32)  # [BLOCK_T·BLOCK_K, BLOCK_E]
    counts = tl.sum(onehot, axis=0)  # [BLOCK_E]
    starts, ends = _segments(counts, ALIGN)
    _write_offsets_and_padding(sorted_pairs_ptr, offsets_ptr, starts, ends, counts, E, ALIGN, BLOCK_E, PAD_COLS)
    _write_tail(sorted_pairs_ptr, tl.sum(ends - starts, axis=0), R, 0, 1, BLOCK_TAIL)
    rank = tl.cumsum(onehot, axis=0)  # 1-based
    row = tl.sum(onehot * (starts[None, :] + rank - 1), axis=1)  # [BLOCK_T·BLOCK_K]
    ok = tl.sum(onehot, axis=1) > 0
    tl.store(sorted_pairs_ptr + row, flat_pair, mask=ok)
    tl.store(inverse_ptr + flat_pair, row, mask=ok)


def _blocks(T: int, E: int, top_k: int, block_size: int) -> dict:
    block_e = triton.next_power_of_2(E)
    return {"BLOCK_T": triton.next_power_of_2(max(T, 1)), "BLOCK_E": block_e,
            "BLOCK_K": triton.next_power_of_2(top_k),
            "PAD_COLS": min(triton.next_power_of_2(block_size), max(1, 8192 // block_e)), "BLOCK_TAIL": 1024}


def _num_warps(blocks: dict) -> int:
    # the one-hot tile spread over the program's threads: 16 tokens of top-8 over 128 experts took
    # 255 registers at 4 warps (sm_90a, no spills); 8 warps halve each thread's share
    return 4 if blocks["BLOCK_T"] * blocks["BLOCK_K"] * blocks["BLOCK_E"] <= 4096 else 8


def moe_route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, block_size: int, *,
                     out: tuple[torch.Tensor, ...] | None = None, num_warps: int | None = None):
    """logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32, sorted_pairs [R], expert_offsets [E+1],
    inverse [T·k]), as ``moe_router`` then ``moe_align``; one launch (``supported`` says when).
    ``out``: five tensors to write into, shaped and typed as the result; ``num_warps`` overrides the launch's."""
    assert _supported(logits, top_k, renormalize, block_size), \
        f"moe_route: logits {tuple(logits.shape)} {logits.dtype}, top_k {top_k}: use moe_router + moe_align"
    T, E = logits.shape
    shapes = ((T, top_k), (T, top_k), (padded_rows(T * top_k, E, block_size),), (E + 1,), (T * top_k,))
    dtypes = (torch.float32,) + (torch.int32,) * 4
    if out is None:
        out = tuple(torch.empty(shape, dtype=dtype, device=logits.device) for shape, dtype in zip(shapes, dtypes))
    for i, (t, shape, dtype) in enumerate(zip(out, shapes, dtypes)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous(), \
            f"out[{i}] must be contiguous {dtype} {list(shape)}, got {t.dtype} {tuple(t.shape)}"
    weights, ids, sorted_pairs, offsets, inverse = out
    R = shapes[2][0]
    blocks = _blocks(T, E, top_k, block_size)
    _moe_route_kernel[(1,)](
        logits, weights, ids, sorted_pairs, offsets, inverse, T, E, R, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), ALIGN=block_size, **blocks,
        num_warps=num_warps or _num_warps(blocks),
        **pdl.launch_args(logits),
    )
    return weights, ids, sorted_pairs, offsets, inverse


def moe_route_ref(logits: torch.Tensor, top_k: int, renormalize: bool, block_size: int):
    """``moe_router_ref`` then ``moe_align_ref``: what the fused kernel must equal."""
    weights, ids = moe_router_ref(logits, top_k, renormalize)
    return (weights, ids, *moe_align_ref(ids, logits.shape[1], block_size))


def _supported(logits, top_k, renormalize, block_size, *args, **kwargs) -> bool:
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES or logits.stride(-1) != 1:
        return False
    T, E = logits.shape
    b = _blocks(T, E, top_k, block_size)
    return (1 <= T <= MAX_TOKENS and 1 <= top_k <= E and block_size >= 1
            and b["BLOCK_T"] * b["BLOCK_K"] * b["BLOCK_E"] <= MAX_TILE)


# moe_forward's default takes the fused op up to this one-hot tile (4 tokens of top-8 over 128 experts, the
# 4-warp form): it was timed on the H200 at 1 token only, and one program's work grows with the tile, while
# the two ops spread theirs; the op itself serves up to MAX_TILE
FUSED_DEFAULT_MAX_TILE = 4096


def fused_route_applies(logits: torch.Tensor, top_k: int, renormalize: bool, block_size: int) -> bool:
    """``moe_forward`` takes the fused path: switched on, on a GPU, and within the tile above."""
    return (FUSED_MOE_ROUTE and logits.is_cuda and _supported(logits, top_k, renormalize, block_size)
            and within_default_tile(logits.shape[0], logits.shape[1], top_k, block_size))


def within_default_tile(T: int, E: int, top_k: int, block_size: int) -> bool:
    b = _blocks(T, E, top_k, block_size)
    return b["BLOCK_T"] * b["BLOCK_K"] * b["BLOCK_E"] <= FUSED_DEFAULT_MAX_TILE


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    logits = 2.0 * torch.randn(d["T"], d["E"], generator=gen, device=gen.device)
    if d.get("ties"):
        logits = logits.round()  # integers from about -6 to 6: many equal logits per row
    if d.get("hot"):
        logits[:, 0] += 50.0  # every token's first choice is expert 0
    return {"logits": logits.to(device=device, dtype=dtype), "top_k": d["k"],
            "renormalize": d.get("renormalize", True), "block_size": d["block"]}


CASES = (
    Case("one-token", {"T": 1, "E": 128, "k": 8, "block": 16}, edge="decode: Qwen3-30B-A3B's 128 experts, top-8"),
    Case("sixteen-tokens", {"T": 16, "E": 128, "k": 8, "block": 16}, edge="the most one program takes (128 pairs)"),
    Case("prime-experts", {"T": 5, "E": 61, "k": 3, "block": 16, "renormalize": False},
         edge="E=61 (prime): masked expert columns; weights not renormalised"),
    Case("ties", {"T": 4, "E": 64, "k": 8, "block": 16, "ties": True}, edge="integer logits: ties to the lower id"),
    Case("hot-expert", {"T": 7, "E": 16, "k": 2, "block": 4, "hot": True},
         edge="every token picks expert 0 first: one long segment"),
    Case("block-1", {"T": 2, "E": 8, "k": 8, "block": 1}, edge="k = E and 1-row blocks: no padding at all"),
)

MOE_ROUTE_SPEC = register_spec(OpSpec(
    op="moe_route",
    reference=moe_route_ref,
    make_inputs=_make_inputs,
    cases=CASES,
    bytes_moved=lambda inputs: (inputs["logits"].numel() * inputs["logits"].element_size()
                                + 4 * (3 * inputs["logits"].shape[0] * inputs["top_k"] + inputs["logits"].shape[1]
                                       + 1 + padded_rows(inputs["logits"].shape[0] * inputs["top_k"],
                                                         inputs["logits"].shape[1], inputs["block_size"]))),
    out_arg="out",
    notes="returns (weights fp32, ids, sorted_pairs, expert_offsets, inverse int32): moe_router's, then "
          "moe_align's; `out` is a five-tuple mirroring it",
))

register("moe_route", "reference", moe_route_ref)
register("moe_route", "triton", moe_route_triton, devices=("cuda",), supports=_supported)
moe_route = dispatch("moe_route")
