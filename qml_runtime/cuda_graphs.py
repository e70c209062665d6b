"""Decode steps replayed from CUDA graphs.

A decode step of Llama-3.1-8B launches ~300 kernels (32 layers x norms, GEMMs, RoPE + KV
write, attention, activation) whose GPU time is ~4 ms at batch 1; launched one by one from
Python, the host side alone takes longer than that. A CUDA graph records the launches once
and replays them with one call.

A graph replays fixed shapes and fixed addresses, so every input of a decode step lives in
a static buffer, and batches are padded up to the next captured batch size (a bucket):

- token ids, positions, cache slots ``[B]``; padding rows write nowhere (slot -1);
- block tables ``[B, max_pages]`` with the full width a sequence can ever need, so a
  growing context never changes the shape;
- context lengths ``[B]``; padding rows have length 0 and attend to nothing;
- the split count of the decode attention is chosen on the host from the longest
  possible context (``decode_num_splits``), so it is fixed per bucket: the kernel finds
  each split's share of the keys from the real lengths on the device.

The graphs share one memory pool and are captured largest first, so the smaller ones
reuse its blocks. The logits head runs inside the graph; sampling runs after it (its
parameters change per step, and it is a few kernels).

With ``capture=False`` the same padded static-buffer path runs eagerly: that is how it is
tested on machines without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from qml_kernels.attention import AttentionMetadata

log = logging.getLogger("qml.cuda_graphs")


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 64, every 16 beyond, and max_batch."""
    sizes = [b for b in (1, 2, 4) if b < max_batch]
    sizes += list(range(8, min(max_batch, 64) + 1, 8)) + list(range(80, max_batch + 1, 16))
    return sorted({b for b in sizes if b <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv, device: torch.device, max_batch: int, max_context: int,
                 capture: bool = True):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size
        self.buckets = decode_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_pages = -(-max_context // self.block_size)
        self.capture_enabled = capture
        B, dev = self.max_batch, device
        self.input_ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.full((B,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(B, self.max_pages, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=dev)
        # one staging row per input, filled on the host and sent in one copy per step
        pin = dev.type == "cuda"
        self._host = torch.zeros(4, B, dtype=torch.int64, pin_memory=pin)
        self._host_tables = torch.zeros(B, self.max_pages, dtype=torch.int32, pin_memory=pin)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def fits(self, batch_size: int, max_pages: int) -> bool:
        return batch_size <= self.max_batch and max_pages <= self.max_pages

    def bucket(self, batch_size: int) -> int:
        return next(b for b in self.buckets if b >= batch_size)

    def _meta(self, n: int, context_lens_host: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slots[:n], block_tables=self.block_tables[:n], cu_seqlens_q=self.cu_seqlens[:n + 1],
            context_lens=self.context_lens[:n], cu_seqlens_q_host=list(range(n + 1)),
            context_lens_host=context_lens_host)

    def _forward(self, n: int, context_lens_host: list[int]) -> torch.Tensor:
        hidden = self.model(self.input_ids[:n], self.positions[:n], self.kv, self._meta(n, context_lens_host))
        return self.model.logits(hidden)  # [n, V] fp32

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (they share one memory pool)."""
        t0 = time.perf_counter()
        for n in reversed(self.buckets):
            if n not in self._graphs:
                self._capture(n)
        log.info("captured decode CUDA graphs for batch sizes %s in %.1f s", self.buckets, time.perf_counter() - t0)

    def _capture(self, n: int) -> None:
        # the longest context any sequence can have fixes the kernels' launch shapes (split count)
        worst = [self.max_pages * self.block_size] * n
        self.slots.fill_(-1)  # the warm-up and capture runs must not write into anybody's pages
        self.context_lens.fill_(1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(n, worst)  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(n, worst)
        self._graphs[n] = (graph, logits)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """One decode step for B sequences -> logits [B, V] (fp32)."""
        B = len(ids)
        n = self.bucket(B)
        host = self._host
        host[:, B:n] = 0
        host[2, B:n] = -1  # padding rows write no K/V
        host[0, :B] = torch.tensor(ids)
        host[1, :B] = torch.tensor(positions)
        host[2, :B] = torch.tensor(slots)
        host[3, :B] = torch.tensor(context_lens)
        width = max(len(t) for t in tables)
        table_rows = self._host_tables[:n, :width]
        table_rows.zero_()
        for i, t in enumerate(tables):
            table_rows[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        self.input_ids[:n].copy_(host[0, :n], non_blocking=True)
        self.positions[:n].copy_(host[1, :n], non_blocking=True)
        self.slots[:n].copy_(host[2, :n], non_blocking=True)
        self.context_lens[:n].copy_(host[3, :n], non_blocking=True)
        self.block_tables[:n, :width].copy_(table_rows, non_blocking=True)
        if self.capture_enabled:
            if n not in self._graphs:
                self._capture(n)
                return self.run(ids, positions, slots, tables, context_lens)  # the capture clobbered the buffers
            graph, logits = self._graphs[n]
            graph.replay()
            return logits[:B]
        return self._forward(n, context_lens + [0] * (n - B))[:B]
