"""Long prefill chunks through cuDNN's paged SDPA: chunks of 512 queries or more over a cached history, read
from our pages in place, one launch a sequence.

Why: such a chunk (a prompt's second step, a long new turn after a prefix hit, the blocks a restore left to
compute) is neither a fresh prompt (``attention_cudnn``: torch's SDPA over K/V gathered from the pages) nor a turn
(``attention_turn``, up to 512 queries): it ran Triton's paged prefill kernel, which reaches ~60% of cuDNN's rate.
One layer of Llama-3.1-8B (32 q / 8 kv heads, Dh 128, bf16) on an H100 (``benchmarks/chunk_attention_h200.py``,
``results/chunk-attention-h100-2026-12-06.md``): 6,784 queries over 21,504 cached keys 6.54 ms on Triton, 4.73 on
cuDNN's paged SDPA; 2,048 over 4,096: 0.58 vs 0.39; 512 over 21,504: 0.56 vs 0.42; two sequences (1,000 over
8,192 and a fresh 3,000) 0.74 vs 0.49 (``results/cudnn-chunk-h100-2026-12-06.md``).

Which steps: every sequence brings at least ``MIN_QUERIES`` (fewer leave SMs idle: n / 128 tiles x H programs;
600 over 27,000 took 0.85 ms on both paths). Long fresh prompts stay with ``attention_cudnn`` (registered before
this path): 27,648 tokens took 10.61 ms there and 11.13 here; at 6,784 this path was faster (0.74 against 0.86).
Steps captured into CUDA graphs never come here (their lengths change on the device between replays); up to 512
queries over a long history go to ``attention_turn``.

How: cudnn-frontend's SDPA with the pool as its paged K/V containers (``[pages, Hkv, page, D]`` by strides: the
same bytes), a block table per sequence, the lengths per sequence (padding mask), and the causal mask aligned
bottom-right: query i of a sequence with n queries and L keys sees keys up to ``L - n + i``, as in
``paged_attention_ref``. q and out are ragged (THD): the batch's packed rows, each sequence's first row given by an
offset table in elements, so rows are read and written in place whatever their token stride (a fused qkv
projection's views included), and a graph's row count is only a bound.

Shapes: a cuDNN graph is built per (sequences, row bound, pool, heads, strides, dtype, scale), at 50-115 ms a build
on the H100 (``results/cudnn-chunk-h100-2026-12-06.md``). A step launches each sequence on the one-sequence graph of
its row bound, so that no count of sequences or mix of bounds is a new shape to build on a served step, stalling
every stream (``together``, one launch for the step, stays for benchmarks: 9-18% faster on two or three sequences
with a fresh prompt among them, 8% slower on two similar ones, ``results/chunk-launches-h100-2026-12-06.md``). The
row bound is a power of two from ``2 * MIN_QUERIES``, and every table is as wide as the pool (a page can be anywhere in
it), so that a process builds a handful: bounds above the step's lengths cost nothing measurable there (16,400
queries over 16,000 keys 11.34 ms at 32,768 rows, 12.31 at 16,512; 6,784 over 21,504 4.73 ms with a 65,536-page
table, 4.75 with 2,048).
``qml_runtime.warmup`` runs the common ones before the first request; another is built when a step first needs it.

What the step's layers share, filled at its first layer: the block tables in a pool-wide table's first columns,
the lengths, the row offsets, and the slots past each sequence's length on its last page, which every layer zeroes
before its launch (``_Tails``: cuDNN multiplies their values by zero, and a NaN left there would spread).
"""

from __future__ import annotations

import os

import torch

from qml_kernels.attention import AttentionMetadata, host_to_device
from qml_kernels.cudnn_frontend import build, execute, paged_graph
from qml_kernels.cudnn_frontend import module as _cudnn

MIN_QUERIES = 512  # fewer queries per sequence leave SMs idle here (n/128 tiles x H programs): Triton's split-KV
ENABLED = os.environ.get("QML_CUDNN_CHUNK", "1") != "0"


def available() -> bool:
    """Whether this path may serve steps in this process (on, and cudnn-frontend importable)."""
    return ENABLED and _cudnn() is not None


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def row_bound(n_max: int) -> int:
    """The graph's rows per sequence for a step whose longest sequence brings ``n_max`` queries. The smallest is
    ``2 * MIN_QUERIES``: a chunk of exactly 512 queries (32 blocks, as a cut restore computes) shares the 1,024
    graph the warm-up builds instead of building its own on a served step (a bound above the lengths costs
    nothing measurable, above)."""
    return _pow2_at_least(n_max, 2 * MIN_QUERIES)


