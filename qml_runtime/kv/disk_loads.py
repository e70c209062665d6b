"""Streaming KV blocks in for a sequence (``KVTiers.start_load`` / ``apply_load``).

A restore plan may stream the tail of a history in from disk while the head is recomputed
(``RestorePlanner.plan``). ``start_load`` hands the disk blocks to loader threads, which read them
into host-tier slots held for them (pinned, and the blocks stay in host RAM afterwards) or into
plain rows when there is no host tier; ``apply_load``, once the sequence reaches the streamed
region, copies what landed into its pages (``KVTiers._upload``). A block that is missing or damaged
when read is a miss: the sequence computes it on the page it would have filled. A block whose file the
disk writer has not written yet (a host entry evicted while the disk is busy) is copied from the
writer's own copy instead (``DiskWriter.copy_of``), by a loader thread, as if read.

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
import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from qml_runtime.kv.disk_reader import DiskReader
from qml_runtime.kv.host_tier import slot_runs
from qml_runtime.kv.prefix import unpack

log = logging.getLogger("qml.kv.tiers")

# parallel block reads: the H200 host's disk gave encoded blocks back at 1.94 GB/s of KV with 4 threads,
# 2.22 with 8, 2.17 with 16 (benchmarks/disk_read_h200.py --store)
LOADER_THREADS = 8
# where a load's disk blocks are read: "process" (``kv.disk_reader``: a child process reads them into the host
# tier's shared rows, off this process's GIL), or "threads" (loader threads here, as with no host tier)
READER = os.environ.get("QML_DISK_READER", "process")
# ``cut_load`` (QML_RESTORE_CUT=1): off until measured right on a GPU. Its first run there (session 33) cut loads
# ~100 ms into their turns, when the head's step had been launched but not run (a chunk that samples nothing
# returns at its launch), and the cut blocks, computed as a chunk after a 20k-token head, took the turns to
# 1.0-2.4 s against ~1.0 s to recompute everything (sessions-h100-2026-12-06b.md). It now waits for the compute
# stream to be idle; whether its estimate of that chunk holds is not measured yet.
CUT = os.environ.get("QML_RESTORE_CUT") == "1"


@dataclass
class _Landing:
    """The results of one load's reads in the reader process, as they come (on its listener thread)."""

    left: int
    ok: dict = field(default_factory=dict)
    first: float = float("inf")
    last: float = 0.0
    kv_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


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
    landing: _Landing | None = None  # the reader process's results as they come (its loads only)
    cut: int | None = None  # ``cut_load``: only the blocks before this one are taken (the rest is computed)
    given: set = field(default_factory=set)  # blocks whose host slots were given back (``_give_back``)

    @property
    def future(self) -> Future:
        """A future that is done when the last read is (for waiting on any load)."""
        return next((f for f in self.futures if not f.done()), self.futures[-1])

    def done(self) -> bool:
        return all(f.done() for f in self.futures)


def _file_tokens(packed: bytes) -> bytes:
    """Packed tokens (native uint32) as the block files store them (little-endian)."""
    return packed if sys.byteorder == "little" else np.frombuffer(packed, np.uint32).astype("<u4").tobytes()


