"""Grouped GEMM over experts, and the whole mixture-of-experts FFN built from it.

``moe_gemm`` multiplies each (token, slot) pair's activation row by its expert's weight:
``out[p] = a[p // pairs_per_row] @ w[e(p)].T``, weights stored ``[E, N, K]`` (each expert's
matrix as a linear layer stores it). The pairs come grouped by expert from ``moe_align``
(``qml_kernels.moe_routing``): ``sorted_pairs`` lists each expert's pairs in a segment padded
with -1 to a multiple of ``block_size`` rows, and ``expert_offsets`` ``[E+1]`` says where each
segment starts. Output rows are in pair order ``[T·k, N]``, so every row is written exactly once
whatever the padding, and the combine reads them back by ``t·k + j``.

- First GEMM of an expert FFN: ``a = x [T, D]`` with ``pairs_per_row = k`` (pair ``p`` reads token
  ``p // k``: the gather is in the load, no permuted copy of x), ``w = w_gate_up [E, 2I, D]``
  (gate rows, then up rows), ``swiglu=True``: the program accumulates the gate and the up
  columns of its tile side by side and writes ``silu(gate) · up`` ``[T·k, I]``, so the ``[T·k, 2I]``
  intermediate never reaches memory.
- Second GEMM: ``a = h [T·k, I]`` with ``pairs_per_row = 1``, ``w = w_down [E, D, I]``.

Triton: one program per (row tile of ``BLOCK_M`` padded rows, column tile), every column tile of a row tile
started before the next row tile (the tile's gathered activation rows then come from HBM once: the down
projection 5-16% faster from 2,340 tokens up than row tiles first, results/moe-gemm-sweep-order-h200-2026-12-03.json).
A tile never spans
two experts (segments are multiples of ``BLOCK_M``); the program finds its expert by counting the
segment ends at or before its first row. Programs whose tile lies past the last segment return
before any load, and an expert without pairs owns no tile at all: a decode step reads only the
weights of the experts its tokens chose. Work: ``2·(T·k)·N·K`` useful FLOPs (plus padding rows);
traffic: the used experts' weights, ``T·k·K`` activations read, ``T·k·N_out`` written. At decode
this is a stream of ``A`` experts' weights (bandwidth-bound), at long prefills compute-bound.

``moe_forward``: router probabilities -> top-k -> grouped GEMMs -> weighted combine, each step
dispatched on its own; ``moe_forward_ref`` is the same function as a loop over experts.

Grouped rows between the GEMMs (``moe_experts_grouped``, ``QML_MOE_GROUPED_ROWS=1``, long prefills only;
off by default, measured below): the gate-up GEMM can write its rows where they sit in the grouping
(``sorted_out``: [R, I], padding rows zero) instead of in pair order, so the down GEMM reads each tile's rows
as one contiguous block (``sorted_in``: a TMA load instead of a gather by pair) and writes grouped rows too,
which the combine reads through the alignment's inverse. Grouped rows are also what ``torch._grouped_mm``
needs: at 26,900 tokens it ran the down projection in 1,118 us a layer against our 1,464-1,490 on the H200,
but only when handed rows already grouped (results/moe-gemm-sweep-order-h200-2026-12-03.json);
``QML_MOE_GROUPED_DOWN=grouped_mm`` takes it for the down GEMM. ``benchmarks/moe_gemm_sweep.py --grid
grouped`` times the variants. Timed on the H200 (2026-12-04, results/serve-h200-qwen3-30b-a3b-2026-12-04.md):
our pair-order down GEMM ran at 1,328 us a layer at 26,900 tokens that day, grouped through TMA 1,287, torch's
1,236; the whole layer 3,943 / 3,916 / 4,206 us, and a 26,900-token prompt's TTFT 800.1 / 796.9 / 794.3 ms
in-process (8,890: 162.4 / 161.6 / 162.9): 3-6 ms, within the spread of runs, so the switch stays off.

Launch configs: ``moe_gemm_config(block_size, swiglu)`` gives 16-row segments (decode, short prefills)
narrow, deep tiles with five pipeline stages, so the weight stream keeps enough bytes in flight
(at one token the default tiles ran at 1.1-1.2 TB/s on the H200: gate-up 46.7 us, down 20.9 us,
against 18 us for the 75 MB at 4.22 TB/s); 64-row segments 64x64 tiles 64 deep, 128-row segments
(experts averaging 128+ pairs: long prefills) 128x128 tiles on 8 warps (128x256 for the down
projection). Chosen by a sweep of 64 configs on the H200 (``benchmarks/moe_gemm_sweep.py``,
results/moe-gemm-sweep-2026-11-30.json). The prefill tiles load the weights through TMA tensor
descriptors (``w`` seen as one ``[E·N, K]`` matrix; the copy zero-fills past K and past the last
expert), 8-22% faster from 2,340 tokens up than pointer loads (results/moe-gemm-sweep-tma-2026-12-01.json);
the activation rows are gathered by pair and stay pointer loads.

Sources: the layout of vLLM's fused MoE kernel (pairs sorted by expert and padded to the tile
height, the token gather folded into the A loads, outputs in pair order); the Triton matmul
tutorial's tiled ``tl.dot`` loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from qml_kernels import pdl
from qml_kernels.moe_decode import decode_applies, moe_decode
from qml_kernels.moe_route import fused_route_applies, moe_route
from qml_kernels.moe_routing import draw_expert_ids, moe_align, moe_align_ref, moe_combine, moe_router, moe_router_ref
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# long prefills keep the rows grouped by expert between the two GEMMs (moe_experts_grouped): written and
# timed on the H200: 3-6 ms off a 26,900-token prompt's ~800, within run-to-run spread (module docstring), so off
MOE_GROUPED_ROWS = os.environ.get("QML_MOE_GROUPED_ROWS", "0") == "1"
GROUPED_DOWN = os.environ.get("QML_MOE_GROUPED_DOWN", "triton")  # or "grouped_mm" (torch._grouped_mm)


@dataclass(frozen=True)
class MoEGemmConfig:
    """Launch tunables. ``block_m`` is capped by the alignment's ``block_size`` (which it must divide)."""

    block_m: int = 64  # padded pair rows per tile (tl.dot needs >= 16)
    block_n: int = 64  # output columns per tile (gate and up each, with swiglu)
    block_k: int = 32  # reduction step
    num_warps: int = 4
    num_stages: int = 3
    # weight tiles through a TMA tensor descriptor (``w`` seen as [E·N, K]) instead of pointer loads; the
    # activation rows are gathered by pair, so they stay pointer loads
    tma_weights: bool = False
    # launch order: every column tile of a row tile before the next row tile (each gathered activation
    # tile is read from HBM once, then from L2), or (False) every row tile of a column tile before the
    # next column tile, which streams all of the activations again for each column tile
    columns_first: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoEGemmConfig.{name} must be a power of 2 >= 16, got {value}")
        if self.tma_weights and max(self.block_n, self.block_k) > 256:
            raise ValueError("MoEGemmConfig: a TMA box is at most 256 elements a side")