class _Buffers:
    """A launch's per-step operands: table ``[B, 1, pages, 1]`` (the step's tables in its first columns), lengths
    ``[B, 1, 1, 1]`` (int32), row offsets ``[B + 1, 1, 1, 1]`` in elements of q and of out (int64)."""

    def __init__(self, device, B: int, max_pages: int):
        self.table = torch.zeros(B, 1, max_pages, 1, dtype=torch.int32, device=device)
        self.seq_q = torch.zeros(B, 1, 1, 1, dtype=torch.int32, device=device)
        self.seq_kv = torch.zeros(B, 1, 1, 1, dtype=torch.int32, device=device)
        self.q_offsets = torch.zeros(B + 1, 1, 1, 1, dtype=torch.int64, device=device)
        self.o_offsets = torch.zeros(B + 1, 1, 1, 1, dtype=torch.int64, device=device)
        self._more: list[_Buffers] = []

    def nth(self, j: int) -> _Buffers:
        """The operands of a step's j-th launch of this shape (0: these), made once and kept: a step's launches
        run one after another on one stream, and its operands are filled at its first layer."""
        while len(self._more) < j:
            self._more.append(_Buffers(self.table.device, self.seq_q.shape[0], self.table.shape[2]))
        return self if j == 0 else self._more[j - 1]


class _Graph(_Buffers):
    """cuDNN's paged SDPA for one launch shape: ragged q/out over the pool's pages, causal bottom-right."""

    def __init__(self, cudnn, device, dtype, B: int, H: int, R: int, D: int, q_token_stride: int,
                 o_token_stride: int, pool_shape, pool_strides, max_pages: int, scale: float):
        super().__init__(device, B, max_pages)
        self.handle, g, io, t = paged_graph(cudnn, dtype, pool_shape, pool_strides,
                                            {"table": self.table, "seq_q": self.seq_q, "seq_kv": self.seq_kv,
                                             "q_off": self.q_offsets, "o_off": self.o_offsets})
        # rows: (sequence, head, token, dim); the batch stride is never stepped under ragged offsets
        q_dims, q_strides = [B, H, R, D], [R * q_token_stride, D, q_token_stride, 1]
        o_strides = [R * o_token_stride, D, o_token_stride, 1]
        t["q"] = g.tensor(name="q", dim=q_dims, stride=q_strides, data_type=io, ragged_offset=t["q_off"])
        o, _ = g.sdpa(name="chunk", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=False,
                      diagonal_band_right_bound=0, diagonal_alignment=cudnn.diagonal_alignment.BOTTOM_RIGHT,
                      use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
                      paged_attention_k_table=t["table"], paged_attention_v_table=t["table"],
                      paged_attention_max_seq_len_kv=max_pages * pool_shape[1])
        o.set_output(True).set_dim(q_dims).set_stride(o_strides).set_data_type(io).set_ragged_offset(t["o_off"])
        self.workspace = build(cudnn, g, device)
        self.graph, self.tensors, self.out, self.cudnn = g, t, o, cudnn

    def run(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            ops: _Buffers | None = None) -> None:
        """One launch on ``ops`` (this graph's own operands unless given: another set from ``nth``)."""
        t, ops = self.tensors, ops or self
        execute(self.cudnn, self.handle, self.graph,
                {t["q"]: q, t["k"]: k_cache, t["v"]: v_cache, t["table"]: ops.table, t["seq_q"]: ops.seq_q,
                 t["seq_kv"]: ops.seq_kv, t["q_off"]: ops.q_offsets, t["o_off"]: ops.o_offsets, self.out: out},
                self.workspace)


_GRAPHS: dict[tuple, _Graph | None] = {}  # launch shape -> built graph (None: cuDNN declined it)
DECLINED: dict[tuple, str] = {}  # launch shape -> why cuDNN declined it


def launch_shapes(q, k_cache, meta: AttentionMetadata, rows: int | None = None, max_pages: int | None = None,
                  together: bool = False) -> list[tuple[int, int, int]]:
    """(sequences, row bound, table width) of each of this step's launches, from host values only: one launch a
    sequence, or with ``together`` one for the whole step. The table is as wide as the pool unless ``max_pages``
    says otherwise, the row bound ``rows`` or the power of two above the sequence's queries (benchmarks set them)."""
    pages = max_pages or k_cache.shape[0]
    if together:
        return [(meta.num_seqs, rows or row_bound(meta.max_q_len), pages)]
    cu = meta.cu_seqlens_q_host
    return [(1, rows or row_bound(b - a), pages) for a, b in zip(cu, cu[1:])]


