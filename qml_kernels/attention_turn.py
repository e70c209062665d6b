"""The next turn's attention over a long cached history: cuDNN over the history's whole pages, split
into runs, our Triton kernel over the rest of the keys, both merged in that kernel.

Why: a conversation's next turn is a few hundred new queries over tens of thousands of cached keys.
On the H200 our split-KV launch runs 150 queries over 27,339 keys (Llama-3.1-8B heads) in 208-210 us
a layer (~320 TFLOP/s), ~8.4 of the turn's ~16 device ms in the engine. cuDNN's paged SDPA reads our
token-major pages as they are (its K/V containers are ``[pages, H_kv, page, D]``, the in-page layout
given by strides) and, with each KV head's query heads packed as the rows of one head (G x n_q rows
of MHA instead of n_q rows of GQA: 600 rows in 5 tiles of 128 rather than 150 in 2) and the history
cut into runs of pages folded into the batch, does the history's part in 151-157 us
(``benchmarks/results/cudnn-turn-h200-2026-12-04.md``). Its wave count decides its time (one
program per SM, 40 programs a run at these shapes: 3 runs 153 us, 4 runs 220 us), so the run count
fills one wave.

What cuDNN cannot do here: a causal mask on packed rows (a row's token is row // G). So the work is
cut by keys: cuDNN attends every query to the history's whole pages ``[0, tail)`` with no mask (the
queries all come after them); ``_turn_tail_merge_kernel`` attends each query to the keys from
``tail`` to its own position (the step's own tokens and at most a page's worth before them,
causal), and merges the parts by their log-sum-exps. Each part is a softmax over disjoint keys:
``out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M)``, with cuDNN's stats (natural log) taken to
base 2.

Where it runs: steps that the engine replays from a CUDA graph (a single turn of up to
``TURN_MAX_QUERIES`` queries over a long history), whose shapes are fixed, so each cuDNN graph is
built once, in the warm-up before the capture (70-120 ms a build on the H200: ``builds``). Eager
steps use it only for shapes built already (served, a build on an eager turn restoring its history
from host RAM took that turn from 88 to 218 ms). The per-step plan (run boundaries, block tables,
lengths) is made on the device from the step's metadata, as a replay needs.

A prefill graph's second sequence is its padding rows over only their own keys
(``AttentionMetadata.history_seqs`` = 1): it gets no cuDNN entries, and all its keys go to the tail kernel.
Before, the graph's cuDNN launch held 6 entries (2 sequences x 3 runs), half of them empty, and the engine's
profile (2026-12-04) showed the kernel at 228 us a layer against 153 alone, as slow as two waves: whether
the empty entries were the cause is measured by ``benchmarks/turn_attention_engine_h200.py`` (not yet run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import heapq
import itertools
import os

import torch
import triton
import triton.language as tl

from qml_kernels.attention import AttentionMetadata
from qml_kernels.attention_prefill import LOG2E, tile_of
from qml_kernels.cudnn_frontend import build, execute, paged_graph
from qml_kernels.cudnn_frontend import module as _cudnn

LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)  # (the merge takes cuDNN's natural-log stats to base 2)
# sequences a program scans per step of its search for its own (attention_prefill.tile_of)
SEQ_CHUNK: tl.constexpr = tl.constexpr(64)
TURN_MIN_HISTORY = 4096  # cached keys before the step's queries, in every sequence (in the host lists)
TURN_MAX_QUERIES = 512  # the tail kernel attends these causally on its own; longer chunks stay with Triton
ROWS = 64  # rows of the tail kernel's tile: TILE_TOKENS = ROWS // G tokens of G query heads
CUDNN_TILE = 128  # rows of cuDNN's Hopper tile (what the run count is sized with)
MAX_RUNS = 16  # (the merge unrolls a loop over them)
ENABLED = os.environ.get("QML_CUDNN_TURN", "1") != "0"


def num_runs(rows: int, kv_heads: int, sms: int) -> int:
    """Runs of the history (batch entries per sequence) so that one sequence's cuDNN programs fill one
    wave: ``kv_heads x ceil(rows / 128)`` programs a run, one per SM."""
    return _equal_runs(_programs_per_run(rows, kv_heads), sms)


def _programs_per_run(rows: int, kv_heads: int) -> int:
    return kv_heads * -(-rows // CUDNN_TILE)


def _equal_runs(per_run: int, sms: int) -> int:
    return max(1, min(MAX_RUNS, sms // per_run))


@dataclasses.dataclass(frozen=True)
class RunSplit:
    """How a sequence's history pages are cut into cuDNN's runs: ``long`` runs of ``weight`` shares of the pages
    each, then ``short`` runs of one share each (in that order: the order cuDNN's grid hands programs to SMs).

    The default is ``wave_split``'s. Equal runs (``num_runs``: on the H200's 150-query turn 3 runs of 40 programs,
    120 of 132 SMs busy for the whole call) leave SMs idle where a run's programs do not divide them; a short run's
    programs can fill the SMs left over and those freed as they finish: with (3 runs x 4 shares, 1 run x 1) the 12
    spare SMs take the short run's 40 programs in 4 rounds of a quarter of a long program each, while each long run
    covers 4/13 of the keys instead of 1/3. Measured on an H100 (``turn-waves-h100-2026-12-06.md``): -2.8% of the
    turn path at 150 queries, -17.5% at 163 (48 programs a run: 2 equal runs left 36 SMs idle), -37% at 280."""

    long: int
    short: int = 0
    weight: int = 1

    def __post_init__(self):
        if self.long < 1 or self.short < 0 or self.weight < 1 or self.long + self.short > MAX_RUNS:
            raise ValueError(f"a split needs 1 <= long, 0 <= short, 1 <= weight, long + short <= {MAX_RUNS}: {self}")

    @property
    def runs(self) -> int:
        return self.long + self.short

    @property
    def shares(self) -> int:
        return self.long * self.weight + self.short

    def pages_per_run(self, pages: int) -> int:
        """The most pages a run of this split gets out of ``pages`` (a long run's ceiling)."""
        return -(-pages * self.weight // self.shares)

    @classmethod
    def parse(cls, text: str) -> RunSplit:
        """``"LxW+S"`` (L runs of W shares, S runs of one; ``"3"`` is three equal runs, ``"3x4+1"``)."""
        head, _, short = text.partition("+")
        long, _, weight = head.partition("x")
        return cls(int(long), int(short or 0), int(weight or 1))


# The wave model's costs, in units of one cuDNN program over the whole history (~440 us at 27k keys on an H100:
# ``turn-tail-sweep-h100-2026-12-06.json``): a program's fixed cost, and a run's (the tail merges one more).
WAVE_PROGRAM_COST = 0.001
WAVE_RUN_COST = 0.003


def wave_time(split: RunSplit, per_run: int, sms: int) -> float:
    """The wave model's time of ``split``'s cuDNN call (plus its runs' merge): its programs, ``per_run`` a run in
    the grid's order (long runs first), each taken by the first SM free, at a rate one program's keys a unit."""
    long_t = split.weight / split.shares + WAVE_PROGRAM_COST
    short_t = 1 / split.shares + WAVE_PROGRAM_COST
    free = [0.0] * sms  # a heap of the SMs' free times
    for n, t in ((split.long * per_run, long_t), (split.short * per_run, short_t)):
        for _ in range(n):
            heapq.heapreplace(free, free[0] + t)
    return max(free) + WAVE_RUN_COST * split.runs


@functools.cache
def wave_split(per_run: int, sms: int) -> RunSplit:
    """The split the wave model times fastest: equal runs (``num_runs``'s when it is as fast), or long runs that
    fit one wave beside short ones that fill the SMs they leave. E.g. 48 programs a run (Llama-3.1-8B, 161-192
    queries) on 132 SMs: 2 equal runs leave 36 SMs idle for the whole call (0.50 of a program over the whole
    history), 2 runs of 4 shares and 3 of 1 end together at ~0.38."""
    equal = RunSplit(_equal_runs(per_run, sms))
    best, best_t = equal, wave_time(equal, per_run, sms)
    for long in range(1, MAX_RUNS + 1):
        for short in range(0, MAX_RUNS + 1 - long):
            weights = range(1, 13) if short and long * per_run <= sms else (1,)
            if (long + short) * per_run > 4 * sms:  # more rounds than a split of this kind ever wins by
                continue
            for weight in weights:
                split = RunSplit(long, short, weight)
                if weight / split.shares + WAVE_PROGRAM_COST >= best_t:  # a long program alone (grows with weight)
                    break
                t = wave_time(split, per_run, sms)
                if t < best_t * 0.99:  # a split that wins by less than the model's error stays out
                    best, best_t = split, t
    return best


def _default_split(rows: int, kv_heads: int, sms: int) -> RunSplit:
    """``wave_split``'s for this launch, or ``QML_TURN_SPLIT`` (``RunSplit.parse``, or ``equal``: ``num_runs``'s
    equal runs; the engine's A/B of a split)."""
    text = os.environ.get("QML_TURN_SPLIT")
    if text == "equal":
        return RunSplit(num_runs(rows, kv_heads, sms))
    if text:
        return RunSplit.parse(text)
    return wave_split(_programs_per_run(rows, kv_heads), sms)


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step


class _Buffers:
    """The history part's operands for one launch shape, reused by every call of it: q ``[E, Hkv, R, D]``
    (entry e = sequence e // runs, run e % runs; row tok * G + g), o like q, stats ``[E, Hkv, R, 1]``
    (natural log), block tables ``[E, 1, max_pages, 1]``, rows and keys per entry."""

    def __init__(self, device, dtype, E: int, Hkv: int, R: int, D: int, max_pages: int):
        self.q = torch.zeros(E, Hkv, R, D, dtype=dtype, device=device)  # zeros: padded rows stay finite
        self.o = torch.zeros_like(self.q)
        self.stats = torch.zeros(E, Hkv, R, 1, dtype=torch.float32, device=device)
        self.table = torch.zeros(E, 1, max_pages, 1, dtype=torch.int32, device=device)
        self.seq_q = torch.zeros(E, 1, 1, 1, dtype=torch.int32, device=device)
        self.seq_kv = torch.zeros(E, 1, 1, 1, dtype=torch.int32, device=device)


class _Graph(_Buffers):
    """A cuDNN paged SDPA graph for one launch shape: the packed rows over the runs' pages, no mask, the
    padding by lengths, softmax stats out."""

    def __init__(self, cudnn, device, dtype, E: int, Hkv: int, R: int, D: int, pool_shape, pool_strides,
                 max_pages: int, page: int, scale: float):
        super().__init__(device, dtype, E, Hkv, R, D, max_pages)
        self.handle, g, io, t = paged_graph(cudnn, dtype, pool_shape, pool_strides,
                                            {"table": self.table, "seq_q": self.seq_q, "seq_kv": self.seq_kv})
        t["q"] = g.tensor(name="q", dim=list(self.q.shape), stride=list(self.q.stride()), data_type=io)
        o, stats = g.sdpa(name="turn", q=t["q"], k=t["k"], v=t["v"], attn_scale=scale, generate_stats=True,
                          use_padding_mask=True, seq_len_q=t["seq_q"], seq_len_kv=t["seq_kv"],
                          paged_attention_k_table=t["table"], paged_attention_v_table=t["table"],
                          paged_attention_max_seq_len_kv=max_pages * page)
        o.set_output(True).set_dim(list(self.o.shape)).set_stride(list(self.o.stride())).set_data_type(io)
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
        self.workspace = build(cudnn, g, device)
        self.graph, self.tensors, self.out_o, self.out_stats, self.cudnn = g, t, o, stats, cudnn

    def run(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        t = self.tensors
        execute(self.cudnn, self.handle, self.graph,
                {t["q"]: self.q, t["k"]: k_cache, t["v"]: v_cache, t["table"]: self.table, t["seq_q"]: self.seq_q,
                 t["seq_kv"]: self.seq_kv, self.out_o: self.o, self.out_stats: self.stats}, self.workspace)


_GRAPHS: dict[tuple, _Graph | None] = {}  # launch shape -> built graph (None: cuDNN declined it)
_builds = 0  # > 0 inside ``builds()``: new launch shapes may be built


@contextlib.contextmanager
def builds():
    """Where new launch shapes may be built (70-120 ms each, with a trial capture): the warm-up before a
    CUDA graph's capture (``qml_runtime.cuda_graphs``), checks and benchmarks. Elsewhere a step whose shape
    was not built runs the Triton kernel: a served step must not stall on a build (an eager turn's block
    table width, part of the shape, differs at every step)."""
    global _builds
    _builds += 1
    try:
        yield
    finally:
        _builds -= 1


def _launch_shape(q, k_cache, meta: AttentionMetadata, sms: int, split: RunSplit | None = None) -> tuple:
    """The cuDNN launch for this step, from host values only: (E entries, the split into runs, rows, pages a
    run can hold). The device metadata may hold other lengths (a CUDA graph's replays): the rows and pages
    are sized for the largest the host lists and the block table allow. ``split``: the default's if None."""
    H = q.shape[1]
    Hkv = k_cache.shape[2]
    G = H // Hkv
    B = _history_seqs(meta)
    cu = meta.cu_seqlens_q_host[:B + 1]
    n_max = max(b - a for a, b in itertools.pairwise(cu))
    rows = _bucket(G * n_max, 64)
    split = split or _default_split(rows, Hkv, sms)
    max_pages = split.pages_per_run(meta.block_tables.shape[1]) + 1
    return (B * split.runs, split, rows, _bucket(max_pages, 16))


def _history_seqs(meta: AttentionMetadata) -> int:
    """The sequences, from the first, whose histories get cuDNN entries (``AttentionMetadata.history_seqs``);
    the others' keys all go to the tail kernel."""
    n = meta.num_seqs
    return n if meta.history_seqs is None else max(1, min(n, meta.history_seqs))


@functools.cache
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _captures(graph: _Graph, k_cache, v_cache) -> bool:
    """Whether a launch of ``graph`` records into a CUDA graph (the engine replays turns from them): tried
    once, with no rows and no keys, before the engine's captures rely on it."""
    try:
        side = torch.cuda.Stream(k_cache.device)
        side.wait_stream(torch.cuda.current_stream(k_cache.device))
        trial = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(trial, stream=side):
            graph.run(k_cache, v_cache)
        trial.replay()
        torch.cuda.current_stream(k_cache.device).wait_stream(side)
        torch.cuda.synchronize(k_cache.device)
        return True
    except Exception:  # noqa: BLE001 - not capturable: Triton serves these steps
        return False


def _graph_for(q, k_cache, meta, scale, v_cache=None, split: RunSplit | None = None) -> tuple[_Graph | None, RunSplit]:
    E, split, rows, max_pages = _launch_shape(q, k_cache, meta, _sms(q.device.index or 0), split)
    Hkv, D = k_cache.shape[2], q.shape[2]
    key = (q.device.index, q.dtype, E, Hkv, rows, D, tuple(k_cache.shape), tuple(k_cache.stride()), max_pages,
           float(scale))
    if key not in _GRAPHS:
        if not _builds or torch.cuda.is_current_stream_capturing():
            return None, split  # (a build cannot run inside a capture either: the warm-up before it builds)
        try:
            graph = _Graph(_cudnn(), q.device, q.dtype, E, Hkv, rows, D, tuple(k_cache.shape),
                           tuple(k_cache.stride()), max_pages, k_cache.shape[1], scale)
            _GRAPHS[key] = graph if _captures(graph, k_cache, k_cache if v_cache is None else v_cache) else None
        except Exception:  # noqa: BLE001 - cuDNN declines the shape: Triton serves it
            _GRAPHS[key] = None
    return _GRAPHS[key], split


def supported(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, sinks=None,
              softcap=None, out=None) -> bool:
    if not (ENABLED and q.is_cuda and q.dim() == 3 and q.dtype in (torch.bfloat16, torch.float16)
            and k_cache.dtype == v_cache.dtype == q.dtype and k_cache.stride() == v_cache.stride()
            and sliding_window is None and sinks is None and softcap is None):
        return False
    H, D = q.shape[1], q.shape[2]
    Hkv = k_cache.shape[2]
    if H % Hkv or ROWS % (H // Hkv) or D % 8 or D > 128 or D & (D - 1) or meta.is_decode:
        return False
    cu, lens = meta.cu_seqlens_q_host, meta.context_lens_host
    shapes = [(cu[b + 1] - cu[b], L) for b, L in enumerate(lens)]
    # (sequences past history_seqs, a graph's padding rows, have no history: only their rows are bounded)
    if not all(0 < n <= TURN_MAX_QUERIES and (b >= _history_seqs(meta) or L - n >= TURN_MIN_HISTORY)
               for b, (n, L) in enumerate(shapes)):
        return False
    if _cudnn() is None:
        return False
    graph, _ = _graph_for(q, k_cache, meta, scale, v_cache)
    return graph is not None


@triton.jit
def _turn_plan_kernel(block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, table_ptr, seq_q_ptr, seq_kv_ptr,
                      tail_ptr, stride_bt, width, max_pages,
                      RUNS: tl.constexpr, LONG: tl.constexpr, WEIGHT: tl.constexpr, GROUP: tl.constexpr,
                      PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """Entry e = (sequence e // RUNS, run e % RUNS): its pages of the history's whole pages, cut into RUNS
    runs (``RunSplit``: the first LONG of WEIGHT shares each, the rest of one; equal runs differ by at most one
    page); its lengths (rows: the sequence's queries x G; keys: the run's); and each sequence's first key past
    its runs (the tail kernel's)."""
    e = tl.program_id(0)
    b = e // RUNS
    r = e % RUNS
    n_q = tl.load(cu_seqlens_q_ptr + b + 1) - tl.load(cu_seqlens_q_ptr + b)
    L = tl.load(context_lens_ptr + b)
    pages = tl.maximum(L - n_q, 0) // PAGE_SIZE
    shares = LONG * WEIGHT + (RUNS - LONG)
    # shares before run r, and before run r + 1
    before = tl.minimum(r, LONG) * WEIGHT + tl.maximum(r - LONG, 0)
    upto = tl.minimum(r + 1, LONG) * WEIGHT + tl.maximum(r + 1 - LONG, 0)
    lo = pages * before // shares
    count = pages * upto // shares - lo
    for j0 in range(0, max_pages, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        take = (j < count) & (lo + j < width)
        page = tl.load(block_tables_ptr + b * stride_bt + lo + j, mask=take, other=0)
        tl.store(table_ptr + e * max_pages + j, page, mask=j < max_pages)
    tl.store(seq_q_ptr + e, n_q * GROUP)
    tl.store(seq_kv_ptr + e, count * PAGE_SIZE)
    if r == 0:
        tl.store(tail_ptr + b, pages * PAGE_SIZE)


@triton.jit
def _turn_pack_q_kernel(q_ptr, packed_ptr, cu_seqlens_q_ptr, num_seqs, history_seqs, stride_q_t, stride_q_h,
                        stride_p_e, stride_p_h, stride_p_r,
                        RUNS: tl.constexpr, GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    """q [T, H, D] -> packed [E, Hkv, R, D]: row tok * G + g of KV head h holds query head h * G + g of the
    sequence's token tok, copied into each of the sequence's RUNS entries (sequences past ``history_seqs``
    have none)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    b, q_start, t0 = tile_of(pid, cu_seqlens_q_ptr, num_seqs, TILE_TOKENS, SEQ_CHUNK)
    n_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    ok = (tok < n_q) & ((rows * 0 + b) < history_seqs)
    d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + rows % GROUP
    src = (q_start + tok).to(tl.int64) * stride_q_t + head * stride_q_h
    x = tl.load(q_ptr + src[:, None] + d[None, :], mask=ok[:, None], other=0.0)
    local = t0 * GROUP + rows
    for r in tl.static_range(RUNS):
        e = b * RUNS + r
        dst = e.to(tl.int64) * stride_p_e + kv_head * stride_p_h + local.to(tl.int64) * stride_p_r
        tl.store(packed_ptr + dst[:, None] + d[None, :], x, mask=ok[:, None])


@triton.jit
def _turn_tail_merge_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, hist_o_ptr, hist_lse_ptr, seq_kv_ptr,
                            block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, tail_ptr, num_seqs, history_seqs,
                            pre_scale, stride_q_t, stride_q_h, stride_o_t, stride_o_h,
                            stride_page, stride_slot, stride_head, stride_bt,
                            stride_ho_e, stride_ho_h, stride_ho_r, stride_hl_e, stride_hl_h,
                            RUNS: tl.constexpr, GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr,
                            HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A tile of one sequence's queries (TILE_TOKENS tokens x G heads of one KV head): attention over the keys
    from the sequence's tail start to each query's own position, merged with the RUNS history parts."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    b, q_start, t0 = tile_of(pid, cu_seqlens_q_ptr, num_seqs, TILE_TOKENS, SEQ_CHUNK)
    n_q = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if t0 >= n_q:
        return
    L = tl.load(context_lens_ptr + b)
    tail = tl.load(tail_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // GROUP
    row_ok = tok < n_q
    head = kv_head * GROUP + rows % GROUP
    q_pos = L - n_q + tok
    d = tl.arange(0, HEAD_DIM)
    q_row = (q_start + tok).to(tl.int64) * stride_q_t + head * stride_q_h
    q = tl.load(q_ptr + q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = k_cache_ptr + kv_head * stride_head
    v_base = v_cache_ptr + kv_head * stride_head
    bt_row = block_tables_ptr + b * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = L - n_q + tl.minimum(t0 + TILE_TOKENS, n_q)  # past the tile's last query
    for n0 in range(tail, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        page = tl.load(bt_row + keys // PAGE_SIZE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * stride_page + (keys % PAGE_SIZE) * stride_slot
        k = tl.load(k_base + slot[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * pre_scale
        s = tl.where((keys[None, :] <= q_pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # every query sees its own key (tail <= its position), so l_i > 0 on real rows; padded rows are not stored
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # base 2, of the scores times pre_scale
    o = acc / l_safe[:, None]
    # the history's parts, folded in one by one: cuDNN's o (normalised) and stats (natural log of its scaled
    # scores), weighed against the running maximum (finite on every real row: the tail's own part is)
    local = t0 * GROUP + rows
    num = o
    den = tl.full([BLOCK_M], 1.0, tl.float32)
    # a sequence past history_seqs has no entries (its keys were all the tail's): it reads the last one
    # with entries, in bounds, and weighs it nothing
    has_runs = (rows * 0 + b) < history_seqs  # [BLOCK_M]
    b_runs = tl.minimum(b, history_seqs - 1)
    for r in tl.static_range(RUNS):
        e = b_runs * RUNS + r
        # [BLOCK_M]: a run of no keys weighs nothing
        has_keys = ((rows * 0 + tl.load(seq_kv_ptr + e)) > 0) & has_runs
        part = tl.load(hist_lse_ptr + e * stride_hl_e + kv_head * stride_hl_h + local, mask=row_ok, other=0.0)
        part = tl.where(has_keys, part * LOG2E_C, float("-inf"))
        top = tl.maximum(lse, part)
        keep, w_r = tl.exp2(lse - top), tl.exp2(part - top)
        o_r = tl.load(hist_o_ptr + e.to(tl.int64) * stride_ho_e + kv_head * stride_ho_h
                      + local.to(tl.int64)[:, None] * stride_ho_r + d[None, :],
                      mask=(row_ok & has_keys)[:, None], other=0.0).to(tl.float32)
        num = num * keep[:, None] + o_r * w_r[:, None]
        den = den * keep + w_r
        lse = top
    res = num / den[:, None]
    o_row = (q_start + tok).to(tl.int64) * stride_o_t + head * stride_o_h
    tl.store(out_ptr + o_row[:, None] + d[None, :], res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class _Plan:
    """What a step's layers share: the history's runs, laid out for cuDNN on the device (once per step)."""

    def __init__(self, graph, split: RunSplit, meta: AttentionMetadata, group: int, page: int):
        self.graph, self.runs = graph, split.runs
        # (zeros: a sequence past history_seqs gets no entries, so no tail from the plan kernel: all its keys)
        self.tail = torch.zeros(meta.num_seqs, dtype=torch.int32, device=meta.block_tables.device)
        E, _, max_pages, _ = graph.table.shape
        bt = meta.block_tables
        _turn_plan_kernel[(E,)](bt, meta.cu_seqlens_q, meta.context_lens, graph.table, graph.seq_q, graph.seq_kv,
                                self.tail, bt.stride(0), bt.shape[1], max_pages,
                                RUNS=split.runs, LONG=split.long, WEIGHT=split.weight, GROUP=group, PAGE_SIZE=page,
                                BLOCK=256)


@dataclasses.dataclass(frozen=True)
class TailLaunch:
    """``_turn_tail_merge_kernel``'s launch: rows of a program's tile (rows // G tokens of G query heads; a
    multiple of G, at least 16), keys a step, warps, pipeline stages. The default is what the engine runs;
    ``benchmarks/turn_tail_sweep_h200.py`` times others (the kernel took ~10.7 us a layer of the H200's
    150-token turn, latency-bound: ~88 programs, each up to 3 key steps then 3 runs merged one after the other)."""

    rows: int = ROWS
    block_n: int = 64
    warps: int = 4
    stages: int = 2


def turn_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale, sliding_window=None, sinks=None,
                   softcap=None, out=None, history=None, tail: TailLaunch = TailLaunch(),
                   split: RunSplit | None = None) -> torch.Tensor:
    """q: [T, H, Dh]; caches [P, S, Hkv, Dh] -> out [T, H, Dh] (see ``supported`` for the steps it serves).

    ``history``: what runs the history's part on the packed rows (``plan.graph``'s buffers); cuDNN unless
    given (tests on machines without it pass a reference). ``tail``: the tail kernel's launch. ``split``: the
    history's runs (None: the default, ``wave_split``'s)."""
    assert sliding_window is None and sinks is None and softcap is None
    T, H, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    out = torch.empty_like(q) if out is None else out
    # one plan per step and launch shape (layers of other shapes, if a model has them, get their own)
    key = ("turn", tuple(q.shape), q.dtype, tuple(k_cache.shape), tuple(k_cache.stride()), float(scale), split)
    plan = meta.plans.get(key)
    if plan is None:
        graph, split = _graph_for(q, k_cache, meta, scale, v_cache, split) if history is None \
            else history.graph_for(q, k_cache, meta, split)
        plan = meta.plans[key] = _Plan(graph, split, meta, G, S)
    g = plan.graph
    tt = ROWS // G
    grid = (T // tt + meta.num_seqs, Hkv)
    hs = _history_seqs(meta)
    _turn_pack_q_kernel[grid](q, g.q, meta.cu_seqlens_q, meta.num_seqs, hs, q.stride(0), q.stride(1),
                              g.q.stride(0), g.q.stride(1), g.q.stride(2),
                              RUNS=plan.runs, GROUP=G, TILE_TOKENS=tt, HEAD_DIM=D, BLOCK_M=ROWS, num_warps=4)
    if history is None:
        g.run(k_cache, v_cache)
    else:
        history(g, k_cache, v_cache, scale)
    tail_tokens = tail.rows // G
    _turn_tail_merge_kernel[(T // tail_tokens + meta.num_seqs, Hkv)](
        q, k_cache, v_cache, out, g.o, g.stats, g.seq_kv, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
        plan.tail, meta.num_seqs, hs, scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        g.o.stride(0), g.o.stride(1), g.o.stride(2), g.stats.stride(0), g.stats.stride(1),
        RUNS=plan.runs, GROUP=G, TILE_TOKENS=tail_tokens, HEAD_DIM=D, PAGE_SIZE=S, BLOCK_M=tail.rows,
        BLOCK_N=tail.block_n, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tail.warps,
        num_stages=tail.stages)
    return out


class HistoryReference:
    """The history's part in fp32 torch, on the same buffers: what cuDNN computes there, for machines without
    it (tests) and as the check of the GPU path. ``sms``: the SMs the run count is sized for."""

    def __init__(self, sms: int = 8):
        self.sms = sms

    def graph_for(self, q, k_cache, meta: AttentionMetadata,
                  split: RunSplit | None = None) -> tuple[_Buffers, RunSplit]:
        E, split, rows, max_pages = _launch_shape(q, k_cache, meta, self.sms, split)
        return _Buffers(q.device, q.dtype, E, k_cache.shape[2], rows, q.shape[2], max_pages), split

    def __call__(self, g: _Buffers, k_cache, v_cache, scale: float) -> None:
        S, Hkv, D = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        for e in range(g.q.shape[0]):
            rows, keys = int(g.seq_q[e]), int(g.seq_kv[e])
            if rows == 0 or keys == 0:
                continue
            pages = g.table[e, 0, : keys // S, 0].long()
            k = k_cache[pages].reshape(-1, Hkv, D).float()  # [keys, Hkv, D]
            v = v_cache[pages].reshape(-1, Hkv, D).float()
            s = torch.einsum("hrd,khd->hrk", g.q[e, :, :rows].float(), k) * scale
            g.stats[e, :, :rows, 0] = torch.logsumexp(s, -1)
            g.o[e, :, :rows] = torch.einsum("hrk,khd->hrd", torch.softmax(s, -1), v).to(g.o.dtype)


__all__ = ["TURN_MAX_QUERIES", "TURN_MIN_HISTORY", "HistoryReference", "RunSplit", "TailLaunch", "num_runs",
           "supported", "turn_attention", "wave_split", "wave_time"]