# Tiles of 16 rows hold a few pairs each (at one token, one real row of 16): the GEMM is a stream of
# the chosen experts' weights, and its speed is the bytes kept in flight (Little's law: 4.2 TB/s
# times a ~1.5 us loaded latency is ~6 MB across the GPU). The default tiles at 16 rows keep ~16 KB
# of weights in flight per gate-up program (96 programs at one token) and ~8 KB per down program,
# 1.5-2 MB in all: 1.1-1.2 TB/s measured at one token on the H200 (gate-up 46.7 us, down 20.9 us,
# where 75 MB at 4.22 TB/s is 18 us). These keep four 128-deep K steps in flight: 64 KB of gate+up
# weights per program (80 KB of shared memory, two programs per SM, 192 programs at one token) and
# 32 KB per down program (48 KB shared, four per SM, 512 programs): 12-16 MB in flight.
# (That was SMALL_TILE_CONFIG until 2026-12-01: 16x32x128, 5 stages, pointer loads for both GEMMs.) The
# weights through TMA, with a sweep of 62 tiles at decode sizes (results/moe-gemm-decode-tiles-tma-2026-12-01.json,
# 8 layers in a CUDA graph, us per call, old -> new): gate-up 16.54 -> 15.75 at one token, 46.47 -> 46.05 at
# four, 188.7 -> 188.9 at 130 (4.3 TB/s: the ceiling); down 10.29 -> 9.49, 27.59 -> 25.10, 103.1 -> 100.9.
# The gate-up tile now takes 64 columns of gate and of up, 256 deep, three stages (147 KB of shared memory
# compiled for sm_90a: one program per SM, 96 at one token), the down tile 64 x 128, three stages (41 KB:
# five per SM, 256 programs at one token).
SMALL_TILE_CONFIG = MoEGemmConfig(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=3, tma_weights=True)
SMALL_DOWN_TILE_CONFIG = MoEGemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3,
                                       tma_weights=True)