def _graph_for(q, k_cache, o_token_stride: int, shape: tuple[int, int, int], scale) -> tuple[_Graph | None, str]:
    """The built graph for this launch shape (built now if new), or None and why cuDNN declined it."""
    B, R, pages = shape
    H, D, Hkv = q.shape[1], q.shape[2], k_cache.shape[2]
    key = (q.device.index, q.dtype, B, H, Hkv, R, D, q.stride(0), o_token_stride, tuple(k_cache.shape),
           tuple(k_cache.stride()), pages, float(scale))
    if key not in _GRAPHS:
        try:
            _GRAPHS[key] = _Graph(_cudnn(), q.device, q.dtype, B, H, R, D, q.stride(0), o_token_stride,
                                  tuple(k_cache.shape), tuple(k_cache.stride()), pages, scale)
        except Exception as e:  # noqa: BLE001 - cuDNN declines the shape: Triton serves it
            _GRAPHS[key], DECLINED[key] = None, f"{type(e).__name__}: {e}"
    return _GRAPHS[key], DECLINED.get(key, "")


def fill(buffers: _Buffers, meta: AttentionMetadata, q_token_stride: int, o_token_stride: int,
         seq: int | None = None) -> None:
    """The step's table, lengths and row offsets into the launch's buffers (device copies, no host wait): every
    sequence's, or sequence ``seq``'s alone (a launch of its own, its rows from q's and out's first)."""
    rows = slice(None) if seq is None else slice(seq, seq + 1)
    cu = meta.cu_seqlens_q if seq is None else meta.cu_seqlens_q[seq:seq + 2] - meta.cu_seqlens_q[seq]
    bt = meta.block_tables[rows]
    buffers.table[:, 0, :bt.shape[1], 0] = bt
    buffers.seq_q.view(-1).copy_(cu[1:] - cu[:-1])
    buffers.seq_kv.view(-1).copy_(meta.context_lens[rows])
    buffers.q_offsets.view(-1).copy_(cu * q_token_stride)
    buffers.o_offsets.view(-1).copy_(cu * o_token_stride)