def _copy_in(out: torch.Tensor, held: tuple) -> bool:
    """A block the disk writer holds (``DiskWriter.copy_of``: its bytes, and the event after which they are
    valid) into a host row; False when the copy failed (a restore is a cache read: a miss). Gathered pages are
    on the device: copied on a side stream (the default stream would wait for the compute stream's steps),
    done before this returns."""
    data, ready = held
    try:
        if not data.is_cuda:
            if ready is not None:  # (a copy down into it)
                ready.synchronize()
            out.copy_(data)
            return True
        stream = torch.cuda.Stream(data.device)
        if ready is not None:
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            out.copy_(data, non_blocking=True)
        stream.synchronize()
        return True
    except Exception:
        log.exception("restore: a block held by the disk writer could not be copied")
        return False


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
        reader = self._disk_reader() if reads and all(isinstance(dest[i], int) for i in reads) else None
        if reader is not None:
            done: Future = Future()
            load = PendingLoad(start, end, pages, names, tokens, tiers, dest, [done], time.perf_counter())
            self._read_in_child(reader, load, reads, done)
            return load
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

    def _disk_reader(self) -> DiskReader | None:
        """The reader process (started with the tiers, or here), None: read on threads (asked for, no shared host
        rows, or the process failed)."""
        if self._reader is None and READER == "process" and self.host is not None and self.host.fd is not None:
            try:
                self._reader = DiskReader(self.host.fd, self.host.capacity * self.host.block_bytes,
                                          self.disk.fingerprint, LOADER_THREADS)
            except OSError as exc:
                log.warning("disk reader process could not start (%s): reading on threads", exc)
                self._reader = False
        return self._reader if self._reader and self._reader.alive else None

    def _read_in_child(self, reader: DiskReader, load: PendingLoad, reads: list[int], done: Future) -> None:
        """Send the load's disk reads to the reader process; ``done`` gets {block index: read ok} once all
        are answered (``_landed``). Blocks the index no longer holds are misses without a read."""
        row = self.host.block_bytes
        sent, landing = [], _Landing(len(reads))
        load.landing = landing
        self._writer.reads_started()  # (writes wait for the reads)
        for i in reads:
            path, held = self.disk.read_path(load.names[i]), None
            if path is None:
                held = self._writer.copy_of(load.names[i], load.tokens[i])  # (its file not written yet)
                if held is None:
                    path = self.disk.read_path(load.names[i])  # (or written just now)
            if path is None:
                if held is None:
                    self._landed(load, landing, done, i, (None, "absent", 0, 0, None, 0.0, 0.0, ""))
                else:  # copied on a loader thread (2 MiB a Llama-3.1-8B page), not on the engine thread
                    self._loader.submit(self._copy_held, held, load.dest[i],
                                        functools.partial(self._landed, load, landing, done, i))
            else:
                sent.append((i, (path, load.names[i], _file_tokens(load.tokens[i]), load.dest[i] * row, row)))
        if sent:
            reader.read([r for _, r in sent],
                        [functools.partial(self._landed, load, landing, done, i) for i, _ in sent])

    def _landed(self, load: PendingLoad, landing: _Landing, done: Future, i: int, result: tuple) -> None:
        """One block's read ended in the reader process (its listener thread; or here, for a block not sent)."""
        _, status, file_bytes, kv_bytes, ino, t0, t1, reason = result
        if status == "ok":
            self.disk.note_read(load.names[i], file_bytes, kv_bytes)
        elif status in ("corrupt", "gone"):
            self.disk.note_failed(load.names[i], ino, reason)
        elif status == "error":
            log.warning("disk reader process: block %s not read: %s", load.names[i].hex()[:16], reason)
        with landing.lock:
            # ("copied": from the writer's copy, which landed and says nothing of the disk's rate)
            landing.ok[i] = status in ("ok", "copied")
            if status == "ok":
                landing.first, landing.last = min(landing.first, t0), max(landing.last, t1)
                landing.kv_bytes += kv_bytes
            landing.left -= 1
            last = landing.left == 0
        if last:
            self._writer.reads_done()
            if landing.kv_bytes and landing.last > landing.first:
                self.planner.observe("disk", landing.kv_bytes, landing.last - landing.first)
            done.set_result(dict(landing.ok))

    def _copy_held(self, held: tuple, slot: int, landed) -> None:
        """Loader thread: a block the disk writer still holds (``DiskWriter.copy_of``) into its host slot, then
        ``landed`` is told, as for a read."""
        copied = _copy_in(self.host.slots[slot], held)
        landed((None, "copied" if copied else "error", 0, 0, None, 0.0, 0.0, "copy failed"))

    def cut_load(self, load: PendingLoad) -> bool:
        """``load``'s sequence has computed everything before it and the reads are not all in: when computing the
        blocks that have not landed is expected to end sooner than waiting for them (at the rate this load's
        reads have come in so far), the leading blocks that landed are kept and the rest are cut (``apply_load``
        copies those; the sequence computes the others, as after a miss). True once cut. Only a load of the
        reader process, whose blocks land one by one, in about the order sent.

        Why: a split is planned from the disk's measured rate, and a disk that reads slower than that (a busy
        disk, an H100 host's at 0.5 GB/s against 1.1 probed) left the turn waiting for its tail, slower than
        recomputing everything (1,382 ms against 1,001: sessions-h100-2026-12-06b.md). Cut there, the turn
        costs at most about what the recompute of the late part does, beside what had landed."""
        landing = load.landing
        if load.cut is not None:
            return True
        if not CUT or landing is None or load.done():
            return False
        if self._cuda and not torch.cuda.current_stream(self.kv.data.device).query():
            return False  # the head is launched, not run: its time is still the reads' too
        with landing.lock:
            ok, got, first = dict(landing.ok), landing.kv_bytes, landing.first
        n = len(load.names)
        lead = next((i for i in range(n) if load.tiers[i] == "disk" and isinstance(load.dest[i], int)
                     and not ok.get(i, False)), n)
        waiting = sum(1 for i in range(lead, n) if load.tiers[i] == "disk" and i not in ok)
        if lead == n or not waiting:
            return False  # everything is in, or answered: the load is done now
        if ok.get(lead) is not False:  # (a miss there: nothing after it is taken anyway; cut at once)
            # the rate since the first read began (the child's clock is this one: CLOCK_MONOTONIC), not since the
            # load's start (a child still starting up is not a slow disk); a stall after that lowers it
            elapsed = time.perf_counter() - first
            rate = got / elapsed if got > 0 and elapsed > 0 else self.planner.disk_bytes_per_s
            wait = waiting * self.block_bytes / rate
            bt = (load.end - load.start) // n
            if self.planner.prefill_seconds(load.start + lead * bt, (n - lead) * bt) >= wait:
                return False
        load.cut = lead
        self.stats.cuts += 1
        self.stats.skipped_disk += load.tiers[lead:].count("disk")
        log.info("restore: %d of %d blocks streaming from disk still out %.0f ms after the start: the %d blocks "
                 "from block %d on are computed instead", waiting, n, (time.perf_counter() - load.t0) * 1e3,
                 n - lead, lead)
        return True

    def _read_disk(self, part: list, parts: int = 1) -> dict[int, bool]:
        """Loader thread: read blocks in order into their destinations; stops at the first miss. The rate
        learnt is this thread's times ``parts`` (not the load's bytes over its time: its plans were
        slower, sessions-h200-2026-12-02b.md)."""
        ok, t0 = {}, time.perf_counter()
        try:
            for i, name, toks, dest in part:
                out = self.host.slots[dest] if isinstance(dest, int) else dest
                ok[i] = self.disk.get_into(name, unpack(toks), out)
                if not ok[i] and not self.disk.contains(name):  # its file not written yet: the writer's copy
                    held = self._writer.copy_of(name, toks)
                    if held is not None:
                        ok[i] = _copy_in(out, held)
                    elif self.disk.contains(name):  # (or written just now)
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
        if i in load.given:
            return
        load.given.add(i)
        self.host.release(load.dest[i])
        if not read:
            self.host.discard(load.names[i])

    def apply_load(self, load: PendingLoad) -> int:
        """Copy a finished load's blocks into its pages; returns how many leading blocks landed.
        Blocks read into host slots stay there (released for eviction); failed reads are forgotten.
        A prefetched load was copied already: its held events go to the pool."""
        self._reap_dropped()
        if load.prefetch:
            if load.held is not None:
                self.kv.restore_events(*load.held)
            self.stats.restored_host += load.copied
            self.stats.restore_seconds += time.perf_counter() - load.t0
            return load.copied
        ok: dict[int, bool] = {}
        cut = load.cut
        if cut is None:
            for f in load.futures:
                ok.update(f.result())
        else:  # (the blocks before the cut are in; the slots of later ones go back once their reads end)
            with load.landing.lock:
                ok = {i: v for i, v in load.landing.ok.items() if i < cut}
            self._dropped.append(load)
        landed, sources = len(load.names) if cut is None else cut, []
        for i, tier in enumerate(load.tiers):
            dest = load.dest[i]
            if tier == "disk" and dest is not None:
                if isinstance(dest, int) and (cut is None or i < cut):  # (past a cut: once read)
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
