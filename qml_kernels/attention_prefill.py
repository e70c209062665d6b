"""Paged prefill attention: FlashAttention-2 over a ragged batch of query chunks and a paged KV cache.

Conventions are ``paged_attention_ref``'s (qml_kernels.attention): sequence ``b`` owns query
rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, its last ``n_q`` tokens, so query ``i`` sits at
position ``L - n_q + i`` (``L = context_lens[b]``) and sees the keys at positions
``<= L - n_q + i`` (and ``> pos - W`` with a sliding window W). The new tokens' K/V are already
in the pages. One kernel serves plain prefill (``n_q == L``), chunked prefill and prefill after
a prefix-cache hit (``n_q < L``), and decode rows mixed into such a batch (``n_q == 1``).

Layouts: q/out ``[T, H, Dh]`` (any token/head strides, contiguous Dh), caches
``[P, S, Hkv, Dh]`` (pages of S slots; K and V with the same strides, as views of one
allocation are), ``block_tables [B, pages]`` int32, sinks ``[H]`` (fp32 logits).

Tiling: a program owns one KV head and ``BLOCK_M // group`` consecutive query tokens of one
sequence, with the ``group`` query heads sharing that KV head stacked into the tile's rows
(row r = token r // group, head r % group), so every K/V page is read once per KV head rather
than once per query head, and a decode row still fills ``group`` rows of the MMA. The program
walks its keys in blocks of BLOCK_N slots gathered through the block table, skipping blocks
outside the causal/window band and masking only the blocks that cut it. Softmax is online, in
fp32 and base 2 (``exp2`` with log2(e) folded into the logit scale); soft-capping
``c * tanh(s / c)`` applies to the logits before the mask; a sink joins only the final
denominator (``l += exp(sink - m)``), since it has no value.
Programs find their (sequence, tile) on the device: tile ``j`` of sequence ``b`` is program
``cu_seqlens_q[b] // tokens_per_tile + b + j`` (an upper bound of the tiles before it), so the
grid needs only T and B from the host and no index tensor is built per call; the at most B
programs that land past a sequence's last tile exit at once.

Pipelining the gathers: a block's page ids come from the block table, so its K/V addresses depend on
a load. Loaded in the iteration that gathers them, Triton 3.6's pipeliner staged the id load one
block ahead and the gathers at distance 1, waiting for each block's K/V right after issuing them
(``cp.async.wait_group 0``); the direct launch (8 warps, one program per SM) then waited out the load
latency at every block. With ``prefetch_pages`` the ids of block j + 2 are loaded during block j and
carried in registers, and the gathers go ``num_stages - 1`` blocks ahead: fresh 2,340-token prompts
1.19-1.22x faster a layer, a 1,024-token chunk over 32k cached keys 1.44x. The split-KV launch keeps
the ids beside its gathers (``split_prefetch_pages``): there two 4-warp programs per SM hide each
other, and the extra K/V buffer costs one of them.

Traffic and work: each sequence's K/V band is read (``2 L Hkv Dh`` elements without a window;
a sequence of several tiles re-reads it per tile, mostly from L2) plus q and out (``2 T H Dh``);
FLOPs are ``4 H Dh`` per visible (query, key) pair, about ``2 n_q L H Dh`` for a causal prefill.
A Llama-3.1-8B prefill of 8192 tokens does ~3000 FLOPs per byte (compute-bound; the H200's ridge
is ~180), one of 128 tokens ~50, decode rows ~1 (bandwidth-bound).

Split-KV mode (flash-decoding's idea applied to query tiles): a short chunk over a long cached
context, like the next turn of a conversation (216 new tokens over 28,000 cached for Llama-3.1-8B),
has only 7 tiles x 8 KV heads = 56 programs, each walking all 28k keys, so 76 of the H200's 132
SMs idle (0.82 ms a layer). The grid then gets a third axis of ``splits``: program
``(tile, kv head, split)`` takes its share of the key blocks the tile needs (the band [lo, hi)
above, cut into ``splits`` runs of whole BLOCK_N blocks that differ by at most one block, the
masked/unmasked parts kept apart inside each run), and writes its rows' normalized partial output
and log-sum-exp (base 2) to an fp32 workspace ``[T, H, splits, Dh]`` + ``[T, H, splits]``. A second
kernel, decode's merge (``attention_decode._paged_decode_attention_merge_kernel``, whose layout
this is, with token rows for sequence rows), combines each (token, head)'s splits by their
log-sum-exps and adds the sink to the denominator once. A row that sees no key in a run (outside
the window, past the diagonal, or a run left empty when the band has fewer blocks than splits)
keeps l = 0: it stores lse = -inf and no output, and weighs 0 in the merge.

Extra traffic: the workspace, ``T * H * splits * (Dh + 1)`` fp32 written once and read once
(~25 MB at 7 splits for the 216-token turn, against ~115 MB of K/V; the band is still read once
per tile, mostly from L2), and a merge launch: a few microseconds to ~20. The split count is
chosen on the host (``prefill_num_splits``) from host values only (the tiles from
``cu_seqlens_q_host``, Hkv, and the longest band from ``max(meta.context_lens_host)`` and the
window), never from device tensors, so a launch captured in a CUDA graph stays valid while the
real lengths change on the device: each program finds its run of the band on the device, and any
split count is correct for any lengths. The choice models time in key steps of one program: with
one program of 8 warps resident per SM (~220 registers a thread) for the direct launch, and two of
4 warps for the split launch (64 keys a step, up to Dh 128), ``ceil(programs * s / concurrent)``
waves of ``band / s`` keys each, plus the merge (about one key step per program and split for the
workspace, and a fixed launch cost), and keeps the cheapest s. Measured on the H200 (bf16,
Llama-3.1-8B, one layer, the automatic choice in brackets, the best forced count within 3%):
216 over 28,000 keys 825 -> 371 us (7 splits), 133 over 8,000 241 -> 103 us (3), 64 over 16,000
501 -> 82 us (8); 512 and 1024 over 32k fill one and two waves and keep one split (a forced
second split gains 4-6%). (Those were measured with the split launch at 8 warps and 128 keys a step;
its 4-warp form took 100-400 new queries over 27,339 keys 7-14% lower, e.g. 219: 311 -> 287 us.)
Fresh prompts (short bands, or tiles that fill a wave: splitting a
512-token one took it from ~30 to ~55 us) and big mixed batches run with one split: no workspace,
no merge launch, the output written directly as before.

Sources: Dao, "FlashAttention-2" (2023) for the loop and the online softmax; the paged
layout and sink fold of qml_kernels.attention's reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qml_kernels import pdl
from qml_kernels.attention import AttentionMetadata, paged_attention_ref
from qml_kernels.attention_decode import H200_SMS, _paged_decode_attention_merge_kernel
from qml_kernels.registry import dispatch, register
from qml_kernels.workbench.spec import Case, OpSpec, register_spec

LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PagedPrefillAttentionConfig:
    """Launch tunables; ``None`` block sizes are picked from the head dim (``tiles``).

    block_m: query rows per program (tokens x query heads of one KV head), power of 2 >= 16;
    block_n: key slots per loop step (gathered page by page), power of 2 >= 16;
    num_splits: programs sharing one tile's keys (split-KV); None chooses per batch with
    ``prefill_num_splits``, which the remaining fields steer.
    """

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int = 8
    num_stages: int = 3
    num_splits: int | None = None
    # programs running at once: one per SM, as ~220 registers x 8 warps leave room for one
    concurrent_programs: int = H200_SMS
    min_keys_per_split: int = 256
    max_splits: int = 32
    # the merge's launch and the split kernel's tail, in key steps of one program (~30 ns each at
    # Dh 128 on the H200, the whole GPU busy): ~15 us, fitted to the measured split counts
    merge_overhead_keys: int = 500
    # warps of the split-KV launch; None: 4 up to Dh 128 (64 keys a step, two programs per SM), else
    # num_warps. Against 8 warps and 128 keys, over 27,339 keys (Llama-3.1-8B heads, one layer, H200):
    # 100-400 new queries 7-14% faster (150: 212 vs 242 us; 219: 287 vs 311), 64 queries 10% slower
    # (120 vs 110 us); kv-upload-h200-attention-rule-2026-12-01.json
    split_num_warps: int | None = None
    # pipeline stages of the split-KV launch; None: num_stages
    split_num_stages: int | None = None
    # the page ids of the wholly visible blocks are loaded two blocks ahead (``_attend_keys``), so
    # that the pipeliner issues their K/V gathers num_stages - 1 blocks ahead; in the direct launch
    # (``prefetch_pages``) and in the split-KV one (``split_prefetch_pages``). H200, bf16, one layer
    # under a CUDA graph (benchmarks/results/attention-pipeline-h200-2026-12-02.md): direct, fresh
    # 2,340-token prompts 198.6 -> 162.6 us (Llama-3.1-8B heads) and 191.4 -> 161.2 (Qwen3-30B-A3B),
    # 1,024 new tokens over 32,000 cached 1,796 -> 1,251. Split-KV, the next turn over 27k keys: at
    # 64-key blocks and 3 stages 2x slower (a third 32 KB K/V buffer leaves one 4-warp program per SM,
    # and two programs hiding each other's softmax were worth more than the deeper pipeline), at
    # 32-key blocks and 4 stages 2-5% slower than the ids beside (224 / 304 / 425 us against
    # 220 / 295 / 404): it stays off there
    # (QML_ATTENTION_PREFETCH=0 turns the direct launch's off, for A/B in the engine)
    prefetch_pages: bool = os.environ.get("QML_ATTENTION_PREFETCH", "1") != "0"
    split_prefetch_pages: bool = False

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"PagedPrefillAttentionConfig.{name} must be a power of 2 >= 16 (tl.dot), got {value}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"PagedPrefillAttentionConfig.num_splits must be >= 1, got {self.num_splits}")
        warps = 1 if self.split_num_warps is None else self.split_num_warps
        stages = 1 if self.split_num_stages is None else self.split_num_stages
        if min(self.max_splits, self.min_keys_per_split, self.concurrent_programs, warps, stages) < 1 \
                or self.merge_overhead_keys < 0:
            raise ValueError("PagedPrefillAttentionConfig: max_splits, min_keys_per_split, concurrent_programs, "
                             "split_num_warps and split_num_stages must be >= 1, merge_overhead_keys >= 0")

    def split_warps(self, head_dim: int) -> int:
        """Warps of the split-KV launch."""
        return self.split_num_warps or (4 if head_dim <= 128 else self.num_warps)

    def split_concurrent_programs(self, head_dim: int) -> int:
        """Split-KV programs running at once: fewer warps a program leave room for more per SM."""
        return self.concurrent_programs * max(1, self.num_warps // self.split_warps(head_dim))

    def split_stages(self, head_dim: int) -> int:
        """Pipeline stages of the split-KV launch."""
        return self.split_num_stages or self.num_stages

    def tiles(self, head_dim: int, group: int) -> tuple[int, int]:
        """(BLOCK_M, BLOCK_N) for this head dim; BLOCK_M holds at least one token's query heads. The
        split-KV launch (a short chunk over a long band) takes the same tiles with fewer warps
        (``split_warps``; kv-upload-h200-attention-rule-2026-12-01.json)."""
        # the fp32 accumulator is BLOCK_M x Dh: 128 rows up to Dh 128, 64 rows at Dh 256 keep it
        # (and the Q tile) within the register file of 8 warps without spills
        block_m = self.block_m or (128 if head_dim <= 128 else 64)
        block_n = self.block_n or (32 if head_dim > 128 else 64)
        return max(block_m, triton.next_power_of_2(group)), block_n


def prefill_num_splits(programs: int, max_band: int, config: PagedPrefillAttentionConfig, head_dim: int = 128) -> int:
    """Splits of each tile's keys, from host values only: ``programs`` is the (tile, KV head) pairs
    that hold queries, ``max_band`` the most keys one tile sees.

    Time in key steps of one program: ``ceil(programs * s / concurrent)`` waves (``concurrent``: the
    config's ``concurrent_programs`` for s = 1, ``split_concurrent_programs(head_dim)`` above) of
    ``max_band / s`` keys, plus for s > 1 the merge: its fixed cost, and the workspace, whose
    ``BLOCK_M x Dh`` fp32 per program and split (written, then read) takes about as long at the
    card's bandwidth as one key step of the programs (4 BLOCK_M Dh FLOPs each) takes at its
    tensor-core rate, whatever BLOCK_M and Dh. Ties go to fewer splits; each split keeps at least
    ``min_keys_per_split`` keys."""
    if config.num_splits is not None:
        return config.num_splits
    programs = max(1, programs)

    def cost(splits: int, concurrent: int) -> int:
        waves = -(-programs * splits // concurrent)
        merge = 0 if splits == 1 else config.merge_overhead_keys + programs * splits
        return waves * -(-max_band // splits) + merge

    most = max(1, min(config.max_splits, max_band // config.min_keys_per_split))
    # whether to split at all: as if the split programs were the direct launch's, one per SM. Two
    # 4-warp programs sharing an SM each run at about half speed, so counting both as "at once"
    # would split fresh prompts whose tiles fill the GPU already (a 2,048-token one: 2 splits).
    if min(range(1, most + 1), key=lambda s: cost(s, config.concurrent_programs)) == 1:
        return 1
    # how many: the split launch's programs at once, as measured best (kv-upload-h200-attention-rule:
    # 219 queries over 27,339 keys 345 us at the count of one per SM, 287 at two per SM)
    concurrent = config.split_concurrent_programs(head_dim)
    return min(range(2, most + 1), key=lambda s: cost(s, concurrent))


@triton.jit
def _tanh(x):
    # from exp so that it runs in the interpreter and on every Triton version; saturates to +-1
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _slot_offsets(page, keys, stride_page, stride_slot, PAGE_SIZE: tl.constexpr):
    """Element offsets of key positions ``keys`` in the cache, given their pages' ids. int64: page *
    stride passes 2^31 elements in caches of a few GB."""
    return page.to(tl.int64) * stride_page + (keys % PAGE_SIZE) * stride_slot


@triton.jit
def tile_of(pid, cu_seqlens_q_ptr, num_seqs, TILE_TOKENS: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    """(sequence, its first query row, the tile's first token in it) of program ``pid`` of a grid whose
    sequence b's tiles start at program cu_seqlens_q[b] // TILE_TOKENS + b: the last b whose first tile
    is <= pid (those indices strictly increase with b, and sequence 0's is 0). So T // TILE_TOKENS + B
    programs cover every sequence's last tile; a program whose token lies past its sequence's queries
    has nothing to do."""
    count = 0
    for c in range(0, num_seqs, SEQ_CHUNK):
        b = c + tl.arange(0, SEQ_CHUNK)
        first_tile = tl.load(cu_seqlens_q_ptr + b, mask=b < num_seqs, other=0) // TILE_TOKENS + b
        count += tl.sum(((b < num_seqs) & (first_tile <= pid)).to(tl.int32), 0)
    seq = count - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    return seq, q_start, (pid - (q_start // TILE_TOKENS + seq)) * TILE_TOKENS


@triton.jit
def _attend_keys(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, L, window, pre_scale, post_scale,
                 stride_page, stride_slot, start, stop,
                 MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr = False):
    """Folds the keys of blocks [start, stop) into the running (acc, l_i, m_i) of the tile's rows.

    MASKED blocks cut the causal/window band (or run past L); the others are wholly visible to
    every row of the tile, so they skip the mask and the guards it needs.

    PREFETCH: the page ids of block j + 2 are loaded while block j is computed, and turned into
    slot offsets during block j + 1, so a block's K/V gather depends on no load of its own
    iteration. With the page ids loaded in the same iteration as the gather they address, Triton's
    pipeliner (3.6) put the id load one stage ahead and the gathers at distance 1: each block's K/V
    were issued at the end of the block before and waited for (``async_wait num=0``) right at the
    start of the next, so the load latency was exposed every block. With the ids carried in
    registers the gathers go ``num_stages - 1`` blocks ahead (``async_wait num=2`` at 3 stages)."""
    d = tl.arange(0, HEAD_DIM)
    kk = tl.arange(0, BLOCK_N)
    if PREFETCH:
        # ids past L (the band's end, or past the last block) are masked: the block table's row may end there
        first = start + kk
        slot_next = _slot_offsets(tl.load(bt_row + first // PAGE_SIZE, mask=first < L, other=0), first,
                                  stride_page, stride_slot, PAGE_SIZE)
        second = start + BLOCK_N + kk
        page_after = tl.load(bt_row + second // PAGE_SIZE, mask=second < L, other=0)
    for n0 in range(start, stop, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        keys = n0 + kk  # [BLOCK_N] positions
        if MASKED:
            key_ok = keys < L  # slots past L may hold another sequence's or no data (even NaN)
        if PREFETCH:
            slot = slot_next
            slot_next = _slot_offsets(page_after, n0 + BLOCK_N + kk, stride_page, stride_slot, PAGE_SIZE)
            ahead = n0 + 2 * BLOCK_N + kk
            page_after = tl.load(bt_row + ahead // PAGE_SIZE, mask=ahead < L, other=0)
        else:
            if MASKED:
                page = tl.load(bt_row + keys // PAGE_SIZE, mask=key_ok, other=0)
            else:
                page = tl.load(bt_row + keys // PAGE_SIZE)
            slot = _slot_offsets(page, keys, stride_page, stride_slot, PAGE_SIZE)  # [BLOCK_N]
        kv_offs = slot[:, None] + d[None, :]  # [BLOCK_N, Dh]
        if MASKED:
            k = tl.load(k_base + kv_offs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_base + kv_offs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_base + kv_offs)
            v = tl.load(v_base + kv_offs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pre_scale  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = post_scale * _tanh(s)  # the cap (in log2 units) comes before the mask
        if MASKED:
            visible = keys[None, :] <= q_pos[:, None]
            if HAS_WINDOW:
                visible = visible & (keys[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        if MASKED:
            # a row that has seen no visible key yet keeps m = -inf; shift by 0 so that
            # exp2(-inf - -inf) does not make NaN
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new
        p = tl.exp2(s - m_new_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_new_safe)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sinks_ptr, part_o_ptr, part_lse_ptr,
    block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr,
    num_seqs, num_heads, num_splits, pre_scale, post_scale, window,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_page, stride_slot, stride_head, stride_bt,
    GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_CHUNK: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # grid: (query tiles over the batch, KV heads, splits of each tile's keys); DIRECT: one split,
    # which writes out itself (part_* and num_splits unused)
    pdl.enter(PDL)
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq, q_start, t0 = tile_of(pid, cu_seqlens_q_ptr, num_seqs, TILE_TOKENS, SEQ_CHUNK)
    n_q = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    L = tl.load(context_lens_ptr + seq)
    if t0 >= n_q:
        return

    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP  # [BLOCK_M] query token within the sequence
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M] query head
    row_ok = (rows < TILE_TOKENS * GROUP) & (tok < n_q)
    q_pos = L - n_q + tok  # [BLOCK_M] position of each row's token
    d = tl.arange(0, HEAD_DIM)
    q_row = (q_start + tok).to(tl.int64) * stride_q_t + head * stride_q_h  # [BLOCK_M]
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, Dh]

    # the tile's key range, split into [lo, full_lo) masked, [full_lo, full_hi) wholly visible to
    # every row, [full_hi, hi) masked (the diagonal)
    pos_lo = L - n_q + t0
    pos_hi = L - n_q + tl.minimum(t0 + TILE_TOKENS, n_q) - 1
    hi = pos_hi + 1
    full_hi = (pos_lo + 1) // BLOCK_N * BLOCK_N
    if HAS_WINDOW:
        lo = tl.maximum(pos_lo - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pos_hi - window + 1, 0), BLOCK_N) * BLOCK_N
    else:
        lo = 0
        full_lo = 0
    # a window narrower than the tile leaves no wholly visible block: everything is masked (the
    # loops starting at hi are then empty, so hi need not be a multiple of BLOCK_N)
    no_full = full_lo >= full_hi
    full_lo = tl.where(no_full, hi, full_lo)
    full_hi = tl.where(no_full, hi, full_hi)
    if DIRECT:
        run_lo = lo
        run_hi = hi
    else:
        # this split's run [run_lo, run_hi) of whole blocks of the band: splits differ by at most
        # one block; a band of fewer blocks than splits leaves some runs empty
        n_blocks = tl.cdiv(hi - lo, BLOCK_N)
        run_lo = lo + split * n_blocks // num_splits * BLOCK_N
        run_hi = tl.minimum(lo + (split + 1) * n_blocks // num_splits * BLOCK_N, hi)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head * stride_head
    v_base = v_cache_ptr + kv_head * stride_head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # the band's three parts cut to the run (lo <= run_lo and run_hi <= hi; a part that starts at
    # an unaligned hi is empty)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, L, window,
                                 pre_scale, post_scale, stride_page, stride_slot,
                                 run_lo, tl.minimum(full_lo, run_hi),
                                 True, HAS_WINDOW, HAS_SOFTCAP, PAGE_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, L, window,
                                 pre_scale, post_scale, stride_page, stride_slot,
                                 tl.maximum(full_lo, run_lo), tl.minimum(full_hi, run_hi),
                                 False, HAS_WINDOW, HAS_SOFTCAP, PAGE_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION,
                                 PREFETCH)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, k_base, v_base, bt_row, L, window,
                                 pre_scale, post_scale, stride_page, stride_slot,
                                 tl.maximum(full_hi, run_lo), run_hi,
                                 True, HAS_WINDOW, HAS_SOFTCAP, PAGE_SIZE, BLOCK_N, HEAD_DIM, DOT_PRECISION)

    if DIRECT:
        if HAS_SINKS:
            # the sink is a logit with no value: it only adds to the denominator
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
            l_i += tl.exp2(sink * 1.4426950408889634 - m_i)
        # rows outside the tile (padding) may have l = 0; they are not stored
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_row = (q_start + tok).to(tl.int64) * stride_o_t + head * stride_o_h
        tl.store(out_ptr + o_row[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        # l >= 1 once a row has seen a key (its max term is 2^0) and 0 if it saw none in this run:
        # the floor makes that row's lse -inf (weight 0 in the merge, which then skips its o, so
        # that o is not stored) without 0 / 0; the sink joins in the merge, once
        seen = l_i > 0.0
        l_i = tl.maximum(l_i, 1.0)
        part = ((q_start + tok).to(tl.int64) * num_heads + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=(row_ok & seen)[:, None])


def _check_metadata(meta: AttentionMetadata, T: int, device: torch.device) -> None:
    B = meta.num_seqs
    assert len(meta.cu_seqlens_q_host) == B + 1, "cu_seqlens_q_host must have num_seqs + 1 entries"
    assert meta.cu_seqlens_q_host[-1] == T, f"cu_seqlens_q ends at {meta.cu_seqlens_q_host[-1]}, q has {T} rows"
    assert meta.block_tables.dim() == 2 and meta.block_tables.shape[0] == B, \
        f"block_tables must be [B={B}, pages], got {tuple(meta.block_tables.shape)}"
    for name, t in (("block_tables", meta.block_tables), ("cu_seqlens_q", meta.cu_seqlens_q),
                    ("context_lens", meta.context_lens)):
        assert t.dtype == torch.int32, f"meta.{name} must be int32, got {t.dtype}"
        assert t.device == device, f"meta.{name} is on {t.device}, q on {device}"
        assert t.stride(-1) == 1, f"meta.{name}: the last dimension must be contiguous"
    for b, L in enumerate(meta.context_lens_host):
        n_q = meta.cu_seqlens_q_host[b + 1] - meta.cu_seqlens_q_host[b]
        assert 0 <= n_q <= L, f"sequence {b}: {n_q} queries but context_len {L} (need 0 <= n_q <= L)"


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    config: PagedPrefillAttentionConfig = PagedPrefillAttentionConfig(),
) -> torch.Tensor:
    """q: [T, H, Dh]; k_cache, v_cache: [P, S, Hkv, Dh]; sinks: [H] or None -> out [T, H, Dh] in q.dtype.

    ``out`` may be any [T, H, Dh] view with a contiguous last dimension; it must not overlap q.
    Reads only the metadata's host lists on the host (no device synchronisation).
    """
    assert q.dim() == 3, f"q must be [T, H, Dh], got shape {tuple(q.shape)}"
    T, H, Dh = q.shape
    assert k_cache.dim() == 4, f"k_cache must be [P, S, Hkv, Dh], got shape {tuple(k_cache.shape)}"
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape[3] == Dh, f"k_cache head dim {k_cache.shape[3]} != q head dim {Dh}"
    assert v_cache.shape == k_cache.shape, f"v_cache shape {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}"
    assert v_cache.stride() == k_cache.stride(), "k_cache and v_cache must have the same strides"
    assert q.dtype in _FLOAT_DTYPES, f"q must be fp32, fp16 or bf16, got {q.dtype}"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, \
        f"caches must be in q's dtype {q.dtype}, got {k_cache.dtype}, {v_cache.dtype}"
    assert Hkv > 0 and H % Hkv == 0, f"H={H} must be a multiple of Hkv={Hkv}"
    assert 16 <= Dh <= 256 and Dh & (Dh - 1) == 0, f"head dim must be a power of 2 in [16, 256], got {Dh}"
    assert S & (S - 1) == 0, f"page size must be a power of 2, got {S}"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "q and the caches need a contiguous last dimension"
    _check_metadata(meta, T, q.device)
    for t in (k_cache, v_cache):
        assert t.device == q.device, f"caches on {t.device}, q on {q.device}"
    if sinks is not None:
        assert sinks.shape == (H,), f"sinks must be [H={H}], got {tuple(sinks.shape)}"
        assert sinks.is_floating_point() and sinks.device == q.device and sinks.stride(0) == 1, \
            "sinks must be a contiguous float tensor on q's device"
    assert sliding_window is None or sliding_window > 0, f"sliding_window must be positive, got {sliding_window}"
    assert softcap is None or softcap > 0, f"softcap must be positive, got {softcap}"
    if out is None:
        out = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    assert out.shape == (T, H, Dh) and out.dtype == q.dtype, \
        f"out: {tuple(out.shape)} {out.dtype}, expected {(T, H, Dh)} {q.dtype}"
    assert out.stride(-1) == 1 and out.device == q.device, "out needs a contiguous last dimension on q's device"
    B = meta.num_seqs
    if T == 0 or B == 0:
        return out

    tile_tokens = config.tiles(Dh, H // Hkv)[0] // (H // Hkv)
    cu = meta.cu_seqlens_q_host
    busy_tiles = sum((end - start + tile_tokens - 1) // tile_tokens for start, end in zip(cu, cu[1:]))
    max_len = max(meta.context_lens_host)
    # a tile's band: its first query's keys (at most W with a window) up to its last query
    max_band = max_len if sliding_window is None else min(max_len, sliding_window + tile_tokens - 1)
    splits = prefill_num_splits(busy_tiles * Hkv, max_band, config, Dh)
    constexprs = _constexprs(H, Hkv, Dh, S, q.dtype, sliding_window is not None, sinks is not None,
                             softcap is not None, config, direct=splits == 1)
    if softcap is None:
        pre_scale, post_scale = scale * LOG2E, 1.0
    else:
        pre_scale, post_scale = scale / softcap, softcap * LOG2E
    sinks_arg = sinks if sinks is not None else q  # a placeholder pointer, never read
    if splits == 1:
        part_o = part_lse = out  # unused: the kernel writes out itself
    else:
        # allocated per call from torch's caching allocator: cheap, and under CUDA graph capture it
        # comes from the graph's private pool, so replays reuse the same addresses
        part_o = torch.empty((T, H, splits, Dh), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    # sequence b's tiles start at program cu_seqlens_q[b] // TILE_TOKENS + b, so T // TILE_TOKENS + B
    # programs cover every sequence's last tile
    _paged_prefill_attention_kernel[(T // tile_tokens + B, Hkv, splits)](
        q, k_cache, v_cache, out, sinks_arg, part_o, part_lse,
        meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
        B, H, splits, pre_scale, post_scale, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        **constexprs, num_warps=config.num_warps if splits == 1 else config.split_warps(Dh),
        num_stages=config.num_stages if splits == 1 else config.split_stages(Dh), **pdl.launch_args(q),
    )
    if splits > 1:
        # decode's merge: its workspace layout [rows, H, splits, Dh] is this one with rows = tokens
        _paged_decode_attention_merge_kernel[(T, H)](
            part_o, part_lse, sinks_arg, out, part_lse, H, splits, 0, out.stride(0), out.stride(1),
            HEAD_DIM=Dh, BLOCK_D=Dh, BLOCK_SPLITS=triton.next_power_of_2(splits),
            HAS_SINKS=sinks is not None, ACTIVE_FROM_LENS=False, HAS_WINDOW=False, BLOCK_N=16,
            num_warps=4, **pdl.launch_args(q),
        )
    return out


def _constexprs(H: int, Hkv: int, Dh: int, S: int, dtype: torch.dtype, window: bool, sinks: bool, softcap: bool,
                config: PagedPrefillAttentionConfig, direct: bool = True) -> dict:
    """The kernel's compile-time parameters, as the launcher specialises it (``direct``: one split)."""
    group = H // Hkv
    block_m, block_n = config.tiles(Dh, group)
    return {"GROUP": group, "TILE_TOKENS": block_m // group, "HEAD_DIM": Dh, "PAGE_SIZE": S,
            "BLOCK_M": block_m, "BLOCK_N": block_n,
            "SEQ_CHUNK": 64,  # sequences scanned per step of the program -> sequence search
            "HAS_WINDOW": window, "HAS_SINKS": sinks, "HAS_SOFTCAP": softcap, "DIRECT": direct,
            # the wholly visible blocks' loop (all but a block or two per tile) gathers K/V ahead
            "PREFETCH": config.prefetch_pages if direct else config.split_prefetch_pages,
            # fp32 inputs would otherwise run as tf32 on the GPU (10-bit mantissa); half types ignore it
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


_STRIDES = ("stride_q_t", "stride_q_h", "stride_o_t", "stride_o_h", "stride_page", "stride_slot", "stride_head")
_SIGNATURE = {
    **{name: "*bf16" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")},
    "sinks_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "context_lens_ptr": "*i32",
    "num_seqs": "i32", "num_heads": "i32", "num_splits": "i32", "pre_scale": "fp32", "post_scale": "fp32",
    "window": "i32",
    **{name: "i32" for name in (*_STRIDES, "stride_bt")},
    **{name: "constexpr" for name in ("GROUP", "TILE_TOKENS", "HEAD_DIM", "PAGE_SIZE", "BLOCK_M", "BLOCK_N",
                                      "SEQ_CHUNK", "HAS_WINDOW", "HAS_SINKS", "HAS_SOFTCAP", "DIRECT",
                                      "DOT_PRECISION", "PREFETCH")},
}


def hopper_compile_request(H: int, Hkv: int, Dh: int, S: int = 16, window: bool = False, sinks: bool = False,
                           softcap: bool = False, direct: bool = True,
                           config: PagedPrefillAttentionConfig = PagedPrefillAttentionConfig()) -> dict:
    """``workbench.compile.compile_check``'s arguments for the bf16 kernel as the launcher specialises it
    (``direct``: one split, else the split-KV form writing the fp32 workspace); cache and q strides are
    multiples of 16 elements at model sizes, which a real launch tells the compiler."""
    return {"kernel": _paged_prefill_attention_kernel, "signature": _SIGNATURE,
            "constexprs": _constexprs(H, Hkv, Dh, S, torch.bfloat16, window, sinks, softcap, config, direct),
            "num_warps": config.num_warps if direct else config.split_warps(Dh),
            "num_stages": config.num_stages if direct else config.split_stages(Dh), "divisible": _STRIDES}


def _supported(q, k_cache, v_cache, meta, scale, sliding_window=None, sinks=None, softcap=None, out=None,
               **kwargs) -> bool:
    if q.dim() != 3 or k_cache.dim() != 4:
        return False
    Dh, S, Hkv = q.shape[2], k_cache.shape[1], k_cache.shape[2]
    return (q.dtype in _FLOAT_DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.shape[3] == Dh and 16 <= Dh <= 256 and Dh & (Dh - 1) == 0 and S & (S - 1) == 0
            and q.shape[1] % Hkv == 0 and v_cache.stride() == k_cache.stride()
            and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and (out is None or out.stride(-1) == 1))


register("paged_prefill_attention", "reference", paged_attention_ref)
register("paged_prefill_attention", "triton", paged_prefill_attention_triton, devices=("cuda",),
         supports=_supported)

paged_prefill_attention = dispatch("paged_prefill_attention")


# -- workbench ------------------------------------------------------------------------------

def _make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> dict:
    """A batch of sequences ``seqs = ((n_q, L), ...)`` in a paged cache whose unused slots hold NaN
    (a kernel that lets a masked key's value through, even times 0, fails)."""
    d = case.dims
    H, Hkv, Dh, S = d["H"], d["Hkv"], d["Dh"], d.get("S", 16)
    seqs = d["seqs"]
    T = sum(n_q for n_q, _ in seqs)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device).to(device=device, dtype=dtype)

    pages_per_seq = [-(-L // S) for _, L in seqs]
    P = sum(pages_per_seq) + 1  # one page no sequence owns
    order = torch.randperm(P, generator=gen, device=gen.device).tolist() if d.get("shuffle") else list(range(P))
    block_tables, slots, cu, at = [], [], [0], 0
    for (n_q, L), n_pages in zip(seqs, pages_per_seq):
        pages = order[at: at + n_pages]
        at += n_pages
        block_tables.append(pages)
        slots += [pages[p // S] * S + p % S for p in range(L - n_q, L)]
        cu.append(cu[-1] + n_q)
    meta = AttentionMetadata.build(slots, block_tables, cu, [L for _, L in seqs], device)
    k_cache, v_cache = randn(P, S, Hkv, Dh), randn(P, S, Hkv, Dh)
    for cache in (k_cache, v_cache):
        cache[order[-1]] = float("nan")
        for (_, L), pages in zip(seqs, block_tables):
            cache[pages[-1], (L - 1) % S + 1:] = float("nan")  # the last page's unused slots
    if d.get("fused_q"):
        # q as the engine sees it: a view into the [T, (H + 2 Hkv) Dh] QKV projection
        q = randn(T, (H + 2 * Hkv) * Dh)[:, : H * Dh].view(T, H, Dh)
    else:
        q = randn(T, H, Dh)
    sinks = (2 * torch.randn(H, generator=gen, device=gen.device)).to(device) if d.get("sinks") else None
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "meta": meta, "scale": 1.0 / math.sqrt(Dh),
            "sliding_window": d.get("window"), "sinks": sinks, "softcap": d.get("softcap")}


def _keys_in_band(n_q: int, L: int, window: int | None) -> int:
    """Distinct keys the queries of one sequence see: its K/V traffic."""
    return L if window is None else L - max(0, L - n_q - window + 1)


def _visible_pairs(n_q: int, L: int, window: int | None) -> int:
    """(query, key) pairs with the key visible: sum over positions p of min(p + 1, W)."""
    first = L - n_q  # position of the first query; position p sees p + 1 keys without a window
    full = n_q * (first + 1) + n_q * (n_q - 1) // 2
    if window is None or window >= L:
        return full
    capped = max(0, L - max(first, window - 1))  # positions p >= W - 1 see exactly W keys
    below = n_q - capped
    return below * (first + 1) + below * (below - 1) // 2 + capped * window


def _seq_shapes(inputs: dict) -> list[tuple[int, int]]:
    meta = inputs["meta"]
    cu = meta.cu_seqlens_q_host
    return [(cu[b + 1] - cu[b], L) for b, L in enumerate(meta.context_lens_host)]


def _bytes(inputs: dict) -> int:
    q, k_cache = inputs["q"], inputs["k_cache"]
    T, H, Dh = q.shape
    Hkv = k_cache.shape[2]
    keys = sum(_keys_in_band(n_q, L, inputs["sliding_window"]) for n_q, L in _seq_shapes(inputs))
    # K and V of the band once, q read and out written once (block tables are noise)
    return (2 * keys * Hkv * Dh + 2 * T * H * Dh) * q.element_size()


def _flops(inputs: dict) -> int:
    _, H, Dh = inputs["q"].shape
    pairs = sum(_visible_pairs(n_q, L, inputs["sliding_window"]) for n_q, L in _seq_shapes(inputs))
    return 4 * pairs * H * Dh  # q.k and p.v: 2 FLOPs per multiply-add each


SMALL_CASES = (
    Case("one-token-context", {"seqs": ((1, 1),), "H": 2, "Hkv": 1, "Dh": 64},
         edge="1-token context: a single key, the rest of the page NaN"),
    Case("exactly-a-page", {"seqs": ((16, 16),), "H": 4, "Hkv": 1, "Dh": 64},
         edge="context exactly one page, GQA group 4"),
    Case("page-plus-one", {"seqs": ((17, 17),), "H": 8, "Hkv": 1, "Dh": 128},
         edge="a page + 1 token, head dim 128, GQA group 8"),
    Case("prefix-hit-many-pages", {"seqs": ((24, 100),), "H": 2, "Hkv": 2, "Dh": 64, "shuffle": True},
         edge="queries start at 76 (prefix-cache hit), 7 pages in shuffled order, group 1"),
    Case("ragged-mixed", {"seqs": ((1, 50), (30, 30), (5, 77), (1, 1), (12, 40), (0, 9)),
                          "H": 8, "Hkv": 2, "Dh": 64, "shuffle": True},
         edge="ragged batch: decode rows, a prefill, chunks, a sequence with no queries"),
    Case("window-smaller", {"seqs": ((48, 48), (10, 70)), "H": 4, "Hkv": 1, "Dh": 64, "window": 8},
         edge="window 8 smaller than the context and than a tile"),
    Case("window-larger", {"seqs": ((20, 30),), "H": 4, "Hkv": 2, "Dh": 64, "window": 100},
         edge="window larger than the context (no key dropped)"),
    Case("gpt-oss-sinks", {"seqs": ((24, 40), (1, 33)), "H": 16, "Hkv": 2, "Dh": 64, "window": 16,
                           "sinks": True, "shuffle": True},
         edge="gpt-oss layer: sinks + window 16, group 8, a decode row"),
    Case("sinks-full", {"seqs": ((9, 21),), "H": 4, "Hkv": 4, "Dh": 32, "sinks": True},
         edge="sinks without a window (gpt-oss full-attention layers), head dim 32"),
    Case("softcap-dh256", {"seqs": ((20, 20), (3, 35)), "H": 2, "Hkv": 1, "Dh": 256, "softcap": 5.0},
         edge="tanh soft-cap 5, head dim 256 (Gemma)"),
    Case("group-16", {"seqs": ((10, 26),), "H": 16, "Hkv": 1, "Dh": 64},
         edge="GQA group 16: 16 query heads in every token's rows"),
    Case("group-3-fused-q", {"seqs": ((13, 13), (6, 20)), "H": 6, "Hkv": 2, "Dh": 64, "fused_q": True},
         edge="non-power-of-2 group 3 (rows left unused), q a strided view of a fused QKV row"),
    Case("page-32", {"seqs": ((40, 70),), "H": 2, "Hkv": 1, "Dh": 64, "S": 32, "shuffle": True},
         edge="page size 32, chunk starting mid-page"),
    Case("page-64", {"seqs": ((70, 130), (1, 64)), "H": 4, "Hkv": 2, "Dh": 64, "S": 64, "shuffle": True},
         edge="page size 64: a context of exactly one page, queries crossing pages"),
    Case("few-queries-long-context", {"seqs": ((3, 600), (1, 530)), "H": 4, "Hkv": 1, "Dh": 64, "sinks": True,
                                      "shuffle": True},
         edge="a short chunk and a decode row over long contexts: the default config splits the keys "
              "(merge stage, sinks added in the merge)"),
)


def _model_cases() -> tuple[Case, ...]:
    cases = []
    models = (("llama3.1-8b", {"H": 32, "Hkv": 8, "Dh": 128, "fused_q": True}),
              ("qwen3-30b-a3b", {"H": 32, "Hkv": 4, "Dh": 128}))
    shapes = (
        ("T128", ((128, 128),), "prefill 128"),
        ("T8192", ((8192, 8192),), "prefill 8192"),
        ("chunk2048-ctx8192", ((2048, 8192),), "chunked prefill: the last 2048 of 8192"),
        ("prefix-hit-512-ctx32k", ((512, 32768),), "512 new tokens after a 32k prefix-cache hit"),
        ("mixed-1chunk-63decode", ((512, 2048),) + ((1, 4096),) * 63, "mixed: one chunk + 63 decode rows"),
        ("batch8-T1024", ((1024, 1024),) * 8, "8 prefills of 1024"),
        # the next turn of a conversation: a short chunk over a long cached context (split-KV)
        ("turn216-ctx28000", ((216, 28000),), "216 new tokens over 28,000 (next turn of a long chat)"),
        ("turn133-ctx8000", ((133, 8000),), "133 new tokens over 8,000"),
        ("chunk1024-ctx32000", ((1024, 32000),), "1024 new tokens over 32,000"),
    )
    for model, dims in models:
        for tag, seqs, what in shapes:
            cases.append(Case(f"{model}-{tag}", {**dims, "seqs": seqs, "S": 16, "shuffle": True},
                              edge=f"{model}: {what}"))
    gpt_oss = {"H": 64, "Hkv": 8, "Dh": 64, "sinks": True, "S": 16, "shuffle": True}
    for tag, window in (("sliding", 128), ("full", None)):
        cases.append(Case(f"gpt-oss-20b-{tag}-T8192", {**gpt_oss, "window": window, "seqs": ((8192, 8192),)},
                          edge=f"gpt-oss-20b {tag} layer (sinks), prefill 8192"))
        cases.append(Case(f"gpt-oss-20b-{tag}-chunk2048-ctx8192",
                          {**gpt_oss, "window": window, "seqs": ((2048, 8192),)},
                          edge=f"gpt-oss-20b {tag} layer (sinks), chunked prefill"))
    return tuple(cases)


PAGED_PREFILL_ATTENTION_SPEC = register_spec(OpSpec(
    op="paged_prefill_attention",
    reference=paged_attention_ref,
    make_inputs=_make_inputs,
    cases=SMALL_CASES,
    model_cases=_model_cases(),
    bytes_moved=_bytes,
    flops=_flops,
    out_arg="out",
    launch_config=PagedPrefillAttentionConfig,
    notes="queries are each sequence's last n_q tokens; the caches' unused slots hold NaN",
))
