"""Engine steps replayed from CUDA graphs: decode batches, and short single-prompt prefills.

A forward pass of Llama-3.1-8B launches ~300 kernels (32 layers x norms, GEMMs, RoPE + KV
write, attention, activation). Launched one by one from Python that takes ~20 ms of host
time, while the GPU needs ~4.5 ms for a decode step and ~7 ms for a 133-token prompt. A
CUDA graph records the launches once and replays them with one call.

A graph replays fixed shapes at fixed addresses, so every input of a step lives in a static
buffer, filled from one pinned host staging area per step (a few copies), and a batch is
padded up to the next captured size (a bucket):

- decode (B sequences, one token each), buckets of B: token ids, positions, cache slots
  ``[B]`` (padding rows write nowhere: slot -1), block tables ``[B, max_pages]`` with the
  full width a sequence can ever need, context lengths ``[B]`` (padding rows: 0, they attend
  to nothing);
- prefill (one sequence, n tokens, any cached context before them), buckets of T >= n:
  the padding rows form a second sequence of ``T - n`` tokens that writes no K/V and whose
  output is dropped, so the attention kernel's grid (from T and B = 2) stays fixed while
  the real lengths sit on the device.
  Up to ``PREFILL_SHORT_MAX`` tokens each bucket has two graphs, for contexts that fit in the
  bucket (fresh prompts) and for longer ones (a turn over a cached history): see below.

Launch shapes chosen on the host are pinned for the capture: the decode attention's split
count comes from the longest possible context, and the host lists say "not a fresh prompt"
so the Triton attention (whose grid needs only T and B) is captured rather than cuDNN. The
prefill attention's split count is pinned the same way, and one count does not serve both
kinds of prompt: a turn over a 27k-token history needs several splits (a few hundred queries
are too few programs for the GPU), while a fresh prompt pays for them without need (its
workspace and merge: Qwen3-30B-A3B's 590-token prompt spent 3.2 ms in split attention and 2.8
ms in the merge against ~22 ms of kernels, benchmarks/results/ttft-profile-qwen3-30b-a3b-2026-12-01.md).
So buckets up to ``PREFILL_SHORT_MAX`` are captured twice: for contexts up to the bucket (split
count chosen for a band of T keys) and for the long context.

The logits head and the sampler run inside the graph (sampling parameters are static
buffers too), so a step costs one replay and one copy of the tokens back. A step with a
request that needs more (logit bias, penalties, min_tokens, logprobs) drops the graph's
tokens and samples its logits (``last_logits``) again outside it (qml_runtime.runner).

All graphs share one memory pool and are captured largest first, so smaller ones reuse its
blocks. With ``capture=False`` the same padded static-buffer path runs eagerly: that is how
it is tested on machines without a GPU.
"""

from __future__ import annotations

import logging
import math
import time
from array import array

import numpy as np
import torch

from qml_kernels import attention_turn
from qml_kernels.attention import AttentionMetadata, block_tables_tensor
from qml_kernels.sampling import sample
from qml_runtime import turn_trace

log = logging.getLogger("qml.cuda_graphs")


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 beyond, and max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    return sorted({b for b in sizes if b <= max_batch} | {max_batch})


# Prompt chunks up to 4096 tokens. Up to 1024 the GPU time of a step is below its host time.
# Between 1k and 4k they are close, and the step takes whichever is slower: eager launches are
# hidden only when the host keeps ahead. Qwen3-30B-A3B launches ~880 kernels per forward
# (48 layers, routing and grouped GEMMs), ~45 ms of host time against 31-45 ms of kernels at
# 1.5-2.3k tokens. Eager, those prompts took 46-98 ms, varying between runs and server starts
# with the host's speed (benchmarks/results/engine-h200-prefillprobe-qwen3-30b-a3b-2026-11-30.md);
# the 1,024-token graph took 26 ms. The wider buckets past 1024 (12-25% apart) cost at most that
# much padding. From 4,096 tokens cuDNN's attention (eager) is the faster path.
PREFILL_SPLIT_CONTEXT = 32768
# buckets that also get a graph for contexts up to their own size (fresh prompts); larger ones fill the
# GPU with their own tiles and choose one split at either context (attention_prefill's measurements)
PREFILL_SHORT_MAX = 1024
PREFILL_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                   1280, 1536, 1792, 2048, 2304, 2560, 3072, 3584, 4096)


