"""The disk tier's background writer: blocks handed over by the engine thread are copied down (when
they are gathered GPU pages) and written as files, on ``WRITER_THREADS`` threads, off the request's
critical path. One thread (encoding, checksum, fsync: ~0.37 GB/s of KV on the H200 host) fell behind
a burst of long prompts by the 4 GiB it may hold, and skipped their write-through; the threads share
the disk's ~0.7-0.8 GB/s of writes (benchmarks/results/disk-read-h200-2026-12-02.md).

Two kinds of work arrive (``KVTiers`` queues them):
- ``put_pages``: a finished request's pages gathered into a GPU staging buffer (write-through). The
  writer copies them through a pinned bounce buffer on its own stream (not behind the compute
  stream's work), then writes each page as a file.
- ``put_block``: one host tensor the writer owns (a host-RAM entry evicted to make room), or, with
  ``borrowed``, a row of the host tier itself (a kept page written through from its host copy, with
  no device gather and no second copy down): the tier must not reuse the row before the write has
  read it, and ``detach`` (the tier calls it when the row is about to take other bytes) turns a
  borrowed block not yet written into an owned copy, or waits for the write that is reading it.

A block the writer owns is in no other tier until its file lands (its host entry gave the row up):
``copy_of`` hands its bytes to a restore meanwhile, which would otherwise find the block nowhere and
compute that part of the history again (``DiskLoads.start_load`` puts them back into host RAM).

``pending_bytes`` counts every byte handed over and not yet written (staging, owned blocks, borrowed rows),
so the engine can skip a write-through, and drop a host entry it evicts rather than copy it for the writer,
when the disk falls behind. A write is a cache fill: a failure is logged and never stops the writer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.prefix import as_packed, unpack

log = logging.getLogger("qml.kv.tiers")

BOUNCE_PAGES = 64  # the pinned buffer between GPU staging and files (128 MiB at 2 MiB pages), one a thread
WRITER_THREADS = 4
# a block's write waits while restores read from disk (the request waits on those reads; a write is a
# cache fill), until they have been reading for this long without a pause (back-to-back restores must
# not stop the writes): on the H200 the second user's disk turn, right after the first user's 27k-token
# prompt had queued 3.5 GB of writes (~0.7 GB/s), took 824-939 ms against 766-843
READS_FIRST_MAX_S = 2.0
# a block's write also waits while the engine thread schedules and launches a step (``hold``): the writers'
# Python (between the encoding's and the file's calls, which release the GIL) took the GIL from the engine
# thread at every kernel launch, which releases it. Those windows are short (the device then runs the step
# and the writers have the host), but a long one must not stop the writes either: held longer than this
# without a pause, the writes go on
HOLD_MAX_S = 0.25


class _Block:
    """One block for ``put_block``: ``data`` owned, or ``borrowed`` (a host-tier row) until written or detached."""

    __slots__ = ("name", "tokens", "data", "parent", "ready", "borrowed", "writing", "dropped")

    def __init__(self, name: bytes, tokens: bytes, data: torch.Tensor, parent: bytes | None, ready, borrowed: bool):
        self.name, self.tokens, self.data, self.parent, self.ready = name, tokens, data, parent, ready
        self.borrowed, self.writing, self.dropped = borrowed, False, False


class _Stretch:
    """A count of things in force (restores' reads, the engine's holds) and when the current unbroken
    stretch of them began: writes wait for it to end, or until it has lasted its longest."""

    __slots__ = ("count", "since")

    def __init__(self):
        self.count, self.since = 0, 0.0

    def begin(self) -> None:
        if not self.count:
            self.since = time.monotonic()
        self.count += 1

    def end(self) -> bool:
        """True when none is left in force."""
        self.count -= 1
        return not self.count

    def until(self, now: float, longest: float) -> float | None:
        """When writes may go (None: now)."""
        return self.since + longest if self.count and now < self.since + longest else None


class DiskWriter:
    def __init__(self, disk: DiskStore, block_bytes: int, stats, threads: int = WRITER_THREADS,
                 backlog_bytes: int | None = None):
        """``stats``: the tiers' counters (``written_disk`` counts the blocks written, ``persist_skipped``
        those dropped). ``backlog_bytes``: past this many bytes held for writing, ``detach`` drops the
        block rather than copying its row (None: never)."""
        self.disk, self.block_bytes, self.stats = disk, block_bytes, stats
        self.backlog_bytes = backlog_bytes
        # bytes handed over and not yet written: gathered pages, owned blocks and borrowed rows alike (the
        # engine skips write-throughs past a budget of them; owned copies left out of the count piled up
        # unseen, 2 MiB each, while the disk was behind)
        self.pending_bytes = 0
        self._lock = threading.Lock()  # pending_bytes, the stats, and the names being written
        self._writing: set[bytes] = set()  # a block queued twice is written once, by one thread
        # handed over and not yet written (or failed): the engine hands a block over once, not once per
        # request that kept it (a conversation's history, kept again at each turn's end while the disk
        # is behind, was gathered on the device and queued again each time)
        self._queued: set[bytes] = set()
        self._borrowed: dict[bytes, _Block] = {}  # blocks whose data is a host-tier row, until written or detached
        self._owned: dict[bytes, _Block] = {}  # blocks whose data is the writer's own copy, until written (``copy_of``)
        self._block_done = threading.Condition(self._lock)  # a borrowed block's write ended
        self._reads = _Stretch()  # disk reads of restores in flight (``reads_started``/``reads_done``)
        self._holds = _Stretch()  # the engine thread's holds (``hold``/``release``) in force
        self._no_reads = threading.Condition(self._lock)  # reads or holds ended
        self._local = threading.local()  # each thread's bounce buffer and stream, made at its first GPU pages
        self._queue: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._loop, name=f"qml-kv-writer-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def put_pages(self, staging: torch.Tensor, ready, blocks: list[tuple[bytes, bytes, bytes | None]]) -> None:
        """Gathered pages (one row each) and their (name, packed tokens, parent name), valid once
        ``ready`` (an event, or None) has passed."""
        rows = [_Block(name, tokens, staging[i], parent, ready, False)
                for i, (name, tokens, parent) in enumerate(blocks)]
        with self._lock:
            self.pending_bytes += staging.numel()
            self._queued.update(name for name, _, _ in blocks)
            self._owned.update((row.name, row) for row in rows)
        self._queue.put(("pages", staging, ready, rows))

    def put_block(self, name: bytes, tokens: bytes, data: torch.Tensor, parent: bytes | None, ready,
                  borrowed: bool = False) -> None:
        """One host tensor the writer owns from now on (valid once ``ready`` has passed); ``borrowed``: a
        host-tier row, read in place until ``detach``. Its bytes count in ``pending_bytes`` until written."""
        block = _Block(name, tokens, data, parent, ready, borrowed)
        with self._lock:
            self._queued.add(name)
            if borrowed:
                self._borrowed[name] = block
            else:
                self._owned[name] = block
            self.pending_bytes += data.numel()
        self._queue.put(("block", block))

    def detach(self, name: bytes) -> None:
        """The host row that borrowed block ``name`` reads is about to take other bytes: a block not yet
        being written gets its own copy of the row now, or is dropped when more than ``backlog_bytes``
        wait to be written (a cache fill the disk cannot keep up with; the copy was 2 MiB of the engine
        thread's time a Llama-3.1-8B page); one being written is waited for."""
        with self._lock:
            block = self._borrowed.get(name)
            while block is not None and block.writing:
                self._block_done.wait()
                block = self._borrowed.get(name)
            if block is None:
                return
            del self._borrowed[name]
            block.borrowed = False
            if self.backlog_bytes is not None and self.pending_bytes > self.backlog_bytes:
                block.dropped = True  # the thread that takes it skips it
                self._queued.discard(name)
                self.pending_bytes -= block.data.numel()
                self.stats.persist_skipped += 1
                return
            if block.ready is not None:
                block.ready.synchronize()  # the row's copy down has landed
            block.data, block.ready = block.data.clone(), None
            self._owned[name] = block

    def copy_of(self, name: bytes, tokens):
        """(bytes, ready) of block ``name`` (packed ``tokens``, checked) while the writer holds its own copy, not
        yet in a file: an evicted host entry, a borrowed row detached, or a row of gathered pages (on the
        device, valid once the event ``ready`` has passed; None: now). None: no such copy (never handed over,
        written, or dropped). Read-only: the write may be reading it too."""
        with self._lock:
            block = self._owned.get(name)
        if block is None or block.tokens != bytes(as_packed(tokens)):
            return None
        return block.data, block.ready

    def reads_started(self) -> None:
        """A restore's reads begin: writes not yet begun wait for them (up to ``READS_FIRST_MAX_S`` after
        the reads in flight began)."""
        self._begin(self._reads)

    def reads_done(self) -> None:
        self._end(self._reads)

    def hold(self) -> None:
        """The engine thread schedules and launches a step: writes not yet begun wait until ``release``
        (or ``HOLD_MAX_S`` after the holds in force began)."""
        self._begin(self._holds)

    def release(self) -> None:
        self._end(self._holds)

    def _begin(self, stretch: _Stretch) -> None:
        with self._lock:
            stretch.begin()

    def _end(self, stretch: _Stretch) -> None:
        with self._lock:
            if stretch.end():
                self._no_reads.notify_all()

    def _wait_turn(self) -> None:
        """(Under the lock) until no reads nor holds are in force, or they have been for their longest."""
        while True:
            now = time.monotonic()
            ends = (self._reads.until(now, READS_FIRST_MAX_S), self._holds.until(now, HOLD_MAX_S))
            until = max((u for u in ends if u is not None), default=None)
            if until is None:
                return
            self._no_reads.wait(timeout=until - now)

    def queued(self, name: bytes) -> bool:
        """Whether ``name`` was handed over and its write has not ended yet."""
        with self._lock:
            return name in self._queued

    def join(self) -> None:
        """Wait until everything queued so far is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the threads."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            try:
                if item[0] == "block":
                    self._write_block(item[1])
                else:
                    self._write_pages(*item[1:])
            except Exception:  # a write is a cache fill: log it, never stop the writer
                log.exception("disk tier: a background write failed")
            finally:
                self._queue.task_done()

    def _write_block(self, block: _Block) -> None:
        with self._lock:
            if block.dropped:  # detached while the disk was behind: its bytes were given up
                return
            block.writing = block.borrowed  # detach waits for it from now on
        try:
            if block.ready is not None:
                block.ready.synchronize()
            self._write_one(block.name, block.tokens, block.data, block.parent)
        finally:
            with self._lock:
                if self._borrowed.get(block.name) is block:
                    del self._borrowed[block.name]
                self._disown(block)
                self.pending_bytes -= block.data.numel()
                block.writing = False
                self._block_done.notify_all()

    def _write_one(self, name: bytes, tokens: bytes, data: torch.Tensor, parent: bytes | None) -> None:
        # queued twice before the first landed: one write is enough (and counts once)
        with self._lock:
            if name in self._writing or self.disk.contains(name):
                self._queued.discard(name)
                return
            self._writing.add(name)
            self._wait_turn()
        written = False
        try:
            written = self.disk.put(name, parent, unpack(tokens), data)  # never raises: a failure is a later miss
        finally:
            with self._lock:
                self._writing.discard(name)
                self._queued.discard(name)
                if written:
                    self.stats.written_disk += 1

    def _write_pages(self, staging: torch.Tensor, ready, rows: list[_Block]) -> None:
        """Copy gathered pages down through the pinned bounce buffer, then to files."""
        try:
            if ready is not None:
                ready.synchronize()
            if not staging.is_cuda:
                for i, row in enumerate(rows):
                    self._write_one(row.name, row.tokens, staging[i], row.parent)
                    with self._lock:
                        self._disown(row)
                return
            local = self._local
            if getattr(local, "bounce", None) is None:
                local.bounce = torch.empty((BOUNCE_PAGES, self.block_bytes), dtype=torch.uint8, pin_memory=True)
                local.stream = torch.cuda.Stream(staging.device)  # not behind the compute stream's work
            for i in range(0, len(rows), BOUNCE_PAGES):
                n = min(BOUNCE_PAGES, len(rows) - i)
                with torch.cuda.stream(local.stream):
                    local.bounce[:n].copy_(staging[i:i + n], non_blocking=True)
                local.stream.synchronize()  # the buffer is reused next round
                for j in range(n):
                    row = rows[i + j]
                    self._write_one(row.name, row.tokens, local.bounce[j], row.parent)
                    with self._lock:
                        self._disown(row)
        finally:
            with self._lock:
                self.pending_bytes -= staging.numel()
                for row in rows:  # (those not written: a failure)
                    self._disown(row)
            del staging, rows

    def _disown(self, block: _Block) -> None:
        """(Under the lock) ``block``'s write ended: its file is there (or failed, a miss), so ``copy_of`` no
        longer hands its bytes out (a newer block of the same name stays)."""
        if self._owned.get(block.name) is block:
            del self._owned[block.name]
