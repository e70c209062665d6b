"""Mixture-of-experts routing: pick experts per token, group the (token, slot) pairs by expert,
and add the experts' outputs back into token order.

Three ops, run around the grouped GEMM of ``qml_kernels.moe_gemm``:

- ``moe_router``: router logits ``[T, E]`` -> softmax over the experts, the top ``k``, optionally
  renormalised to sum to 1 -> ``(weights [T, k] fp32, ids [T, k] int32)``. Experts are chosen
  by their logits (the softmax is monotone, so the order is that of the probabilities), and
  equal logits go to the lower expert id. torch.topk makes no such promise (on CPU it returns
  tied indices in no fixed order), so the reference sorts stably instead. Ties are common:
  bf16 logits have 8 significant bits.
- ``moe_align``: ids ``[T, k]`` -> the pairs ``p = t·k + j`` grouped by expert, each expert's
  group padded with -1 to a multiple of ``block_size`` rows, so that a GEMM tile of
  ``block_size`` rows always belongs to one expert. Returns ``(sorted_pairs [R], expert_offsets
  [E+1], inverse [T·k])``: expert e owns ``sorted_pairs[offsets[e]:offsets[e+1]]``, pairs in
  ascending order, then padding; ``inverse[p]`` is where pair p sits. ``R`` is a bound known on
  the host, ``padded_rows(T·k, E, block_size)``, so no step waits on the device to size a
  buffer (CUDA graphs need that); entries past ``offsets[E]`` are -1 and no GEMM tile reads them.
- ``moe_combine``: per-pair expert outputs ``[T·k, D]`` (pair order, as the grouped GEMM writes
  them) and the weights -> ``out[t] = sum_j weights[t, j] · y[t·k + j]`` in fp32 (deterministic:
  a fixed order of the sum, no atomics).

Traffic: the router reads ``T·E`` logits and writes ``2·T·k`` values; the alignment reads the
``T·k`` ids twice and writes ``R + E + 1 + T·k`` integers (plus, past one program, a table of
``(chunks + 1)·E`` counts that stays in L2); the combine reads ``T·k·D`` and
writes ``T·D`` elements. All three are memory-bound (and small next to the expert GEMMs).

The alignment runs as one program (two passes over the ids: a histogram, then a running count
per expert) only while the pairs fit in a couple of chunks: one launch, which is what decode
needs. That single program took 56 us at 128 tokens and 3.36 ms at 8,192 tokens on the H200
(Qwen3-30B-A3B, 65,536 pairs: 161 ms of an 8,890-token prompt's 48 layers, against a 398 ms
TTFT). Past it, three launches of a program per chunk: a histogram per chunk, a scan over the
chunks per expert, a scatter; no atomics, so the grouping is the same on every run. Both paths
write the padding rows themselves (no fill before them: one launch fewer).

The combine took 28.3 us on the H200 at one token and 32 us at 128 (32 KB and 4 MB read), against
79 us for 268 MB at 8,192: a fixed cost that its bytes do not explain. Its loop of k loads compiled
(Triton 3.6, sm_90a) to two rounds of requests, the last rows' loads issued only after arithmetic
on the first, in 2 programs of 1,024 columns at one token. Now the k rows are one 2-D load, all
requests issued before the first use, and few tokens get narrower column blocks (8 programs at
one token, D=2048), so a token's combine is one memory latency spread over 8 SMs.

Sources: the Qwen3-MoE router as in transformers' Qwen2Moe/Qwen3Moe code (softmax in fp32,
top-k, renormalise when ``norm_topk_prob``); block-aligned expert grouping as described for
vLLM's fused MoE (``moe_align_block_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def padded_rows(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Rows of ``sorted_pairs``: an upper bound on the pairs plus each used expert's padding.

    At most ``min(E, pairs)`` experts receive a pair, and each pads fewer than ``block_size`` rows.
    """
    bound = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return triton.cdiv(bound, block_size) * block_size