def sampling_row(seq) -> tuple[tuple[float, float, float], tuple[int, int, int]]:
    """The sampler's parameters of one row (Sequence-like: params, seed, num_output_tokens):
    (temperature, top_p, min_p), (top_k, seed, step)."""
    p = seq.params
    return (p.temperature, p.top_p, p.min_p), (p.top_k, seq.seed, seq.num_output_tokens)


def sampling_rows(seqs: list) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling_row`` of each of ``seqs`` as two CPU tensors, one copy each to the device: floats [3, B]
    and ints [3, B]. Explicit dtypes: a request may give temperature=1 as an int."""
    rows = [sampling_row(s) for s in seqs]
    floats = torch.tensor([f for f, _ in rows], dtype=torch.float32).reshape(-1, 3).t().contiguous()
    ints = torch.tensor([i for _, i in rows], dtype=torch.int64).reshape(-1, 3).t().contiguous()
    return floats, ints


class _Sampling:
    """Static per-row sampling parameters (filled per step) and the step's sampled tokens."""

    def __init__(self, rows: int, device: torch.device, floats: torch.Tensor | None = None,
                 ints: torch.Tensor | None = None):
        # (``floats`` [3, rows] and ``ints`` [3, rows]: views of a step's input buffer, where one is kept)
        # temperature, top_p, min_p:
        self.floats = torch.zeros(3, rows, dtype=torch.float32, device=device) if floats is None else floats
        # top_k, seed, step:
        self.ints = torch.zeros(3, rows, dtype=torch.int64, device=device) if ints is None else ints
        self.floats[1] = 1.0

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        n = logits.shape[0]
        f, i = self.floats[:, :n], self.ints[:, :n]
        return sample(logits, f[0], i[0], f[1], f[2], i[1], i[2])

    @staticmethod
    def host_rows(seqs: list, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """Fill the first len(seqs) columns of the host staging tensors."""
        f, i = sampling_rows(seqs)
        floats[:, :len(seqs)], ints[:, :len(seqs)] = f, i


class _GraphFamily:
    """Shared machinery: a graph per bucket, captured on a side stream into a shared pool."""

    name = "step"

    def __init__(self, model: torch.nn.Module, kv, device: torch.device, buckets: list[int], max_context: int,
                 capture: bool, pool=None):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size
        self.buckets = buckets
        self.max_pages = -(-max_context // self.block_size)
        self.capture_enabled = capture
        self.pool = pool
        self._graphs: dict = {}  # key (``keys``) -> (graph, its sampled tokens, its logits)
        # the last step's logits [bucket, V]: sampled again outside the graph when a row of the
        # step needs logits processing or logprobs (qml_runtime.runner)
        self.last_logits: torch.Tensor | None = None
        self.pinned = device.type == "cuda"

    def bucket(self, size: int) -> int:
        return next(b for b in self.buckets if b >= size)

    def keys(self) -> list:
        """What a graph is captured for, smallest first (decode: its buckets)."""
        return list(self.buckets)

    def _forward(self, key, capturing: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (sampled tokens, their logits)"""
        raise NotImplementedError

    def _before_capture(self, key) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def capture_all(self) -> None:
        t0 = time.perf_counter()
        keys = self.keys()
        for key in reversed(keys):
            if key not in self._graphs:
                self._capture(key)
        log.info("captured %d %s CUDA graphs for sizes %s in %.1f s", len(keys), self.name, self.buckets,
                 time.perf_counter() - t0)

    def _capture(self, key) -> None:
        self.kv.settle()  # a capture may not wait on a restore's events (recorded outside it)
        self._before_capture(key)  # inputs that write no K/V into anybody's pages
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        # warm-up: Triton compiles, cuBLAS picks its kernels, cuDNN's turn attention builds its graph
        with torch.cuda.stream(side), attention_turn.builds():
            self._forward(key, capturing=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            tokens, logits = self._forward(key, capturing=True)
        self._graphs[key] = (graph, tokens, logits)

    def _replay(self, key) -> torch.Tensor | None:
        """The graph's tokens after a replay, or None when a capture clobbered the inputs (fill again)."""
        if key not in self._graphs:
            self._capture(key)
            return None
        graph, tokens, self.last_logits = self._graphs[key]
        graph.replay()
        return tokens

    def _eager(self, key) -> torch.Tensor:
        tokens, self.last_logits = self._forward(key, capturing=False)
        return tokens


class DecodeGraphs(_GraphFamily):
    name = "decode"

    def __init__(self, model, kv, device, max_batch: int, max_context: int, capture: bool = True, pool=None):
        super().__init__(model, kv, device, decode_buckets(max_batch), max_context, capture, pool)
        B, dev = self.buckets[-1], device
        self.max_batch = B
        # rows: token id, position, slot, context length
        self.inputs = torch.zeros(4, B, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(B, self.max_pages, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.sampling = _Sampling(B, dev)
        # two sets of host staging, used in turn: the engine launches a step before the previous one
        # has run (qml_runtime.engine, overlapped decode), and a step's copies may still be queued
        # behind it when the next one fills its staging; the step before that has finished by then
        self._staging = [self._new_staging(B) for _ in range(2)]
        self._turn = 0
        self._eager_lens: list[int] = []

    def _new_staging(self, B: int) -> tuple[torch.Tensor, ...]:
        pin = self.pinned
        return (torch.zeros(4, B, dtype=torch.int64, pin_memory=pin),  # token id, position, slot, length
                torch.zeros(B, self.max_pages, dtype=torch.int32, pin_memory=pin),  # block tables
                torch.zeros(3, B, dtype=torch.float32, pin_memory=pin),  # sampling floats
                torch.zeros(3, B, dtype=torch.int64, pin_memory=pin))  # sampling ints

    def fits(self, batch_size: int, max_pages: int) -> bool:
        return batch_size <= self.max_batch and max_pages <= self.max_pages

    def _forward(self, n: int, capturing: bool) -> torch.Tensor:
        # capturing: the longest possible context fixes the attention's launch shape (split count)
        lens = [self.max_pages * self.block_size] * n if capturing else self._eager_lens
        meta = AttentionMetadata(
            slot_mapping=self.inputs[2, :n], block_tables=self.block_tables[:n], cu_seqlens_q=self.cu_seqlens[:n + 1],
            context_lens=self.context_lens[:n], cu_seqlens_q_host=list(range(n + 1)), context_lens_host=lens)
        hidden = self.model(self.inputs[0, :n], self.inputs[1, :n], self.kv, meta)
        logits = self.model.logits(hidden)  # [n, V] fp32
        return self.sampling.sample(logits), logits

    def _before_capture(self, n: int) -> None:
        self.inputs[2].fill_(-1)
        self.context_lens.fill_(1)

    @torch.inference_mode()
    def run(self, seqs: list, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for ``seqs`` (each has exactly its last token uncomputed) -> tokens [B] on the device.

        ``prev_tokens``: the previous step's tokens [B] on the device, row i the input of seqs[i] (whose
        last token is then a placeholder: that step has not been waited for)."""
        B, S = len(seqs), self.block_size
        n = self.bucket(B)
        host, tables, host_f, host_i = self._staging[self._turn]
        self._turn ^= 1
        host[:, B:n] = 0
        host[2, B:n] = -1  # padding rows write no K/V
        rows = []
        for s in seqs:
            p = s.num_computed
            rows.append((s.token_ids[p], p, s.block_table[p // S] * S + p % S, p + 1))
        host[:, :B] = torch.tensor(rows, dtype=torch.int64).T
        tables_now = block_tables_tensor([s.block_table for s in seqs])  # rebuilt each step: tables grow
        width = tables_now.shape[1]
        tables[:B, :width] = tables_now
        _Sampling.host_rows(seqs, host_f, host_i)
        host_f[:, B:n] = 0.0  # padding rows: greedy
        host_i[:, B:n] = 0
        self.inputs[:, :n].copy_(host[:, :n], non_blocking=True)
        if prev_tokens is not None:  # after the staged row 0 (placeholders), in stream order
            self.inputs[0, :B].copy_(prev_tokens[:B])
        self.context_lens[:n].copy_(host[3, :n], non_blocking=True)
        self.block_tables[:n, :width].copy_(tables[:n, :width], non_blocking=True)
        self.sampling.floats[:, :n].copy_(host_f[:, :n], non_blocking=True)
        self.sampling.ints[:, :n].copy_(host_i[:, :n], non_blocking=True)
        if not self.capture_enabled:
            self._eager_lens = host[3, :n].tolist()
            return self._eager(n)[:B]
        tokens = self._replay(n)
        return self.run(seqs, prev_tokens) if tokens is None else tokens[:B]


class PrefillGraphs(_GraphFamily):
    name = "prefill"

    def __init__(self, model, kv, device, max_context: int, capture: bool = True, pool=None,
                 buckets: tuple[int, ...] = PREFILL_BUCKETS):
        super().__init__(model, kv, device, list(buckets), max_context, capture, pool)
        T = self.buckets[-1]
        self.max_tokens = T
        # Every input of a step is a view of one device buffer, filled by one copy from a pinned host area of the
        # same layout written through numpy: the ~25 torch calls and six copies this took before cost ~1 ms of
        # host time on the H100 machine's CPU (each call 10-40 us), in front of a GPU-history turn's replay while
        # the GPU waited (benchmarks/results/turn-launch-2026-12-05.md). Regions are 256-byte aligned.
        self._layout = _Layout((("inputs", torch.int64, (3, T)),  # token id, position, slot
                                ("last_row", torch.int64, (1,)),
                                ("ints", torch.int64, (3, 1)),  # top_k, seed, step
                                ("floats", torch.float32, (3, 1)),  # temperature, top_p, min_p
                                ("lens", torch.int32, (2, 3)),  # row 0: cu_seqlens_q, row 1: context_lens
                                # sequence 0 is the real one, sequence 1 the padding (its row stays all page 0);
                                # last, so a step copies the table only as wide as its sequence's
                                ("block_tables", torch.int32, (2, self.max_pages))))
        self._dev_bytes = torch.zeros(self._layout.nbytes, dtype=torch.uint8, device=device)
        dev = self._layout.tensors(self._dev_bytes)
        self.inputs, self.last_row, self.block_tables, self.lens = (dev[k] for k in
                                                                     ("inputs", "last_row", "block_tables", "lens"))
        self.sampling = _Sampling(1, device, dev["floats"], dev["ints"])
        self._host_bytes = torch.zeros(self._layout.nbytes, dtype=torch.uint8, pin_memory=self.pinned)
        self._host = {k: t.numpy() for k, t in self._layout.tensors(self._host_bytes).items()}  # (all set per step)
        self._table_at = self._layout.offsets["block_tables"]
        self._eager_host: tuple[list[int], list[int]] = ([], [])

    def fits(self, num_tokens: int, num_pages: int) -> bool:
        return 1 < num_tokens <= self.max_tokens and num_pages <= self.max_pages

    def keys(self) -> list[tuple[int, bool]]:
        """(bucket, long context): every bucket for long contexts, the small ones also for short."""
        keys = [(T, True) for T in self.buckets] + [(T, False) for T in self.buckets if T <= PREFILL_SHORT_MAX]
        return sorted(keys)

    def key(self, n: int, context: int) -> tuple[int, bool]:
        """The graph for ``n`` new tokens ending at ``context``: the short-context one when the whole
        context fits in the bucket (a fresh prompt, or a short cached prefix)."""
        T = self.bucket(n)
        return (T, not (context <= T and T <= PREFILL_SHORT_MAX))

    def _forward(self, key: tuple[int, bool], capturing: bool) -> torch.Tensor:
        T, long = key
        if capturing:
            # host lists that only size the launch: two sequences, T rows, not a fresh prompt, and
            # the context the attention's split count is chosen for (any count is correct for any
            # context): 32k for the long graph, where a turn over a long history needs the splits
            # (replays over shorter contexts run a few empty ones), T for the short one
            cu_host = [0, T - 1, T]
            ctx = min(self.max_pages * self.block_size, PREFILL_SPLIT_CONTEXT) if long else T
            ctx_host = [max(T, ctx)] * 2
        else:
            cu_host, ctx_host = self._eager_host
        # the second sequence is the padding rows, over only their own keys: no history (attention_turn then
        # launches cuDNN for the turn's history alone: 3 runs of entries on the H200's Llama shapes, not 6)
        meta = AttentionMetadata(
            slot_mapping=self.inputs[2, :T], block_tables=self.block_tables, cu_seqlens_q=self.lens[0],
            context_lens=self.lens[1, :2], cu_seqlens_q_host=cu_host, context_lens_host=ctx_host, history_seqs=1)
        hidden = self.model(self.inputs[0, :T], self.inputs[1, :T], self.kv, meta)  # [T, D]
        logits = self.model.logits(hidden.index_select(0, self.last_row))  # [1, V]
        return self.sampling.sample(logits), logits

    def _before_capture(self, key: tuple[int, bool]) -> None:
        T = key[0]
        self.inputs[2].fill_(-1)
        self.lens[0].copy_(torch.tensor([0, T - 1, T], dtype=torch.int32))
        self.lens[1].copy_(torch.tensor([T - 1, 1, 0], dtype=torch.int32))

    @torch.inference_mode()
    def run(self, seq, n: int) -> torch.Tensor:
        """Compute the next ``n`` tokens of ``seq`` -> the token sampled after them, [1] on the device
        (meaningful when they end the sequence's uncomputed tokens)."""
        key = self.stage(seq, n)
        turn_trace.stamp_step("staged")
        if not self.capture_enabled:
            return self._eager(key)
        tokens = self._replay(key)
        turn_trace.stamp_step("replayed")
        return self.run(seq, n) if tokens is None else tokens

    def stage(self, seq, n: int) -> tuple[int, bool]:
        """Write the step's inputs to the host area and queue their one copy to the device; -> the graph's key."""
        S, start = self.block_size, seq.num_computed
        L = start + n
        key = self.key(n, L)
        T = key[0]
        h = self._host
        inputs = h["inputs"]
        inputs[0, :n] = seq.token_ids[start:L]
        pos = np.arange(start, L)
        inputs[1, :n] = pos
        # the slots of the new tokens, from the pages they fall in (a handful, not the whole table)
        first = start // S
        pages = np.array(seq.block_table[first:(L - 1) // S + 1], dtype=np.int64)
        inputs[2, :n] = pages[pos // S - first] * S + pos % S
        inputs[:, n:T] = 0
        inputs[2, n:T] = -1  # padding rows write no K/V
        h["lens"][:] = ((0, n, T), (L, T - n, 0))  # padding: T - n rows over T - n keys
        h["last_row"][0] = n - 1
        width = len(seq.block_table)
        h["block_tables"][0, :width] = np.frombuffer(array("i", seq.block_table), dtype=np.int32)
        h["floats"][:, 0], h["ints"][:, 0] = sampling_row(seq)
        end = self._table_at + 4 * width
        self._dev_bytes[:end].copy_(self._host_bytes[:end], non_blocking=True)
        if not self.capture_enabled:
            self._eager_host = ([0, n, T], [L, T - n])
        return key


class _Layout:
    """Named tensors of fixed dtypes and shapes packed into one byte buffer, each region 256-byte aligned."""

    ALIGN = 256

    def __init__(self, regions: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]):
        self.regions, self.offsets, at = regions, {}, 0
        for name, dtype, shape in regions:
            self.offsets[name] = at
            at += -(-math.prod(shape) * dtype.itemsize // self.ALIGN) * self.ALIGN
        self.nbytes = at

    def tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``buffer`` (uint8, ``nbytes``) as the named tensors."""
        out = {}
        for name, dtype, shape in self.regions:
            at = self.offsets[name]
            out[name] = buffer[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
        return out
