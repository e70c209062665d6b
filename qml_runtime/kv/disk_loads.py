"""Streaming KV blocks in for a sequence (``KVTiers.start_load`` / ``apply_load``).

A restore plan may stream the tail of a history in from disk while the head is recomputed
(``RestorePlanner.plan``). ``start_load`` hands the disk blocks to loader threads, which read them
into host-tier slots held for them (pinned, and the blocks stay in host RAM afterwards) or into
plain rows when there is no host tier; ``apply_load``, once the sequence reaches the streamed
region, copies what landed into its pages (``KVTiers._upload``). A block that is missing or damaged
when read is a miss: the sequence computes it on the page it would have filled.

A tail that is all in host RAM (``Plan.prefetch``) is copied from the start, beside the recompute of
the head: its layer events are held by the load, not handed to the pool (the head's steps do not read
those pages and must not wait for them), until ``apply_load`` hands them over for the turn's step to
wait on layer by layer. A sequence that leaves with a load unapplied (``drop_load``) has the compute
stream wait for its copy before its pages go to anyone else, and its disk reads release their host slots
once they end.

``DiskLoads`` is a part of ``KVTiers`` (a mixin: it uses the tiers' host tier, disk store, writer,
loader pool, planner and stats), kept in its own file so that the tiers' module stays about one
concern, the copies between the GPU pages and the tiers below.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from qml_runtime.kv.host_tier import slot_runs
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
    prefetch: bool = False  # host blocks copied from the start (a split of a host-RAM history)
    copied: int = 0  # of which found and copied (the leading ones)
    held: tuple | None = None  # (layer events, restore number) of that copy, for the turn's step

    @property
    def future(self) -> Future:
        """A future that is done when the last read is (for waiting on any load)."""
        return next((f for f in self.futures if not f.done()), self.futures[-1])

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


class DiskLoads:
    def start_load(self, blocks: list[tuple[str, bytes, bytes]], pages: list[int], start: int,
                   end: int, prefetch: int | None = None) -> PendingLoad:
        """Stream blocks (tier, name, packed tokens) in: disk blocks are read by loader threads into host-tier
        slots held for them (pinned memory, and the blocks stay in host RAM afterwards), or into
        plain host rows when there is no host tier; host blocks are copied from their slots when the
        load is applied. ``prefetch``: the blocks are all in host RAM, ``prefetch`` blocks into the run
        ``locate_run`` found last; they are copied now (``Plan.prefetch``)."""
        tiers = [t for t, _, _ in blocks]
        names = [n for _, n, _ in blocks]
        tokens = [t for _, _, t in blocks]
        self._reap_dropped()
        if prefetch is not None:
            return self._prefetch(names, tokens, pages, start, end, prefetch)
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
                dest[i] = torch.empty(self.row_bytes, dtype=torch.uint8)
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

    def _prefetch(self, names: list[bytes], tokens: list[bytes], pages: list[int], start: int, end: int,
                  offset: int) -> PendingLoad:
        slots = self._host_slots(names, b"".join(tokens), offset)
        held = None
        if slots:
            held = self._upload(pages[:len(slots)], [(self.host.slots, i, s, n) for i, s, n in slot_runs(slots)],
                                hold=True)
        done: Future = Future()
        done.set_result({})
        return PendingLoad(start, end, pages, names, tokens, ["host"] * len(names), [None] * len(names), [done],
                           time.perf_counter(), prefetch=True, copied=len(slots), held=held)

    def copying(self, loads: list[PendingLoad]) -> bool:
        """A held copy of one of ``loads`` is still running (a step now runs beside it)."""
        return any(load.held is not None and not load.held[0][-1].query() for load in loads)

    def drop_load(self, load: PendingLoad) -> None:
        """Its sequence leaves before the load is applied (preempted, finished, aborted): its pages may be
        taken at once, so the compute stream waits for a held copy into them (no host wait), and held host
        slots are released once their reads end (``_reap_dropped``)."""
        if load.held is not None:
            self.kv._wait(load.held[0][-1])
        if any(isinstance(d, int) for d in load.dest):
            self._dropped.append(load)
        self._reap_dropped()

    def _reap_dropped(self) -> None:
        still = []
        for load in self._dropped:
            if not load.done():
                still.append(load)
                continue
            ok: dict[int, bool] = {}
            for f in load.futures:
                with contextlib.suppress(Exception):
                    ok.update(f.result())
            for i, dest in enumerate(load.dest):
                if isinstance(dest, int):
                    self._give_back(load, i, ok.get(i, False))
        self._dropped = still

    def _give_back(self, load: PendingLoad, i: int, read: bool) -> None:
        """Block i's host slot, held for its disk read, may be evicted again; a failed read is forgotten
        (its slot holds a partial read or none)."""
        self.host.release(load.dest[i])
        if not read:
            self.host.discard(load.names[i])

    def apply_load(self, load: PendingLoad) -> int:
        """Copy a finished load's blocks into its pages; returns how many leading blocks landed.
        Blocks read into host slots stay there (released for eviction); failed reads are forgotten.
        A prefetched load was copied already: its held events go to the pool."""
        if load.prefetch:
            if load.held is not None:
                self.kv.restore_events(*load.held)
            self.stats.restored_host += load.copied
            self.stats.restore_seconds += time.perf_counter() - load.t0
            return load.copied
        ok: dict[int, bool] = {}
        for f in load.futures:
            ok.update(f.result())
        landed, sources = len(load.names), []
        for i, tier in enumerate(load.tiers):
            dest = load.dest[i]
            if tier == "disk" and dest is not None:
                if isinstance(dest, int):
                    self._give_back(load, i, ok.get(i, False))
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