@dataclass(frozen=True)
class MoERoutingConfig:
    """Launch tunables of the three routing kernels."""

    router_rows: int = 4  # tokens per router program
    align_chunk: int = 0  # pairs per one-hot tile of the alignment; 0: a [chunk, E] tile of ~8192 values
    # one program (one launch, a serial loop over the chunks) up to this many chunks of pairs; past it,
    # three launches with a program per chunk (at E=128, 2 chunks: 128 pairs, 16 tokens of top-8)
    align_one_program_chunks: int = 2
    combine_block_d: int = 1024  # output columns per combine program (at most; fewer when T is small)
    num_warps: int = 4

    def __post_init__(self):
        for name in ("router_rows", "combine_block_d"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MoERoutingConfig.{name} must be a power of 2, got {value}")
        if self.align_chunk and (self.align_chunk < 16 or self.align_chunk & (self.align_chunk - 1)):
            raise ValueError(f"MoERoutingConfig.align_chunk must be 0 or a power of 2 >= 16, got {self.align_chunk}")
        if self.align_one_program_chunks < 0:
            raise ValueError(f"MoERoutingConfig.align_one_program_chunks must be >= 0, got "
                             f"{self.align_one_program_chunks}")


# -- router ---------------------------------------------------------------------------------

@triton.jit
def _route_tile(logits_ptr, rows, T, E, stride_logits, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rows`` [BLOCK_T] of the logits -> (weights, ids) [BLOCK_T, BLOCK_K] fp32 / int32 in
    registers (slots past TOP_K and rows past T hold junk; the callers mask them)."""
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)  # [BLOCK_E]
    col_ok = cols < E
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :], mask=ok,
                other=float("-inf")).to(tl.float32)  # [BLOCK_T, BLOCK_E]
    # rows past T would be all -inf, and -inf - -inf is NaN: give them zeros (never stored)
    x = tl.where(row_ok[:, None], x, 0.0)
    row_max = tl.max(x, axis=1)  # [BLOCK_T]
    denom = tl.sum(tl.where(col_ok[None, :], tl.exp(x - row_max[:, None]), 0.0), axis=1)  # softmax denominator

    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    sel_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    sel_id = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    taken = cols[None, :] >= E  # [BLOCK_T, BLOCK_E]: padding columns are never candidates
    for j in tl.static_range(TOP_K):
        cand = tl.where(taken, float("-inf"), x)
        best = tl.max(cand, axis=1)  # [BLOCK_T]
        # among the columns holding the best logit, the lowest untaken expert id
        hit = (cand == best[:, None]) & (~taken)
        idx = tl.min(tl.where(hit, cols[None, :], BLOCK_E), axis=1)  # [BLOCK_T]
        taken = taken | (cols[None, :] == idx[:, None])
        prob = tl.exp(best - row_max) / denom
        sel_w = tl.where(slots[None, :] == j, prob[:, None], sel_w)
        sel_id = tl.where(slots[None, :] == j, idx[:, None], sel_id)
    if RENORMALIZE:
        sel_w = sel_w / tl.sum(sel_w, axis=1)[:, None]
    return sel_w, sel_id


@triton.jit
def _moe_router_kernel(
    logits_ptr, weights_ptr, ids_ptr, T, E, stride_logits,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    sel_w, sel_id = _route_tile(logits_ptr, rows, T, E, stride_logits, TOP_K, RENORMALIZE, BLOCK_T, BLOCK_E,
                                 BLOCK_K)
    slots = tl.arange(0, BLOCK_K)
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = (rows[:, None] < T) & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, sel_w, mask=keep)
    tl.store(ids_ptr + out, sel_id, mask=keep)


def moe_router_triton(logits: torch.Tensor, top_k: int, renormalize: bool, *,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      config: MoERoutingConfig = MoERoutingConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] fp32, ids [T, k] int32). ``out``: a pair to write into."""
    assert logits.dim() == 2, f"logits must be [T, E], got shape {tuple(logits.shape)}"
    assert logits.dtype in _FLOAT_DTYPES, f"logits: unsupported dtype {logits.dtype}"
    assert logits.stride(-1) == 1, f"logits: the last dimension must be contiguous, strides {logits.stride()}"
    T, E = logits.shape
    assert 1 <= top_k <= E, f"top_k must be in [1, {E}], got {top_k}"
    if out is None:
        out = (torch.empty((T, top_k), dtype=torch.float32, device=logits.device),
               torch.empty((T, top_k), dtype=torch.int32, device=logits.device))
    weights, ids = out
    assert weights.shape == (T, top_k) and weights.dtype == torch.float32 and weights.is_contiguous(), \
        f"out[0] (weights) must be contiguous fp32 [{T}, {top_k}], got {weights.dtype} {tuple(weights.shape)}"
    assert ids.shape == (T, top_k) and ids.dtype == torch.int32 and ids.is_contiguous(), \
        f"out[1] (ids) must be contiguous int32 [{T}, {top_k}], got {ids.dtype} {tuple(ids.shape)}"
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    block_t = min(config.router_rows, triton.next_power_of_2(T))
    _moe_router_kernel[(triton.cdiv(T, block_t),)](
        logits, weights, ids, T, E, logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=config.num_warps, **pdl.launch_args(logits),
    )
    return weights, ids


def moe_router_ref(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> (weights [T, k] fp32, ids [T, k] int32); ties to the lower expert id."""
    scores = logits.float()  # [T, E]
    probs = torch.softmax(scores, dim=-1)
    ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]  # [T, k]
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


# -- alignment: pairs grouped by expert -----------------------------------------------------
#
# Small T: one program, two passes over the ids (a histogram, then a running count per expert);
# one launch, which is what decode needs. Large T: three launches, each over the pairs cut into
# chunks of BLOCK_P, every chunk its own program, with no atomics (so the result is the same on
# every run): a histogram per chunk -> per expert, the pairs of its own in the chunks before each
# chunk (a scan over the chunks) -> each chunk scatters its pairs after those. Both paths write
# every row of sorted_pairs, padding included, so no fill runs before them.

@triton.jit
def _segments(counts, ALIGN: tl.constexpr):
    """Per-expert pair counts [BLOCK_E] -> (first row, end row) of each expert's padded segment."""
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends


@triton.jit
def _write_offsets_and_padding(sorted_pairs_ptr, offsets_ptr, starts, ends, counts, E,
                               ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, PAD_COLS: tl.constexpr):
    """offsets [E+1], and -1 in each segment's rows past its pairs (fewer than ALIGN per expert)."""
    experts = tl.arange(0, BLOCK_E)
    tl.store(offsets_ptr + experts + 1, ends, mask=experts < E)
    tl.store(offsets_ptr + experts, tl.zeros([BLOCK_E], dtype=tl.int32), mask=experts == 0)
    filled = starts + counts  # [BLOCK_E]: first padding row of each segment
    cols = tl.arange(0, PAD_COLS)
    for j in range(0, ALIGN, PAD_COLS):
        rows = filled[:, None] + j + cols[None, :]  # [BLOCK_E, PAD_COLS]
        tl.store(sorted_pairs_ptr + rows, tl.full([BLOCK_E, PAD_COLS], -1, tl.int32),
                 mask=(experts[:, None] < E) & (rows < ends[:, None]))


@triton.jit
def _write_tail(sorted_pairs_ptr, used, R, program, num_programs, BLOCK_TAIL: tl.constexpr):
    """-1 in rows [used, R), past the last segment, shared among the programs."""
    for first in range(used + program * BLOCK_TAIL, R, num_programs * BLOCK_TAIL):
        rows = first + tl.arange(0, BLOCK_TAIL)
        tl.store(sorted_pairs_ptr + rows, tl.full([BLOCK_TAIL], -1, tl.int32), mask=rows < R)


@triton.jit
def _chunk_onehot(ids_ptr, pairs, P, E, BLOCK_E: tl.constexpr):
    """[BLOCK_P, BLOCK_E] int32: 1 where the pair goes to the expert. An id outside [0, E) matches
    no expert, so the pair is dropped rather than written to row 0."""
    e = tl.load(ids_ptr + pairs, mask=pairs < P, other=-1)
    e = tl.where(e < E, e, -1)
    return (e[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


@triton.jit
def _scatter_chunk(ids_ptr, sorted_pairs_ptr, inverse_ptr, pairs, next_row, P, E, BLOCK_E: tl.constexpr):
    """Rows for one chunk of pairs: a pair's row is its expert's next free row (``next_row``
    [BLOCK_E]) + the pairs of that expert before it in the chunk. Returns the chunk's counts."""
    onehot = _chunk_onehot(ids_ptr, pairs, P, E, BLOCK_E)  # [BLOCK_P, BLOCK_E]
    rank = tl.cumsum(onehot, axis=0)  # 1-based rank of each pair within its expert, in this chunk
    row = tl.sum(onehot * (next_row[None, :] + rank - 1), axis=1)  # [BLOCK_P]
    ok = tl.sum(onehot, axis=1) > 0
    tl.store(sorted_pairs_ptr + row, pairs, mask=ok)
    tl.store(inverse_ptr + pairs, row, mask=ok)
    return tl.sum(onehot, axis=0)


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr, P, E, R,
    ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PAD_COLS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    chunk = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, P, BLOCK_P):
        counts += tl.sum(_chunk_onehot(ids_ptr, start + chunk, P, E, BLOCK_E), axis=0)
    starts, ends = _segments(counts, ALIGN)
    _write_offsets_and_padding(sorted_pairs_ptr, offsets_ptr, starts, ends, counts, E, ALIGN, BLOCK_E, PAD_COLS)
    _write_tail(sorted_pairs_ptr, tl.sum(ends - starts, axis=0), R, 0, 1, BLOCK_TAIL)
    # second pass: a pair's row is its expert's start + the pairs of that expert before it
    next_row = starts
    for start in range(0, P, BLOCK_P):
        next_row += _scatter_chunk(ids_ptr, sorted_pairs_ptr, inverse_ptr, start + chunk, next_row, P, E, BLOCK_E)


@triton.jit
def _moe_align_count_kernel(ids_ptr, counts_ptr, P, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                            PDL: tl.constexpr):
    """counts[c, e]: the pairs of chunk c that go to expert e. counts: [chunks + 1, E]."""
    pdl.enter(PDL)
    chunk = tl.program_id(0)
    pairs = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.sum(_chunk_onehot(ids_ptr, pairs, P, E, BLOCK_E), axis=0)
    tl.store(counts_ptr + chunk * E + experts, counts, mask=experts < E)


@triton.jit
def _moe_align_scan_kernel(counts_ptr, num_chunks, E, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """One program per expert, in place: counts[c, e] -> the pairs of expert e in chunks before c;
    row ``num_chunks`` gets the expert's total."""
    pdl.enter(PDL)
    expert = tl.program_id(0)
    before = tl.zeros([BLOCK_C], dtype=tl.int32)  # pairs of this expert in the chunks done so far
    for first in range(0, num_chunks + 1, BLOCK_C):
        chunks = first + tl.arange(0, BLOCK_C)
        ptrs = counts_ptr + chunks * E + expert
        c = tl.load(ptrs, mask=chunks < num_chunks, other=0)
        tl.store(ptrs, before + tl.cumsum(c, axis=0) - c, mask=chunks <= num_chunks)
        before += tl.sum(c, axis=0)


@triton.jit
def _moe_align_scatter_kernel(
    ids_ptr, counts_ptr, sorted_pairs_ptr, offsets_ptr, inverse_ptr, P, E, R, num_chunks,
    ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, PAD_COLS: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    chunk = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    # every program derives the segments from the totals (E values: cheaper than a fourth launch)
    totals = tl.load(counts_ptr + num_chunks * E + experts, mask=experts < E, other=0)
    before = tl.load(counts_ptr + chunk * E + experts, mask=experts < E, other=0)
    starts, ends = _segments(totals, ALIGN)
    if chunk == 0:
        _write_offsets_and_padding(sorted_pairs_ptr, offsets_ptr, starts, ends, totals, E, ALIGN, BLOCK_E, PAD_COLS)
    _write_tail(sorted_pairs_ptr, tl.sum(ends - starts, axis=0), R, chunk, num_chunks, BLOCK_TAIL)
    pairs = chunk * BLOCK_P + tl.arange(0, BLOCK_P)
    _scatter_chunk(ids_ptr, sorted_pairs_ptr, inverse_ptr, pairs, starts + before, P, E, BLOCK_E)


def _align_blocks(num_experts: int, block_size: int, config: MoERoutingConfig) -> dict:
    """Tile sizes of the alignment kernels: a [chunk, E] one-hot tile of ~8192 values, padding
    written in [E, PAD_COLS] tiles of at most ~8192 values."""
    block_e = triton.next_power_of_2(num_experts)
    return {"BLOCK_P": config.align_chunk or max(16, 8192 // block_e), "BLOCK_E": block_e,
            "PAD_COLS": min(triton.next_power_of_2(block_size), max(1, 8192 // block_e)), "BLOCK_TAIL": 1024}


def moe_align_triton(ids: torch.Tensor, num_experts: int, block_size: int, *,
                     out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     config: MoERoutingConfig = MoERoutingConfig()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, k] int32 -> (sorted_pairs [R] int32, expert_offsets [E+1] int32, inverse [T·k] int32),
    R = ``padded_rows(T·k, E, block_size)``. ``out`` is a triple to write into; every row of its
    sorted_pairs is rewritten (padding included)."""
    assert ids.dim() == 2 and ids.dtype == torch.int32 and ids.is_contiguous(), \
        f"ids must be contiguous int32 [T, k], got {ids.dtype} {tuple(ids.shape)}"
    assert num_experts >= 1 and block_size >= 1, "num_experts and block_size must be positive"
    P = ids.numel()
    R = padded_rows(P, num_experts, block_size)
    if out is None:
        out = (torch.empty(R, dtype=torch.int32, device=ids.device),
               torch.empty(num_experts + 1, dtype=torch.int32, device=ids.device),
               torch.empty(P, dtype=torch.int32, device=ids.device))
    sorted_pairs, offsets, inverse = out
    for name, t, n in (("sorted_pairs", sorted_pairs, R), ("expert_offsets", offsets, num_experts + 1),
                       ("inverse", inverse, P)):
        assert t.shape == (n,) and t.dtype == torch.int32 and t.is_contiguous() and t.device == ids.device, \
            f"out {name} must be contiguous int32 [{n}] on {ids.device}, got {t.dtype} {tuple(t.shape)}"
    blocks = _align_blocks(num_experts, block_size, config)
    num_chunks = triton.cdiv(P, blocks["BLOCK_P"])
    if num_chunks <= config.align_one_program_chunks:
        _moe_align_kernel[(1,)](ids, sorted_pairs, offsets, inverse, P, num_experts, R,
                                ALIGN=block_size, **blocks, num_warps=config.num_warps, **pdl.launch_args(ids))
        return sorted_pairs, offsets, inverse
    counts = torch.empty((num_chunks + 1, num_experts), dtype=torch.int32, device=ids.device)  # [chunks + 1, E]
    launch = pdl.launch_args(ids)
    _moe_align_count_kernel[(num_chunks,)](ids, counts, P, num_experts, BLOCK_P=blocks["BLOCK_P"],
                                           BLOCK_E=blocks["BLOCK_E"], num_warps=config.num_warps, **launch)
    _moe_align_scan_kernel[(num_experts,)](counts, num_chunks, num_experts,
                                           BLOCK_C=min(1024, triton.next_power_of_2(num_chunks + 1)),
                                           num_warps=config.num_warps, **launch)
    _moe_align_scatter_kernel[(num_chunks,)](ids, counts, sorted_pairs, offsets, inverse, P, num_experts, R,
                                             num_chunks, ALIGN=block_size, **blocks, num_warps=config.num_warps,
                                             **launch)
    return sorted_pairs, offsets, inverse


def moe_align_ref(ids: torch.Tensor, num_experts: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids: [T, k] -> (sorted_pairs [R], expert_offsets [E+1], inverse [T·k]), all int32 (see module doc)."""
    flat = ids.flatten().long().cpu()  # [P]: pair p = t·k + j goes to expert flat[p]
    P = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_size - 1) // block_size * block_size
    offsets = torch.cat([padded.new_zeros(1), padded.cumsum(0)])  # [E+1]
    sorted_pairs = torch.full((padded_rows(P, num_experts, block_size),), -1, dtype=torch.int64)
    inverse = torch.empty(P, dtype=torch.int64)
    for e in range(num_experts):
        members = (flat == e).nonzero().flatten()  # ascending pair order
        rows = offsets[e] + torch.arange(members.numel())
        sorted_pairs[rows] = members
        inverse[members] = rows
    dev = ids.device
    return sorted_pairs.int().to(dev), offsets.int().to(dev), inverse.int().to(dev)


# -- combine: weighted sum back into token order ---------------------------------------------

@triton.jit
def _moe_combine_kernel(
    y_ptr, weights_ptr, rows_ptr, out_ptr, D, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    slots = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    pairs = token * TOP_K + slots
    w = tl.load(weights_ptr + pairs, mask=slots < TOP_K, other=0.0)  # [BLOCK_K]
    if HAS_ROWS:  # y in grouped-row order: each pair's row from the alignment's inverse
        src = tl.load(rows_ptr + pairs, mask=slots < TOP_K, other=0).to(tl.int64)
    else:
        src = pairs
    # the k rows in one [BLOCK_K, BLOCK_D] load: all k requests are in flight at once, where a loop
    # of k loads each followed by its use can wait out k memory latencies one after the other
    y = tl.load(y_ptr + src[:, None] * stride_y + cols[None, :],
                mask=(slots < TOP_K)[:, None] & (cols < D)[None, :], other=0.0)
    acc = tl.sum(w[:, None] * y.to(tl.float32), axis=0)  # [BLOCK_D], fp32
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < D)


def _combine_blocks(T: int, D: int, config: MoERoutingConfig) -> tuple[int, int]:
    """(columns per program, warps). Few tokens: narrower column blocks, so that more SMs each
    fetch a share of the k rows (at T=1, D=2048: 8 programs of 256 columns, not 2 of 1024); a
    warp per 256 columns, each thread loading 16 bytes of each of the k rows (bf16)."""
    block_d = min(config.combine_block_d, triton.next_power_of_2(D))
    while block_d > 256 and T * triton.cdiv(D, block_d) < 128:
        block_d //= 2
    return block_d, max(1, min(config.num_warps, block_d // 256))


def moe_combine_triton(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None, *,
                       out: torch.Tensor | None = None, config: MoERoutingConfig = MoERoutingConfig()) -> torch.Tensor:
    """y: [T·k, D] (pair order), weights: [T, k] fp32 -> [T, D] in y.dtype. ``rows`` [T·k] int32: y is in
    another order (grouped rows, ``moe_align``'s inverse), pair p's row is y[rows[p]]."""
    assert weights.dim() == 2 and weights.dtype == torch.float32 and weights.is_contiguous(), \
        f"weights must be contiguous fp32 [T, k], got {weights.dtype} {tuple(weights.shape)}"
    T, k = weights.shape
    if rows is None:
        assert y.dim() == 2 and y.shape[0] == T * k, f"y must be [{T * k}, D], got {tuple(y.shape)}"
    else:
        assert rows.shape == (T * k,) and rows.dtype == torch.int32 and rows.is_contiguous(), \
            f"rows must be contiguous int32 [{T * k}], got {rows.dtype} {tuple(rows.shape)}"
        assert y.dim() == 2, f"y must be [rows, D], got {tuple(y.shape)}"
    assert y.dtype in _FLOAT_DTYPES and y.stride(-1) == 1, f"y: {y.dtype} with strides {y.stride()}"
    D = y.shape[1]
    if out is None:
        out = torch.empty((T, D), dtype=y.dtype, device=y.device)
    assert out.shape == (T, D) and out.dtype == y.dtype and out.stride(-1) == 1, \
        f"out must be [{T}, {D}] {y.dtype} with a contiguous last dimension"
    if T == 0 or D == 0:
        return out
    block_d, num_warps = _combine_blocks(T, D, config)
    _moe_combine_kernel[(T, triton.cdiv(D, block_d))](
        y, weights, weights if rows is None else rows, out, D, y.stride(0), out.stride(0),
        TOP_K=k, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=block_d, HAS_ROWS=rows is not None,
        num_warps=num_warps, **pdl.launch_args(y),
    )
    return out


def moe_combine_ref(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """y: [T·k, D], weights: [T, k] -> sum_j weights[t, j] · y[t·k + j]: [T, D] in y.dtype (``rows``: pair p's
    row is y[rows[p]])."""
    if rows is not None:
        y = y[rows.long()]
    T, k = weights.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(k):  # slot order (the kernel may add in another order: fp32 roundings apart)
        out += weights[:, j, None].float() * y[j::k].float()
    return out.to(y.dtype)


# -- registration ----------------------------------------------------------------------------

def _router_supported(logits, *args, **kwargs) -> bool:
    return logits.dim() == 2 and logits.dtype in _FLOAT_DTYPES and logits.stride(-1) == 1


def _align_supported(ids, *args, **kwargs) -> bool:
    return ids.dim() == 2 and ids.dtype == torch.int32 and ids.is_contiguous()


def _combine_supported(y, weights, *args, **kwargs) -> bool:
    return (y.dim() == 2 and y.dtype in _FLOAT_DTYPES and y.stride(-1) == 1
            and weights.dtype == torch.float32 and weights.is_contiguous())


register("moe_router", "reference", moe_router_ref)
register("moe_router", "triton", moe_router_triton, devices=("cuda",), supports=_router_supported)
register("moe_align", "reference", moe_align_ref)
register("moe_align", "triton", moe_align_triton, devices=("cuda",), supports=_align_supported)
register("moe_combine", "reference", moe_combine_ref)
register("moe_combine", "triton", moe_combine_triton, devices=("cuda",), supports=_combine_supported)

_moe_router = dispatch("moe_router")
_moe_align = dispatch("moe_align")
_moe_combine = dispatch("moe_combine")


def moe_router(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k (ties to the lower id), optional renormalisation.
    logits: [T, E] -> (weights [T, k] fp32, ids [T, k] int32)."""
    return _moe_router(logits, top_k, renormalize)


def moe_align(ids: torch.Tensor, num_experts: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group pairs by expert, padded to ``block_size`` rows. ids: [T, k] int32 ->
    (sorted_pairs [padded_rows(T·k, E, block_size)], expert_offsets [E+1], inverse [T·k]), int32."""
    return _moe_align(ids, num_experts, block_size)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's expert outputs. y: [T·k, D] (pair order), weights: [T, k] -> [T, D].
    ``rows`` [T·k]: y is in grouped-row order, pair p's output at y[rows[p]] (``moe_align``'s inverse)."""
    return _moe_combine(y, weights, rows)


# -- workbench ------------------------------------------------------------------------------

def draw_expert_ids(T: int, E: int, k: int, gen: torch.Generator, spread: str = "uniform") -> torch.Tensor:
    """[T, k] int32 of distinct experts per token, as a router would pick them.

    ``spread``: "uniform" (every expert equally likely), "hot" (expert 0 is in every token's
    choice), "sparse" (only the experts with an even id are ever chosen, the odd ones get none).
    """
    scores = torch.rand(T, E, generator=gen, device=gen.device).cpu()  # [T, E]
    if spread == "hot":
        scores[:, 0] = 2.0
    elif spread == "sparse":
        assert k <= (E + 1) // 2, "sparse routing needs k <= the number of even experts"
        scores[:, 1::2] = -1.0
    elif spread != "uniform":
        raise ValueError(f"unknown spread {spread!r}")
    return scores.argsort(dim=1, descending=True)[:, :k].to(torch.int32).contiguous()


def _make_router_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    T, E = case.dims["T"], case.dims["E"]
    logits = 2.0 * torch.randn(T, E, generator=gen, device=gen.device)
    if case.dims.get("ties"):
        logits = logits.round()  # integers from about -6 to 6: many equal logits per row
    return {"logits": logits.to(device=device, dtype=dtype), "top_k": case.dims["k"],
            "renormalize": case.dims.get("renormalize", True)}


def _make_align_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    d = case.dims
    ids = draw_expert_ids(d["T"], d["E"], d["k"], gen, d.get("spread", "uniform"))
    return {"ids": ids.to(device), "num_experts": d["E"], "block_size": d["block"]}


def _make_combine_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    T, k, D = case.dims["T"], case.dims["k"], case.dims["D"]
    y = torch.randn(T * k, D, generator=gen, device=gen.device)
    weights = torch.softmax(torch.randn(T, k, generator=gen, device=gen.device), dim=-1)
    return {"y": y.to(device=device, dtype=dtype), "weights": weights.to(device)}


ROUTER_CASES = (
    Case("one-token", {"T": 1, "E": 128, "k": 8}, edge="1 token (decode), Qwen3-30B-A3B's 128 experts, top-8"),
    Case("prime-experts", {"T": 7, "E": 61, "k": 4, "renormalize": False},
         edge="E=61 (prime): masked expert columns; weights not renormalised"),
    Case("ties", {"T": 9, "E": 16, "k": 6, "ties": True}, edge="integer logits: ties go to the lower expert id"),
    Case("all-experts", {"T": 5, "E": 8, "k": 8}, edge="k = E: every expert chosen, renormalised weights sum to 1"),
    Case("top-1", {"T": 6, "E": 3, "k": 1}, edge="top-1 over 3 experts: renormalised weight is exactly 1"),
)

ALIGN_CASES = (
    Case("one-token", {"T": 1, "E": 128, "k": 8, "block": 16}, edge="1 token: 8 experts used, 120 empty"),
    Case("hot-expert", {"T": 40, "E": 8, "k": 1, "block": 16, "spread": "hot"},
         edge="all tokens to one expert (top-1): one segment of 48 rows, 7 empty experts"),
    Case("sparse", {"T": 33, "E": 10, "k": 2, "block": 8, "spread": "sparse"},
         edge="odd experts get no tokens: zero-length segments between used ones"),
    Case("prime-experts", {"T": 23, "E": 61, "k": 4, "block": 64}, edge="E=61, block 64 > most segments"),
    Case("multi-chunk", {"T": 300, "E": 128, "k": 8, "block": 64},
         edge="2400 pairs: many chunks of the alignment loop, ranks carried across chunks"),
)

COMBINE_CASES = (
    Case("one-token", {"T": 1, "k": 8, "D": 256}, edge="1 token, 8 slots"),
    Case("odd-width", {"T": 5, "k": 3, "D": 333}, edge="odd D: masked tail"),
    Case("top-1", {"T": 4, "k": 1, "D": 1500}, edge="k=1 (a plain weighted copy), two column blocks"),
)


def _router_model_cases() -> tuple[Case, ...]:
    return tuple(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "E": 128, "k": 8}, edge=f"Qwen3-30B-A3B router, {T} tokens")
                 for T in (1, 128, 8192))


MOE_ROUTER_SPEC = register_spec(OpSpec(
    op="moe_router",
    reference=moe_router_ref,
    make_inputs=_make_router_inputs,
    cases=ROUTER_CASES,
    model_cases=_router_model_cases(),
    bytes_moved=lambda inputs: (inputs["logits"].numel() * inputs["logits"].element_size()
                                + 8 * inputs["logits"].shape[0] * inputs["top_k"]),
    flops=lambda inputs: 4 * inputs["logits"].numel() * (1 + inputs["top_k"]),  # softmax; a max and min per pick
    out_arg="out",
    launch_config=MoERoutingConfig,
    notes="returns (weights fp32, ids int32); `out` is a pair mirroring it",
))

MOE_ALIGN_SPEC = register_spec(OpSpec(
    op="moe_align",
    reference=moe_align_ref,
    make_inputs=_make_align_inputs,
    cases=ALIGN_CASES,
    model_cases=tuple(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "E": 128, "k": 8, "block": 64},
                           edge=f"Qwen3-30B-A3B, {T} tokens") for T in (1, 128, 8192)),
    bytes_moved=lambda inputs: 4 * (3 * inputs["ids"].numel() + inputs["num_experts"] + 1
                                    + padded_rows(inputs["ids"].numel(), inputs["num_experts"], inputs["block_size"])),
    dtypes=(torch.float32,),  # integer op: one run per case
    exact=True,
    out_arg="out",
    launch_config=MoERoutingConfig,
    notes="returns (sorted_pairs, expert_offsets, inverse); `out` is a triple mirroring it",
))

MOE_COMBINE_SPEC = register_spec(OpSpec(
    op="moe_combine",
    reference=moe_combine_ref,
    make_inputs=_make_combine_inputs,
    cases=COMBINE_CASES,
    model_cases=tuple(Case(f"qwen3-30b-a3b-T{T}", {"T": T, "k": 8, "D": 2048}, edge=f"Qwen3-30B-A3B, {T} tokens")
                      for T in (1, 128, 8192)),
    bytes_moved=lambda inputs: (inputs["y"].numel() + inputs["y"].numel() // inputs["weights"].shape[1])
    * inputs["y"].element_size(),
    flops=lambda inputs: 2 * inputs["y"].numel(),
    out_arg="out",
    launch_config=MoERoutingConfig,
))