class _Tails:
    """The slots past each sequence's length on its last page, as (page, slot) index tensors on the device.

    cuDNN reads a sequence's last page whole and masks the slots past its length in the softmax, so their values
    still enter the product with V, times zero: a non-finite value left there by an earlier owner of the page would
    turn every row of the sequence into NaN (seen on the H100 with NaN in those slots). Each layer therefore zeroes
    them first. Only this sequence owns them: a partly filled page has no name, so it is never shared, and the
    sequence's next tokens write there anyway."""

    def __init__(self, meta: AttentionMetadata, page: int):
        rows, cols, slots = [], [], []
        for b, L in enumerate(meta.context_lens_host):
            for slot in range(L % page, page if L % page else 0):
                rows.append(b)
                cols.append((L - 1) // page)
                slots.append(slot)
        self.empty = not rows
        if not self.empty:
            dev = meta.block_tables.device
            index = host_to_device(torch.tensor([rows, cols, slots], dtype=torch.int64), dev)
            self.pages = meta.block_tables[index[0], index[1]].long()
            self.slots = index[2]

    def zero(self, *caches: torch.Tensor) -> None:
        if not self.empty:
            for cache in caches:
                cache[self.pages, self.slots] = 0


def serves(q, k_cache, v_cache, meta: AttentionMetadata, sliding_window=None, sinks=None, softcap=None,
           out=None) -> bool:
    """The rules on shapes, dtypes, layouts and lengths (host values only), whatever the device."""
    if not (q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.stride() == v_cache.stride() and sliding_window is None and sinks is None and softcap is None):
        return False
    H, D = q.shape[1], q.shape[2]
    # (a sequence's rows start where it does in q and out: token strides of whole 16 bytes keep them aligned)
    if H % k_cache.shape[2] or D % 8 or D > 128 or q.stride(2) != 1 or q.stride(1) != D or q.stride(0) % 8:
        return False
    if out is not None and (out.stride(2) != 1 or out.stride(1) != D or out.stride(0) % 8):
        return False
    cu = meta.cu_seqlens_q_host
    return min(b - a for a, b in zip(cu, cu[1:])) >= MIN_QUERIES


def supported(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, sinks=None,
              softcap=None, out=None) -> bool:
    if not (ENABLED and q.is_cuda and serves(q, k_cache, v_cache, meta, sliding_window, sinks, softcap, out)):
        return False
    if torch.cuda.is_current_stream_capturing() or not available():
        return False
    # (chunk_attention's own out is packed: H * D a token)
    o_token_stride = q.shape[1] * q.shape[2] if out is None else out.stride(0)
    return all(_graph_for(q, k_cache, o_token_stride, shape, scale)[0] is not None
               for shape in set(launch_shapes(q, k_cache, meta)))


def chunk_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, sinks=None,
                    softcap=None, out=None, rows: int | None = None, max_pages: int | None = None,
                    together: bool = False, executor=None) -> torch.Tensor:
    """q: [T, H, Dh] (each sequence's rows in order, at least ``MIN_QUERIES`` each); caches [P, S, Hkv, Dh] ->
    out [T, H, Dh]. One launch a sequence, each with the graph of one sequence at its row bound: a step of
    several sequences builds no graph of its own (75-85 ms on an H100, on the served step that first met its
    count of sequences and bound), and a launch of 512+ queries is long enough that one more costs little.
    ``together``: one launch for the step (benchmarks). ``rows`` / ``max_pages``: the graphs' bounds, when not
    the defaults (benchmarks).
    ``executor``: what runs a launch on its buffers (cuDNN unless given; tests pass ``ChunkReference``)."""
    assert sliding_window is None and sinks is None and softcap is None
    out = q.new_empty(q.shape) if out is None else out
    # the step's tables, lengths and offsets are filled once, at its first layer (later layers reuse them)
    key = ("chunk", tuple(q.shape), q.stride(0), out.stride(0), q.dtype, tuple(k_cache.shape), float(scale), rows,
           max_pages, together)
    launches, tails = meta.plans.get(key, (None, None))
    if launches is None:
        launches = []
        cu = meta.cu_seqlens_q_host
        for i, shape in enumerate(launch_shapes(q, k_cache, meta, rows, max_pages, together)):
            if executor is not None:
                graph = executor.graph_for(q, k_cache, shape)
            else:
                graph, why = _graph_for(q, k_cache, out.stride(0), shape, scale)
                if graph is None:
                    raise RuntimeError(f"cuDNN declined this chunk's attention: {why}")
            # (two sequences of one bound: two sets of operands for its graph)
            ops = graph.nth(sum(g is graph for g, _, _ in launches))
            fill(ops, meta, q.stride(0), out.stride(0), None if together else i)
            launches.append((graph, ops, slice(None) if together else slice(cu[i], cu[i + 1])))
        tails = _Tails(meta, k_cache.shape[1])
        meta.plans[key] = launches, tails
    tails.zero(k_cache, v_cache)
    for graph, ops, rows_of in launches:
        if executor is None:
            graph.run(q[rows_of], out[rows_of], k_cache, v_cache, ops)
        else:
            executor(ops, q[rows_of], out[rows_of], k_cache, v_cache, scale)
    return out


class ChunkReference:
    """What the launch computes, in fp32 torch from the launch's own buffers (row offsets, lengths, table) and
    cuDNN's masks as documented (padding by lengths, causal aligned bottom-right): the check of ``fill`` and of the
    offsets' units on machines without cuDNN; the GPU tests hold cuDNN to the same reference."""

    def graph_for(self, q, k_cache, shape: tuple[int, int, int]) -> _Buffers:
        B, _, pages = shape
        return _Buffers(q.device, B, pages)

    def __call__(self, g: _Buffers, q, out, k_cache, v_cache, scale: float) -> None:
        S, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        G = q.shape[1] // Hkv
        for b in range(g.seq_q.shape[0]):
            n, L = int(g.seq_q[b]), int(g.seq_kv[b])
            q0, o0 = int(g.q_offsets[b]) // q.stride(0), int(g.o_offsets[b]) // out.stride(0)
            pages = g.table[b, 0, :-(-L // S), 0].long()
            # whole pages, as cuDNN reads them: the slots past L are masked, and their values multiplied by zero
            k = k_cache[pages].reshape(-1, Hkv, D).float().repeat_interleave(G, 1)  # [pages * S, H, D]
            v = v_cache[pages].reshape(-1, Hkv, D).float().repeat_interleave(G, 1)
            s = torch.einsum("nhd,khd->hnk", q[q0:q0 + n].float(), k) * scale
            keys = torch.arange(k.shape[0])
            visible = keys[None, :] <= (L - n + torch.arange(n))[:, None]  # [n, keys]: bottom-right, and < L
            p = torch.softmax(s.masked_fill(~visible.to(s.device), float("-inf")), -1)
            out[o0:o0 + n] = torch.einsum("hnk,khd->nhd", p, v).to(out.dtype)


__all__ = ["MIN_QUERIES", "ChunkReference", "available", "chunk_attention", "fill", "launch_shapes", "row_bound",
           "serves", "supported"]
