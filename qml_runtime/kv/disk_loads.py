"""Streaming KV blocks in from disk for a sequence (``KVTiers.start_load`` / ``apply_load``).

A restore plan may stream the tail of a history in from disk while the head is recomputed
(``RestorePlanner.plan``). ``start_load`` hands the disk blocks to loader threads, which read them
into host-tier slots held for them (pinned, and the blocks stay in host RAM afterwards) or into
plain rows when there is no host tier; ``apply_load``, once the sequence reaches the streamed
region, copies what landed into its pages (``KVTiers._upload``). A block that is missing or damaged
when read is a miss: the sequence computes it on the page it would have filled.

``DiskLoads`` is a part of ``KVTiers`` (a mixin: it uses the tiers' host tier, disk store, writer,
loader pool, planner and stats), kept in its own file so that the tiers' module stays about one
concern, the copies between the GPU pages and the tiers below.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from qml_runtime.kv.prefix import unpack

# parallel block reads: the H200 host's disk gave encoded blocks back at 1.94 GB/s of KV with 4 threads,
# 2.22 with 8, 2.17 with 16 (benchmarks/disk_read_h200.py --store)
LOADER_THREADS = 8


@dataclass
class PendingLoad:
    """Blocks streaming in for a sequence: tokens [start, end) of it, into ``pages``."""

    start: int
    end: int
    pages: list[int]
    names: list[bytes]
    tokens: list[bytes]
    tiers: list[str]
    dest: list  # per block: a host-tier slot (int) it is read into, a host row tensor, or None (a host block)
    futures: list[Future]  # each -> {block index: read ok} for its share of the disk blocks
    t0: float

    @property
    def future(self) -> Future:
        """A future that is done when the last read is (for waiting on any load)."""
        return next((f for f in self.futures if not f.done()), self.futures[-1])

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class DiskLoads:
    def start_load(self, blocks: list[tuple[str, bytes, bytes]], pages: list[int], start: int,
                   end: int) -> PendingLoad:
        """Stream blocks (tier, name, packed tokens) in: disk blocks are read by loader threads into host-tier
        slots held for them (pinned memory, and the blocks stay in host RAM afterwards), or into
        plain host rows when there is no host tier; host blocks are copied from their slots when the
        load is applied."""
        tiers = [t for t, _, _ in blocks]
        names = [n for _, n, _ in blocks]
        tokens = [t for _, _, t in blocks]
        dest: list = [None] * len(blocks)
        reads = []
        for i, tier in enumerate(tiers):
            if tier != "disk" or self.disk is None:
                continue
            slot = None
            if self.host is not None and self.host.capacity > 0:
                if self.host.find(names[i], tokens[i]) is not None:
                    tiers[i] = "host"  # it came up to host RAM since the plan
                    continue
                slot = self._reserve_host(names[i], tokens[i])
            if slot is not None:
                self.host.hold(slot)
                dest[i] = slot
            else:
                dest[i] = torch.empty(self.block_bytes, dtype=torch.uint8)
            reads.append(i)
        futures = []
        share = -(-len(reads) // LOADER_THREADS) if reads else 0
        parts = -(-len(reads) // share) if reads else 0
        for k in range(0, len(reads), max(share, 1)):
            part = [(i, names[i], tokens[i], dest[i]) for i in reads[k:k + share]]
            self._writer.reads_started()  # (writes wait for the reads)
            futures.append(self._loader.submit(self._read_disk, part, parts))
        if not futures:
            done: Future = Future()
            done.set_result({})
            futures = [done]
        return PendingLoad(start, end, pages, names, tokens, tiers, dest, futures, time.perf_counter())

    def _read_disk(self, part: list, parts: int = 1) -> dict[int, bool]:
        """Loader thread: read blocks in order into their destinations; stops at the first miss. The rate
        learnt is this thread's times ``parts`` (not the load's bytes over its time: its plans were
        slower, sessions-h200-2026-12-02b.md)."""
        ok, t0 = {}, time.perf_counter()
        try:
            for i, name, toks, dest in part:
                out = self.host.slots[dest] if isinstance(dest, int) else dest
                ok[i] = self.disk.get_into(name, unpack(toks), out)
                if not ok[i]:
                    break
        finally:
            self._writer.reads_done()
        read = sum(ok.values())
        if read:
            self.planner.observe("disk", read * self.block_bytes * parts, time.perf_counter() - t0)
        return ok

    def apply_load(self, load: PendingLoad) -> int:
        """Copy a finished load's blocks into its pages; returns how many leading blocks landed.
        Blocks read into host slots stay there (released for eviction); failed reads are forgotten."""
        ok: dict[int, bool] = {}
        for f in load.futures:
            ok.update(f.result())
        landed, sources = len(load.names), []
        for i, tier in enumerate(load.tiers):
            dest = load.dest[i]
            if tier == "disk" and dest is not None:
                if isinstance(dest, int):
                    self.host.release(dest)
                    if not ok.get(i, False):
                        self.host.discard(load.names[i])  # its slot holds a partial or no read
                if not ok.get(i, False):
                    landed = min(landed, i)
                if i < landed:
                    sources.append((self.host.slots, i, dest, 1) if isinstance(dest, int)
                                   else (dest.view(1, -1), i, 0, 1))
            elif i < landed:  # a host block: still there?
                slot = self.host.find(load.names[i], load.tokens[i]) if self.host is not None else None
                if slot is None:
                    landed = i
                else:
                    sources.append((self.host.slots, i, slot, 1))
        sources = [src for src in sources if src[1] < landed]
        if landed:
            self._upload(load.pages[:landed], sources)
            self.stats.restored_disk += sum(1 for t in load.tiers[:landed] if t == "disk")
            self.stats.restored_host += sum(1 for t in load.tiers[:landed] if t == "host")
        self.stats.restore_seconds += time.perf_counter() - load.t0
        if "disk" in load.tiers:
            self.save_rates()  # a small file, once per load: a killed server keeps its last measurements
        return landed