# Prefill tiles, from the sweep at Qwen3-30B-A3B shapes (bf16, H200, uniform routing; gate-up + down us):
# 512 tokens (32 pairs per expert) the default tiles 356 + 191, 64-deep K steps 214 + 127; 8192 tokens
# (512 per expert) the default 1214 + 1525, 128x128 tiles on 128-row segments 886 + 659 (466 and 313
# TFLOP/s). At 2048 tokens (128 per expert) 128-row segments cost 331 + 221 against the best 64-row
# tiles' 318 + 248: the threshold sits there.
# Weight tiles through TMA (``tma_weights``; the sweep with --grid tma, 2026-12-01,
# results/moe-gemm-sweep-tma-2026-12-01.json), gate-up + down us, pointer loads -> TMA:
#   512 tokens, 64-row tiles: 212.6 + 127.5 -> 208.6 + 125.0;
#   2,340 tokens, 128-row tiles: 420.4 + 279.8 -> 388.2 + 229.2 (down on 128x256 tiles);
#   8,890: 1031.0 + 744.8 -> 925.3 + 597.4; 26,900: 2997.0 + 1985.7 -> 2756.6 + 1553.9 (-13.5%).
# The down projection (K = 768, no SwiGLU pair of accumulators) takes 256-wide tiles at 128 rows, which
# the gate-up GEMM cannot hold (two 128x256 fp32 accumulators: out of registers).
MID_TILE_CONFIG = MoEGemmConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=3, tma_weights=True)
LARGE_TILE_CONFIG = MoEGemmConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3, tma_weights=True)
LARGE_DOWN_TILE_CONFIG = MoEGemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                                       tma_weights=True)


def moe_gemm_config(block_size: int, swiglu: bool = True) -> MoEGemmConfig:
    """The launch config for segments of ``block_size`` rows (see ``moe_block_size``): the gate-up GEMM
    (``swiglu``) or the down projection."""
    if block_size < 64:
        return SMALL_TILE_CONFIG if swiglu else SMALL_DOWN_TILE_CONFIG
    if block_size < 128:
        return MID_TILE_CONFIG
    return LARGE_TILE_CONFIG if swiglu else LARGE_DOWN_TILE_CONFIG


def moe_block_size(num_pairs: int, num_experts: int) -> int:
    """Rows each expert's segment is padded to: 16 when experts get at most 16 pairs on average
    (decode, short prefills), where larger tiles would be mostly padding; 128 from 128 pairs on
    average (long prefills), for 128-row tiles; 64 between."""
    if num_pairs <= 16 * num_experts:
        return 16
    return 64 if num_pairs < 128 * num_experts else 128


@triton.jit
def _moe_gemm_kernel(
    a_ptr, a_desc, w_ptr, w_desc, out_ptr, sorted_pairs_ptr, offsets_ptr,
    N_OUT, K, E, stride_a, stride_we, stride_wn, stride_out,
    NUM_M, NUM_N,
    PAIRS_PER_ROW: tl.constexpr, SWIGLU: tl.constexpr, PRECISION: tl.constexpr, TMA_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    COLUMNS_FIRST: tl.constexpr, SORTED_IN: tl.constexpr, SORTED_OUT: tl.constexpr, TMA_A: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    pid = tl.program_id(0)  # programs start in this order: see MoEGemmConfig.columns_first
    if COLUMNS_FIRST:
        tile_m = pid // NUM_N
        tile_n = pid % NUM_N
    else:
        tile_m = pid % NUM_M
        tile_n = pid // NUM_M
    first_row = tile_m * BLOCK_M
    used_rows = tl.load(offsets_ptr + E)
    if first_row >= used_rows:
        return  # past the last expert's segment: nothing to read or write
    experts = tl.arange(0, BLOCK_E)
    seg_ends = tl.load(offsets_ptr + 1 + experts, mask=experts < E, other=2147483647)  # [BLOCK_E]
    expert = tl.sum((seg_ends <= first_row).to(tl.int32), axis=0)  # segments ending at or before this tile

    # segments are multiples of BLOCK_M, so every row of the tile is inside sorted_pairs
    rows = first_row + tl.arange(0, BLOCK_M)  # [BLOCK_M] grouped rows
    pairs = tl.load(sorted_pairs_ptr + rows)  # [BLOCK_M], -1: padding
    real = pairs >= 0
    # SORTED_IN: a's rows are already grouped (the previous GEMM's SORTED_OUT), row for row with the tile
    a_rows = rows.to(tl.int64) if SORTED_IN else tl.where(real, pairs // PAIRS_PER_ROW, 0).to(tl.int64)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < N_OUT
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_a + ks[None, :]  # [BLOCK_M, BLOCK_K]
    # w[expert] is [N, K]: read a [BLOCK_K, BLOCK_N] tile of its transpose
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    # TMA_W: the tile's weight rows in w seen as [E·N, K] (N = N_OUT, or 2·N_OUT with swiglu); TMA fills
    # what lies past K or past the last expert with zeros, and columns past N_OUT are never stored
    w_row = expert * (2 * N_OUT if SWIGLU else N_OUT) + tile_n * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        if TMA_A:  # SORTED_IN only: the tile's rows are contiguous in a (padding rows are zeros there)
            a = a_desc.load([first_row, k0])
        else:
            a = tl.load(a_ptrs, mask=real[:, None] & k_ok[None, :], other=0.0)
        if TMA_W:
            w = w_desc.load([w_row, k0]).T  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if SWIGLU:
            # the up rows of w[expert] start N_OUT rows after the gate rows
            if TMA_W:
                w_up = w_desc.load([w_row + N_OUT, k0]).T
            else:
                w_up = tl.load(w_ptrs + N_OUT * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SWIGLU:
        # silu(g) = g / (1 + exp(-g)); exp overflows to inf for g < -88 and the result is 0
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if SORTED_OUT:
        # every row of the tile, padding too: its a row was zeros, so it stores zeros (silu(0) · 0 with swiglu),
        # and a SORTED_IN GEMM after this one reads defined rows
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
    else:
        out_ptrs = out_ptr + tl.where(real, pairs, 0).to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=real[:, None] & col_ok[None, :])


def _check_grouping(sorted_pairs: torch.Tensor, expert_offsets: torch.Tensor, E: int, device) -> None:
    for name, t in (("sorted_pairs", sorted_pairs), ("expert_offsets", expert_offsets)):
        assert t.dim() == 1 and t.dtype == torch.int32 and t.is_contiguous() and t.device == device, \
            f"{name} must be a contiguous int32 vector on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
    assert expert_offsets.shape[0] == E + 1, f"expert_offsets must be [{E + 1}], got {tuple(expert_offsets.shape)}"


def moe_gemm_triton(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, expert_offsets: torch.Tensor,
                    block_size: int, pairs_per_row: int, swiglu: bool = False, sorted_in: bool = False,
                    sorted_out: bool = False, *, out: torch.Tensor | None = None,
                    config: MoEGemmConfig | None = None) -> torch.Tensor:
    """a: [P / pairs_per_row, K], w: [E, N, K], grouping from ``moe_align(..., block_size)`` ->
    [P, N] (or [P, N/2] with ``swiglu``: silu(gate) · up) in a.dtype, fp32 accumulation.
    ``sorted_out``: the output is [R, N] in grouped-row order (R = sorted_pairs' length): padding rows zero,
    rows past the last segment not written; ``sorted_in`` (with ``sorted_out``): a is [R, K] in that order, as
    the previous GEMM wrote it (see ``moe_experts_grouped``).
    ``config``: None picks ``moe_gemm_config(block_size, swiglu)``."""
    assert a.dim() == 2 and a.dtype in _FLOAT_DTYPES and a.stride(-1) == 1, \
        f"a must be [rows, K] fp32/fp16/bf16 with a contiguous last dimension, got {a.dtype} {tuple(a.shape)}"
    assert w.dim() == 3 and w.shape[2] == a.shape[1] and w.stride(-1) == 1, \
        f"w must be [E, N, {a.shape[1]}] with a contiguous last dimension, got {tuple(w.shape)}"
    assert w.dtype == a.dtype and w.device == a.device, f"w: {w.dtype} on {w.device}, a: {a.dtype} on {a.device}"
    E, N, K = w.shape
    _check_grouping(sorted_pairs, expert_offsets, E, a.device)
    config = config or moe_gemm_config(block_size, swiglu)
    assert pairs_per_row >= 1, f"pairs_per_row must be >= 1, got {pairs_per_row}"
    block_m = min(config.block_m, block_size)
    assert block_m >= 16 and block_size % block_m == 0, \
        f"block_size ({block_size}) must be a multiple of a tile height >= 16 (config.block_m={config.block_m})"
    R = sorted_pairs.shape[0]
    assert R % block_size == 0, f"sorted_pairs has {R} rows, not a multiple of block_size {block_size}"
    assert not swiglu or N % 2 == 0, f"swiglu needs w's N even (gate rows, then up rows), got {N}"
    assert not sorted_in or (sorted_out and a.shape[0] == R and pairs_per_row == 1), \
        f"sorted_in: a must hold the {R} grouped rows (pairs_per_row 1), and the output is grouped too " \
        f"(sorted_out), got {tuple(a.shape)}, {pairs_per_row}, sorted_out={sorted_out}"
    P, n_out = a.shape[0] * pairs_per_row, N // 2 if swiglu else N
    rows_out = R if sorted_out else P
    if out is None:
        out = torch.empty((rows_out, n_out), dtype=a.dtype, device=a.device)
    assert out.shape == (rows_out, n_out), f"out: shape {tuple(out.shape)}, expected {(rows_out, n_out)}"
    assert out.dtype == a.dtype and out.device == a.device and out.stride(-1) == 1, \
        f"out: {out.dtype} on {out.device} with strides {out.stride()}, expected a's dtype, contiguous rows"
    if P == 0 or n_out == 0 or R == 0:
        return out
    block_n = min(config.block_n, max(16, triton.next_power_of_2(n_out)))
    # the configs are sized for 2-byte elements: fp32 goes half as deep in K, the same shared memory a stage
    # (the one-token gate-up tile's 3 x 80 KB at fp32 is more than an H200 SM has)
    block_k = min(max(16, config.block_k * 2 // a.element_size()), max(16, triton.next_power_of_2(K)))
    tma = config.tma_weights and _tma_weights_ok(w)
    # w as [E·N, K] rows for the descriptor (tma); otherwise w itself, never read through it
    w_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [block_n, block_k]) if tma else w
    # grouped rows of a are contiguous: the tile's rows through a TMA descriptor too, with the weights'
    tma_a = tma and sorted_in and _tma_weights_ok(a.unsqueeze(0))
    a_desc = TensorDescriptor.from_tensor(a, [block_m, block_k]) if tma_a else a
    num_m, num_n = R // block_m, triton.cdiv(n_out, block_n)
    _moe_gemm_kernel[(num_m * num_n,)](
        a, a_desc, w, w_desc, out, sorted_pairs, expert_offsets,
        n_out, K, E, a.stride(0), w.stride(0), w.stride(1), out.stride(0), num_m, num_n,
        PAIRS_PER_ROW=pairs_per_row, SWIGLU=bool(swiglu), TMA_W=tma, COLUMNS_FIRST=config.columns_first,
        SORTED_IN=bool(sorted_in), SORTED_OUT=bool(sorted_out), TMA_A=tma_a,
        # fp32 in full precision, as torch's default fp32 matmul (TF32 off)
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(E),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(a),
    )
    return out


def _tma_weights_ok(w: torch.Tensor) -> bool:
    """w [E, N, K] can be one TMA descriptor over [E·N, K]: contiguous, 16-byte aligned base and rows."""
    return w.is_contiguous() and w.data_ptr() % 16 == 0 and (w.shape[2] * w.element_size()) % 16 == 0


def moe_gemm_ref(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, expert_offsets: torch.Tensor,
                 block_size: int, pairs_per_row: int, swiglu: bool = False, sorted_in: bool = False,
                 sorted_out: bool = False) -> torch.Tensor:
    """A loop of per-expert matmuls in fp32: [P, N] (or [P, N/2] with swiglu) in a.dtype; with ``sorted_out``
    [R, ...] in grouped-row order, zeros in the padding rows and past the last segment (``sorted_in``: a
    holds the grouped rows)."""
    E, N, _ = w.shape
    R = sorted_pairs.shape[0]
    P = a.shape[0] * pairs_per_row
    out = torch.zeros(R if sorted_out else P, N // 2 if swiglu else N, dtype=torch.float32, device=a.device)
    offsets = expert_offsets.tolist()
    for e in range(E):
        rows = torch.arange(offsets[e], offsets[e + 1], device=sorted_pairs.device)
        pairs = sorted_pairs[rows].long()
        rows, pairs = rows[pairs >= 0], pairs[pairs >= 0]  # drop the padding
        y = a[rows if sorted_in else pairs // pairs_per_row].float() @ w[e].float().T  # [pairs, N]
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        out[rows if sorted_out else pairs] = y
    return out.to(a.dtype)


def _supported(a, w, sorted_pairs, expert_offsets, block_size, pairs_per_row, swiglu=False, *args, **kwargs) -> bool:
    return (a.dim() == 2 and a.dtype in _FLOAT_DTYPES and a.stride(-1) == 1 and w.dim() == 3
            and w.dtype == a.dtype and w.stride(-1) == 1 and block_size % 16 == 0)


register("moe_gemm", "reference", moe_gemm_ref)
register("moe_gemm", "triton", moe_gemm_triton, devices=("cuda",), supports=_supported)

_moe_gemm = dispatch("moe_gemm")


def moe_gemm(a: torch.Tensor, w: torch.Tensor, sorted_pairs: torch.Tensor, expert_offsets: torch.Tensor,
             block_size: int, pairs_per_row: int, swiglu: bool = False, sorted_in: bool = False,
             sorted_out: bool = False) -> torch.Tensor:
    """Grouped GEMM over experts. a: [P / pairs_per_row, K], w: [E, N, K], sorted_pairs [R] and
    expert_offsets [E+1] from ``moe_align(ids, E, block_size)`` -> [P, N] in pair order
    ([P, N/2] with ``swiglu``: silu(gate) · up of the two halves of w's rows); ``sorted_out``: [R, ...] in
    grouped-row order, ``sorted_in``: a in that order (see ``moe_experts_grouped``)."""
    return _moe_gemm(a, w, sorted_pairs, expert_offsets, block_size, pairs_per_row, swiglu, sorted_in, sorted_out)


# -- the MoE feed-forward ----------------------------------------------------------------------

def moe_forward(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                top_k: int, renormalize: bool) -> torch.Tensor:
    """Sparse SwiGLU experts. x: [T, D], router_logits: [T, E], w_gate_up: [E, 2I, D] (gate rows
    then up rows), w_down: [E, D, I] -> sum over the top-k experts of weight · expert(x): [T, D].

    Each step dispatches on its own (Triton on CUDA, references on CPU); nothing waits on the
    device, so a decode step can be captured in a CUDA graph. With ``QML_MOE_DECODE=1``, up to
    ``moe_decode.MAX_TOKENS`` tokens on CUDA the whole FFN is ``moe_decode``'s two weight streams
    (off by default: slower on the H200).
    """
    if decode_applies(x, router_logits, w_gate_up, w_down, top_k):
        return moe_decode(x, router_logits, w_gate_up, w_down, top_k, renormalize)
    T, E = router_logits.shape
    block = moe_block_size(T * top_k, E)
    if fused_route_applies(router_logits, top_k, renormalize, block):  # a decode step: one launch
        weights, _, sorted_pairs, offsets, _ = moe_route(router_logits, top_k, renormalize, block)
    else:
        weights, ids = moe_router(router_logits, top_k, renormalize)  # [T, k] each
        sorted_pairs, offsets, inverse = moe_align(ids, E, block)
        if grouped_rows_apply(x, block):
            y = moe_experts_grouped(x, w_gate_up, w_down, sorted_pairs, offsets, block, top_k)
            return moe_combine(y, weights, inverse)
    return moe_combine(moe_experts(x, w_gate_up, w_down, sorted_pairs, offsets, block, top_k), weights)


def moe_experts(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, sorted_pairs: torch.Tensor,
                offsets: torch.Tensor, block: int, top_k: int) -> torch.Tensor:
    """The experts of grouped pairs: gate-up GEMM with the SwiGLU fused, then the down GEMM.
    x: [T, D] -> each pair's expert output [T·k, D], in pair order (before the combine)."""
    h = moe_gemm(x, w_gate_up, sorted_pairs, offsets, block, top_k, swiglu=True)  # [T·k, I]
    return moe_gemm(h, w_down, sorted_pairs, offsets, block, 1)


def grouped_rows_apply(x: torch.Tensor, block: int) -> bool:
    """``moe_forward`` keeps the rows grouped between its GEMMs (``moe_experts_grouped``): switched on
    (``QML_MOE_GROUPED_ROWS=1``) and a long prefill (128-row segments)."""
    return MOE_GROUPED_ROWS and block >= 128


def moe_experts_grouped(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, sorted_pairs: torch.Tensor,
                        offsets: torch.Tensor, block: int, top_k: int) -> torch.Tensor:
    """``moe_experts`` with the intermediate rows left grouped by expert: gate-up writes h [R, I] in
    grouped-row order (``sorted_out``; padding rows zero), so the down projection reads contiguous rows
    (``sorted_in``: through a TMA descriptor, no gather) and writes y [R, D] in that order too; the combine
    then reads each pair's row through ``moe_align``'s inverse. Or the down projection as
    ``torch._grouped_mm`` over the padded segments (``QML_MOE_GROUPED_DOWN=grouped_mm``, bf16 on CUDA), which
    beat our down GEMM at 26,900 tokens on the H200 when given grouped rows (1,118 against 1,464-1,490 us a
    layer, results/moe-gemm-sweep-order-h200-2026-12-03.json) and which needs them.
    Returns y [R, D] (R = sorted_pairs' length; rows past the last segment unwritten)."""
    h = moe_gemm(x, w_gate_up, sorted_pairs, offsets, block, top_k, swiglu=True, sorted_out=True)  # [R, I]
    if GROUPED_DOWN == "grouped_mm" and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(h, w_down.transpose(1, 2), offs=offsets[1:])
    return moe_gemm(h, w_down, sorted_pairs, offsets, block, 1, sorted_in=True, sorted_out=True)


def moe_forward_ref(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    top_k: int, renormalize: bool) -> torch.Tensor:
    """``moe_forward`` as a loop over experts, each expert on the tokens that chose it, in fp32."""
    weights, ids = moe_router_ref(router_logits, top_k, renormalize)  # [T, k]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
    for e in range(w_gate_up.shape[0]):
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[tokens].float() @ w_gate_up[e].float().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w_down[e].float().T  # [tokens, D]
        out.index_add_(0, tokens, y * weights[tokens, slots, None])
    return out.to(x.dtype)


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    T, E, k, K, N, block = d["T"], d["E"], d["k"], d["K"], d["N"], d["block"]
    swiglu, per_pair = d.get("swiglu", False), d.get("per_pair", False)
    ids = draw_expert_ids(T, E, k, gen, d.get("spread", "uniform"))
    sorted_pairs, offsets, _ = moe_align_ref(ids, E, block)

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(device=device, dtype=dtype)

    return {
        "a": randn(T * k if per_pair else T, K),
        "w": randn(E, N, K, scale=K**-0.5),  # outputs of order 1, whatever K
        "sorted_pairs": sorted_pairs.to(device), "expert_offsets": offsets.to(device),
        "block_size": block, "pairs_per_row": 1 if per_pair else k, "swiglu": swiglu,
    }


def _bytes(inputs: dict) -> int:
    a, w, offsets = inputs["a"], inputs["w"], inputs["expert_offsets"]
    used = int((offsets[1:] > offsets[:-1]).sum())  # only the chosen experts' weights are read
    P = a.shape[0] * inputs["pairs_per_row"]
    n_out = w.shape[1] // 2 if inputs["swiglu"] else w.shape[1]
    return (used * w[0].numel() + P * a.shape[1] + P * n_out) * a.element_size()


def _flops(inputs: dict) -> int:
    a, w = inputs["a"], inputs["w"]
    return 2 * a.shape[0] * inputs["pairs_per_row"] * w.shape[1] * w.shape[2]


SMALL_CASES = (
    Case("one-token", {"T": 1, "E": 16, "k": 4, "K": 64, "N": 96, "block": 16, "swiglu": True},
         edge="1 token (decode): 4 tiles of one real row each, 12 experts never read"),
    Case("hot-expert", {"T": 37, "E": 6, "k": 1, "K": 48, "N": 40, "block": 16, "spread": "hot"},
         edge="all tokens to one expert: 3 tiles of expert 0, last one partly padding; K, N tails"),
    Case("empty-experts", {"T": 20, "E": 10, "k": 2, "K": 40, "N": 64, "block": 32, "spread": "sparse",
                           "per_pair": True},
         edge="odd experts get nothing; per-pair rows (the down projection); tile 32 < config.block_m"),
    Case("prime-experts", {"T": 13, "E": 61, "k": 3, "K": 72, "N": 56, "block": 16, "swiglu": True},
         edge="E=61 (prime), mostly one-pair experts; gate/up halves of 28 columns"),
    Case("big-tiles", {"T": 50, "E": 4, "k": 2, "K": 100, "N": 80, "block": 64},
         edge="64-row tiles, 4 K steps with a tail of 4"),
)


def _model_cases() -> tuple[Case, ...]:
    cases = []
    for T, what in ((1, "decode"), (128, "prefill 128"), (8192, "prefill 8192")):
        block = moe_block_size(8 * T, 128)
        base = {"T": T, "E": 128, "k": 8, "block": block}
        cases.append(Case(f"qwen3-30b-a3b-gate-up-T{T}", dict(base, K=2048, N=1536, swiglu=True),
                          edge=f"Qwen3-30B-A3B experts' gate+up with SwiGLU, {what}"))
        cases.append(Case(f"qwen3-30b-a3b-down-T{T}", dict(base, K=768, N=2048, per_pair=True),
                          edge=f"Qwen3-30B-A3B experts' down projection, {what}"))
    return tuple(cases)


MOE_GEMM_SPEC = register_spec(OpSpec(
    op="moe_gemm",
    reference=moe_gemm_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=MoEGemmConfig,
))
