"""The KV tiers below the GPU pages: host RAM (warm) and local disk (cold, survives restarts).

Down: a finished request's pages get host RAM slots when it ends (``persist``; copied down in
chunks between steps by ``pump``), and a cached GPU page about to be reused is copied there if
it is not there yet; a host page pushed out of its budget goes to disk. A finished request's
pages are also written through to disk in the background, so a conversation survives a restart.

Up: when a request's prompt runs past the pages cached on the GPU, the next blocks are
looked up by name in host RAM, then on disk, and copied into fresh GPU pages, as far as
the plan (``qml_runtime.kv.planner.RestorePlanner.plan``) says that beats computing them again.

Copies are batched and ordered on CUDA streams, never one synchronous copy per page
(2 MiB pages of Llama-3.1-8B: a 27k-token history is ~1,700 of them):

- a finished request's pages (kept, deferred) go down by ``pump``: the pinned host rows are written
  in place by a kernel on a side stream (``qml_kernels.page_save``), between decode steps, while
  idle, and beside a long prefill (as much as the link moves in half of it), so that a burst of
  prompts leaves no backlog for the turn after it to copy while it restores;
- spills are recorded while the scheduler evicts pages, then ``flush_spills`` gathers the
  pages on the GPU into one staging buffer (one kernel, on the compute stream, ahead of the
  step that overwrites them) and a side stream copies it down to the host slots while the
  GPU computes; a CPU reader of a host slot waits for the copies into it first (``_settle_slot``);
- writes to disk (spilled host pages, finished requests) are gathered the same way into
  pinned buffers and written by a thread that waits on the copy's event;
- restores from the (pinned) host tier read the host rows in place, one kernel per layer
  (``qml_kernels.page_copy``) on a restore stream, with an event per layer that the prefill
  waits for before reading that layer (``KVCache.layer``): the turn's compute runs beside the
  copy. Rows in plain memory (a disk read with no host tier) go through a GPU staging buffer
  scattered into the pages on the compute stream (``qml_runtime.kv.host_restores``);
- disk reads run on a loader thread into pinned memory while the GPU works: with a split
  plan the engine recomputes the head of the history while the tail streams in
  (``qml_runtime.kv.disk_loads``).

Blocks' tokens travel packed (``kv.prefix.pack``), as the GPU pages and the host tier keep them;
the disk store is handed the ids (``unpack``) when a block is written or read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter

import torch

from qml_runtime.kv.block_manager import Evicted
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_loads import LOADER_THREADS, DiskLoads
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.disk_writer import DiskWriter
from qml_runtime.kv.host_restores import MAX_BATCH_PAGES, HostRestores, int64_rows
from qml_runtime.kv.host_tier import HostTier, slot_runs
from qml_runtime.kv.host_writes import HostWrites
from qml_runtime.kv.planner import RestorePlanner
from qml_runtime.kv.planner_rates import load_rates, needs_probe, probe_disk, save_rates
from qml_runtime.kv.spill_queue import SpillQueue

log = logging.getLogger("qml.kv.tiers")

# a finished request's pages go down to host RAM this many bytes at a time, one chunk on the link at
# once, between steps (``KVTiers.pump``): ~2.5 ms at 51 GB/s, the most a restore that arrives then
# shares the link with
PUMP_BYTES = 128 << 20
# beside a prefill step, the pump queues what the link moves in this share of the step's expected time
PUMP_SHARE = 0.5
# the pump's in-place copies (page_save): a quarter of the restore's programs, as they run beside a
# prefill that wants the SMs (stores to host memory are posted: few programs keep the link busy)
SAVE_PROGRAMS = 16
# bytes waiting for the disk writer (``pending_write_bytes``); past it the disk is behind: a persist is not written
# through, and a host entry evicted before its write, or a row the writer borrowed, is given up rather than copied
MAX_PENDING_WRITE_BYTES = 4 << 30
# the warning that the disk is behind, at most once in this many seconds (with the pages skipped since the last):
# a served H100 run logged it 1,092 times in 40 s, a line for each chunk of kept pages, on the engine thread
BEHIND_WARN_INTERVAL_S = 30.0


@dataclass
class TierStats:
    restored_host: int = 0  # blocks
    restored_disk: int = 0
    skipped_disk: int = 0  # found on disk, recomputed because the planner said it was faster
    spilled_host: int = 0  # pages copied to host RAM when evicted
    kept_host: int = 0  # pages given host slots when their request ended (copied then or by pump; evicted free)
    written_disk: int = 0
    restore_seconds: float = 0.0
    persist_skipped: int = 0  # pages not written through because the writer was too far behind
    cuts: int = 0  # loads from disk cut short, their late blocks computed instead (``cut_load``)
    plans: dict = field(default_factory=lambda: {"restore": 0, "recompute": 0, "split": 0})
    # the plans' estimates for their histories, and for computing all of each instead (seconds, summed): a
    # turn's delta beside its time to first token says how far the planner's rates were off
    planned_seconds: float = 0.0
    recompute_planned_seconds: float = 0.0


class KVTiers(HostRestores, DiskLoads):  # (restores from host RAM, loads from disk: their own modules)
    def __init__(self, kv: KVCache, host: HostTier | None, disk: DiskStore | None,
                 planner: RestorePlanner | None = None):
        self.kv, self.host, self.disk = kv, host, disk
        self.planner = planner or RestorePlanner()
        self.stats = TierStats()
        self.block_bytes = kv.block_bytes  # KV bytes a page: what the planner and the rates count
        self.row_bytes = kv.row_bytes  # a page as the tiers store it (smaller over the link with the codec)
        self._cuda = kv.data.is_cuda
        self._copy_stream = torch.cuda.Stream(kv.data.device) if self._cuda else None
        # restores from host RAM, layer by layer, beside the compute stream (_upload_layers)
        # at high priority: the turn's prefill kernels fill every SM, and each layer's copy programs
        # should get the next free ones, as the prefill waits for them
        self._restore_stream = torch.cuda.Stream(kv.data.device, priority=-1) if self._cuda else None
        self._dma_stream = None  # the staged restore's 2D copies (QML_RESTORE_STAGED), made at its warm-up
        self._restored = None  # the last restore's final event: the link is busy until then (``pump``)
        # (host slots read, final event) of restores that may still run: a slot is reused only after them
        self._reads: list[tuple[set, object]] = []
        self.layered = True  # host-tier restores by layer, read in place (False: through staging)
        # the device can read the host tier's rows in place (pinned, on a GPU): _upload_layers
        self._in_place = self._cuda and host is not None and host.capacity > 0 and host.pinned
        # kept pages go down by page_save into the pinned rows (``_save_in_place``), else gathered
        # into device staging and copied (``flush_spills``); tests set it on CPU (the reference copies)
        self.save_in_place = self._in_place and os.environ.get("QML_SAVE_IN_PLACE", "1") != "0"
        # the engine pumps kept pages beside a long prefill step (``pages_beside``), not only between steps
        self.pump_beside = os.environ.get("QML_PUMP_BESIDE", "1") != "0"
        # the disk writer's threads wait while the engine thread schedules and launches a step (``hold_writes``)
        self.quiet_writes = os.environ.get("QML_QUIET_WRITES", "1") != "0"
        if self._in_place:
            self._compile_page_copy()
        self._pending = SpillQueue()  # (page, host slot) spilled, not yet copied down
        # finished requests' pages kept in host RAM: a slot is reserved, the copy waits for ``pump``
        # (page -> slot, oldest first, and slot -> page). On the H200 a 3.5 GB restore beside a 3.5 GB
        # copy down took 104 ms against 70 alone, and a history copied down at its end was still on
        # the link when the next turn's restore came.
        self.defer_persist = self._cuda and os.environ.get("QML_DEFER_PERSIST", "1") != "0"
        self._deferred: OrderedDict[int, int] = OrderedDict()
        self._deferred_slots: dict[int, int] = {}
        self._pump_done = None  # the event after the last chunk pump queued
        # page -> (batch number, event) of the pump's in-place copy reading it (may still run). Batches
        # run in order on the copy stream: the newest one known finished (_saved_seq) or already waited
        # for by the compute stream (_waited_seq) covers every older one (``_wait_saved``).
        self._saving: dict[int, tuple[int, object]] = {}
        self._save_seq = self._saved_seq = self._waited_seq = 0
        self.pump_pages = max(1, PUMP_BYTES // self.block_bytes)
        self._behind_warned = None  # when the disk-behind warning was last logged, and pages skipped since
        self._behind_skipped = 0
        # with no host tier: (page, name, packed tokens) spilled straight to disk, not yet gathered
        self._pending_disk: list[tuple[int, bytes, bytes]] = []
        self._host_writes = HostWrites()  # kept pages written through from their host copy (``persist``)
        # host slot -> the copy filling it (may still run). A slot filled again maps to the newer copy,
        # which runs after the older one on the same side stream, so waiting on it covers both.
        self._slot_events: dict[int, object] = {}
        self._timing: list = []  # (start, end events, bytes) of uploads, observed once done
        self._writer = self._loader = None
        # the last host run ``locate_run`` found: (its names, their packed tokens, slots, host.removals then), for
        # ``restore_host`` and a split's copy (``start_load``)
        self._located: tuple[list[bytes], bytes, list[int], int] | None = None
        self._uploads = 0  # restores launched (layered): the later one's events cover the earlier's copies
        # perf_counter when the last restore's first copy was queued: a turn restored from host RAM waits for its
        # copy, so what comes before this is on its path (benchmarks/engine_turns.py reports it from the submit)
        self.restore_launched = 0.0
        self._dropped: list = []  # loads whose sequence left while their disk reads ran (``drop_load``)
        self._reader = None  # the disk reader process (``_disk_reader``), once started; False: it failed
        if disk is not None:
            load_rates(self.planner, disk.dir)
            if needs_probe(self.planner, disk):
                threading.Thread(target=probe_disk, args=(disk, self.planner, LOADER_THREADS), name="qml-kv-probe",
                                 daemon=True).start()
            self._writer = DiskWriter(disk, self.row_bytes, self.stats, backlog_bytes=MAX_PENDING_WRITE_BYTES)
            self._loader = ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="qml-kv-loader")
            # the reader process now, not at the first restore: a 40 GiB server's fork took 373 ms of that turn
            # on an H100 host (benchmarks/results/sessions-h100-2026-12-06b.md)
            self._disk_reader()

    def hold_writes(self):
        """The engine thread is about to schedule and launch a step: disk writes not begun yet wait (up to
        ``disk_writer.HOLD_MAX_S``) until the returned callable is called (idempotent; the step's
        ``while_running``, or when the step fails). Each kernel launch releases the GIL, and the writer
        threads' Python between their encoding's and their file's calls took it every time."""
        writer = self._writer
        if writer is None or not self.quiet_writes:
            return _nothing
        writer.hold()
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                writer.release()
        return release

    # --- down -------------------------------------------------------------------------

    def spill_many(self, evicted: Evicted) -> None:
        """``spill`` for each (page, name, packed tokens), in order (``spill_first``, then its rest at once)."""
        self.spill_first(evicted)()

    def spill_first(self, evicted: Evicted) -> Callable[[], None]:
        """``spill_many``'s work that must come before the pages are overwritten; returns the rest, for the
        caller to run once that overwrite is queued (a restore's copy into them) and before anything else
        takes a host slot. The usual case: every page's content is in host RAM already (kept when its
        request ended, its copy down queued or run), so only the pump batches still reading the pages are
        waited for now (the newest, once: ``_wait_saved``), and making their host entries the most recent
        is the rest. A turn that restores a 27k-token history evicts ~1,700 such pages; a ``spill`` call
        each (four calls deep) took ~3-5 ms of the H200 engine thread before the restore's copies could
        start, one loop over them (this fast path's first form) ~0.5 ms of this machine's. Otherwise
        (a page not in host RAM, or kept and not copied yet) every page goes through ``spill`` in order,
        the pump batches waited for before the first such page, and the rest is nothing."""
        host = self.host
        if host is None or host.capacity == 0:
            for page, name, tokens in evicted:
                self.spill(page, name, tokens)
            return _nothing
        pages, names = evicted.pages, evicted.names
        if self._deferred.keys().isdisjoint(pages) and host.holds_all(names):
            saving = self._saving
            if saving:
                batches = [saving.pop(page) for page in saving.keys() & set(pages)]
                if batches:
                    self._wait_saved(*max(batches, key=itemgetter(0)))
            return functools.partial(host.touch_all, names)
        deferred, saving, touch, newest = self._deferred, self._saving, host.touch, None
        for page, name, tokens in evicted:
            if page not in deferred and touch(name):
                batch = saving.pop(page, None)
                if batch is not None and (newest is None or batch[0] > newest[0]):
                    newest = batch
                continue
            if newest is not None:  # first, as page by page: it may cover this page's batch too
                self._wait_saved(*newest)
                newest = None
            self.spill(page, name, tokens)
        if newest is not None:  # (before the step that overwrites the pages: the caller's)
            self._wait_saved(*newest)
        return _nothing

    def spill(self, page: int, name: bytes, tokens: bytes) -> None:
        """A cached GPU page is about to be reused: keep its content in host RAM (or on disk).
        The copy happens at the next ``flush_spills``, before the step that reuses the page."""
        if page in self._deferred:  # kept when its request ended, not copied yet: now it must be
            self._pending.append(page, self._undefer(page))
            return
        saving = self._saving.pop(page, None)
        if saving is not None:  # its copy down (pump) may be queued, not yet run
            self._wait_saved(*saving)
        if self.host is not None and self.host.capacity > 0:
            if self._queue_host_copy(page, name, tokens) is not None:
                self.stats.spilled_host += 1
            return
        if self.disk is not None and not self._on_disk(name):
            self._pending_disk.append((page, name, tokens))

    def _wait_saved(self, seq: int, event) -> None:
        """The compute stream may overwrite a page only after the pump's copy of it (batch ``seq``) has
        read it. A turn that restores a 27k-token history evicts ~1,700 pages saved in a few dozen
        batches: one question to the driver per batch, not per page (an event query per page was
        ~2-4 ms of the H200 host turn's scheduling, before its restore could start)."""
        if seq <= self._saved_seq or seq <= self._waited_seq:
            return
        if event.query():
            self._saved_seq = seq
        else:
            torch.cuda.current_stream(self.kv.data.device).wait_event(event)
            self._waited_seq = seq

    def _queue_host_copy(self, page: int, name: bytes, tokens: bytes, defer: bool = False) -> int | None:
        """Reserve a host slot for ``page`` (named ``name``) and queue its copy down for the next
        ``flush_spills`` (``defer``: for ``pump``) -> the slot; None when the name is in host RAM
        already or no slot is free."""
        # the usual case first, in one call: the page is in host RAM already (kept when its request ended;
        # a turn that restores a 27k-token history evicts ~1,700 such pages, and keeps as many at its end)
        if self.host.touch(name):
            return None
        slot = self._reserve_host(name, tokens)
        if slot is not None and defer:
            self._deferred[page] = slot
            self._deferred_slots[slot] = page
        elif slot is not None:
            self._pending.append(page, slot)
        return slot

    def _undefer(self, page: int) -> int:
        slot = self._deferred.pop(page)
        del self._deferred_slots[slot]
        return slot

    def _copy_deferred_now(self, slots) -> None:
        """Deferred copies into any of ``slots`` join the pending ones (their slot is about to be
        read or reused)."""
        for slot in slots:
            page = self._deferred_slots.get(slot)
            if page is not None:
                self._pending.append(page, self._undefer(page))

    @property
    def deferred(self) -> int:
        """Pages kept in host RAM whose copy down ``pump`` has not queued yet."""
        return len(self._deferred)

    def compute_mark(self):
        """An event at the compute stream's current end (None on CPU): ``pump(after=...)`` orders copies
        queued later after only what came before it."""
        if not self._cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.kv.data.device))
        return event

    def pump(self, max_pages: int | None = None, beside_step: bool = False, after=None) -> bool:
        """Queue the next deferred copies down (``max_pages``, one 128 MiB chunk by default), unless the
        link is busy: a restore is in flight, or (between steps, not ``beside_step``) the chunk queued
        before is still copying. True while deferred copies remain (the engine calls again between
        steps, polls while idle, and before a long prefill passes ``beside_step`` with as many pages
        as the link moves in about half of that step: ``pages_beside``). ``after``: an event of the compute
        stream (``compute_mark``) taken before a step already queued; the copies wait for it rather
        than for that step, whose work cannot touch a deferred page (one it took was spilled first)."""
        if not self._deferred:
            return False
        if not beside_step and self._pump_done is not None and not self._pump_done.query():
            return True
        if self.kv.restoring or (self._restored is not None and not self._restored.query()):
            return True
        batch = [self._deferred.popitem(last=False) for _ in range(min(max_pages or self.pump_pages,
                                                                       len(self._deferred)))]
        for _, slot in batch:
            del self._deferred_slots[slot]
        if self.save_in_place:
            self._save_in_place(batch, after)
        else:
            self._pending.extend(batch)
            self.flush_spills()
            self._pump_done = self._slot_events.get(batch[-1][1])
        return bool(self._deferred)

    def pages_beside(self, seconds: float) -> int:
        """Deferred pages ``pump`` may queue beside a step expected to take ``seconds``: the link's
        measured rate for half of it, so that the copies have ended when a restore may come next."""
        return int(PUMP_SHARE * seconds * self.planner.host_bytes_per_s / self.block_bytes)

    def _save_in_place(self, batch: list[tuple[int, int]], after=None) -> None:
        """Pages into their host slots with ``qml_kernels.page_save`` on the side stream: the kernel
        stores into the pinned rows directly, so no device staging is held however many pages go
        (a gathered copy needed its size in device memory until the copy ran), and a long prefill
        can have the whole backlog copied down beside it. Until the copy has run, a page evicted
        for reuse makes the compute stream wait (``spill``) and a restore reading a slot waits for
        it (``_slot_events``)."""
        from qml_kernels.kv_codec import KVCodecConfig, kv_save
        from qml_kernels.page_copy import PageCopyConfig, page_save

        dev = self.kv.data.device
        index = int64_rows(list(map(itemgetter(0), batch)), list(map(itemgetter(1), batch)), pin=self._cuda)
        pool, table = self.kv.chunk_views(self.host.slots)
        with self._side(after):
            index = index.to(dev, non_blocking=self._cuda)
            if self.kv.codec:  # encoded on the way down: fewer bytes over the link, and on the way back up
                kv_save(table, index[1], pool, index[0], config=KVCodecConfig(num_programs=SAVE_PROGRAMS))
            else:
                page_save(table, index[1], pool, index[0], config=PageCopyConfig(num_programs=SAVE_PROGRAMS))
        if not self._cuda:  # (tests: the reference has copied already)
            self._host_writes.hand_over([s for _, s in batch], None, self.host.slots, self._writer)
            return
        done = torch.cuda.Event()
        done.record(self._copy_stream)
        if len(self._slot_events) > 64 * MAX_BATCH_PAGES:  # forget copies that have finished
            self._slot_events = {s: e for s, e in self._slot_events.items() if not e.query()}
        if len(self._saving) > 64 * MAX_BATCH_PAGES:  # forget pages whose batch has finished
            for seq, event in sorted({e[0]: e[1] for e in self._saving.values()}.items(), reverse=True):
                if seq <= self._saved_seq or event.query():  # (the newest finished covers the older)
                    self._saved_seq = max(self._saved_seq, seq)
                    break
            self._saving = {p: e for p, e in self._saving.items() if e[0] > self._saved_seq}
        self._save_seq += 1
        for page, slot in batch:
            self._slot_events[slot] = done
            self._saving[page] = (self._save_seq, done)
        self._pump_done = done
        self._host_writes.hand_over([s for _, s in batch], done, self.host.slots, self._writer)

    def _reserve_host(self, name: bytes, tokens: bytes) -> int | None:
        """A host slot for ``name``; what it evicts goes to disk first."""
        slot, evicted = self.host.reserve(name, tokens)
        for old_name, old_tokens, old_slot in evicted:
            # a write through waiting for its copy: the entry goes from a copy below (not on disk, not queued)
            _, parent = self._host_writes.evicted(old_slot)
            on_disk = self.disk is None or self._on_disk(old_name)
            if on_disk or self.pending_write_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
                # nothing to write: the slot simply takes the new page. Not on disk, the disk is behind: the entry
                # leaves the cache rather than taking a 2 MiB copy of the engine thread's time and a place in a
                # queue that only grows (on the H200 a turn right after a fresh 27k-token prompt spent 20 ms of
                # its persist in these copies)
                if not on_disk:
                    self.stats.persist_skipped += 1
                if old_slot in self._deferred_slots:  # its copy down is moot now: the slot changes hands
                    self._undefer(self._deferred_slots[old_slot])
                elif not on_disk and self._pending.has_slot(old_slot):
                    self.flush_spills()  # a spill queued into the slot lands before the new page's copy
                continue
            self._settle_slot(old_slot)  # its bytes must have landed before the CPU reads them
            # a copy: the slot is about to take the new page
            self._queue_disk_write(old_name, old_tokens, self.host.slots[old_slot].clone(), parent, None)
        if slot is not None:  # the writer may still read its old bytes in place
            self._host_writes.reusing(slot, self._writer)
        return slot

    def _settle_slot(self, slot: int) -> None:
        """Host slot ``slot`` holds what was copied into it and no restore still reads it: only the
        copies that concern it are waited for (a full host tier evicts one entry per page it takes,
        and settling everything each time serialised a whole restore's spills, page by page)."""
        self._copy_deferred_now([slot])
        if self._pending.has_slot(slot):
            self.flush_spills()
        event = self._slot_events.pop(slot, None)
        if event is not None:
            event.synchronize()
        # only a restore reading this slot: a split's tail copies for ~60 ms beside the head's prefill, and the
        # engine thread keeps finished requests' pages meanwhile (a full host tier evicts to make room)
        self._reads = [(slots, event) for slots, event in self._reads if not event.query()]
        for slots, event in self._reads:
            if slot in slots:
                event.synchronize()

    def flush_spills(self) -> None:
        """Copy the pages spilled since the last call down to their host slots: gathered on the
        compute stream (so the step after this one may overwrite the pages), copied on the side.
        With no host tier, the pages go to the disk writer the same way, gathered in batches."""
        while self._pending_disk:
            batch, self._pending_disk = self._pending_disk[:MAX_BATCH_PAGES], self._pending_disk[MAX_BATCH_PAGES:]
            self._write_through([p for p, _, _ in batch], [(name, tokens, None) for _, name, tokens in batch])
        self._copy_down(self._gather_spills())

    def _gather_spills(self) -> list:
        """The pages spilled since the last flush, gathered on the compute stream (the next step may
        then overwrite them): [(staging, [(page, slot)])], for ``_copy_down``."""
        gathered = []
        # by slot: evicted pages come in LRU order, whose slots are scattered, and a copy per run of
        # consecutive slots was then a copy per page (1,700 cudaMemcpyAsync, ~64 ms of a 27k-token
        # turn's scheduling on the H200); the staging rows may follow any order
        pending = self._pending.drain_by_slot()
        # in the pump's chunks (128 MiB): the caching allocator then serves every spill gather from the
        # blocks the pump's gathers left. A turn that spills 1,708 pages in 512-page batches would need
        # ~8 GiB of fresh device memory the first time (each batch gathers, then makes it contiguous),
        # and the first host-RAM turn after a burst took 80 ms more than the next one (unmeasured guess:
        # cudaMalloc; see benchmarks/results/sessions-h200-2026-12-01.md)
        step = min(self.pump_pages, MAX_BATCH_PAGES)
        for at in range(0, len(pending), step):
            batch = pending[at: at + step]
            # evicted pages: not the pages of a restore in flight, so no wait for it (the turn that
            # restores its history evicts pages for its own new tokens after the restore is queued,
            # and waiting here would serialise that restore with the turn's prefill)
            try:
                gathered.append((self._gather([p for p, _ in batch], settle=False), batch))
            except BaseException:
                self._pending.extend(pending[at:])  # not gathered: still to copy down
                raise
        return gathered

    def _copy_down(self, gathered: list) -> None:
        """Gathered spills to their host slots on the side stream, after the compute stream's work
        and any restore in flight (``_side``)."""
        for staging, batch in gathered:
            runs = slot_runs([s for _, s in batch])
            with self._side():
                for i, s, n in runs:
                    self.host.slots[s:s + n].copy_(staging[i:i + n], non_blocking=self._cuda)
            done = self._done(staging)
            if done is not None:
                if len(self._slot_events) > 64 * MAX_BATCH_PAGES:  # forget copies that have finished
                    self._slot_events = {s: e for s, e in self._slot_events.items() if not e.query()}
                for _, s in batch:
                    self._slot_events[s] = done
            self._host_writes.hand_over([s for _, s in batch], done, self.host.slots, self._writer)

    def persist(self, pages: list[tuple[int, bytes, bytes, bytes | None]]) -> None:
        """Keep a finished request's named pages (page, name, packed tokens, parent name): copied to host RAM
        (on the side stream: in chunks between steps with ``defer_persist``, else now), and written
        through to disk in the background.

        The host copy is made after the request ends rather than when its pages are evicted: an
        eviction then finds the page already in host RAM and copies nothing, so a later turn that
        restores its history (and evicts as many pages to make room) moves KV in one direction
        only. On the H200 a 3.5 GB restore beside 3.5 GB of spills took 104 ms against 70 alone
        (benchmarks/kv_upload_h200.py), and the turn waited on both. A page evicted before ``pump``
        reached it is copied as a spill.

        A page given a host slot here is written through from that slot: handed to the disk writer
        once its copy down is queued (``qml_runtime.kv.host_writes``), and read there in place. Only pages with no
        new slot are gathered on the device for the writer, which copies them down a second time."""
        skipped: set[bytes] = set()
        if self.host is not None and self.host.capacity > 0:
            for page, name, tokens, parent in pages:
                # (a page already there: its recency refreshed)
                slot = self._queue_host_copy(page, name, tokens, defer=self.defer_persist)
                if slot is None:
                    continue
                self.stats.kept_host += 1
                if self.disk is not None and not self._on_disk(name):
                    # registered now, before a later page of this call can evict it (``_reserve_host``)
                    if self.pending_write_bytes + self.block_bytes > MAX_PENDING_WRITE_BYTES:
                        skipped.add(name)
                    else:
                        self._host_writes.register(slot, name, tokens, parent)
            if not self.defer_persist:
                self.flush_spills()  # (and the writes waiting for these copies are handed over)
        if self.disk is None:
            return
        # what has no new host slot (or no host tier) is gathered on the device for the writer
        todo = [(p, n, t, parent) for p, n, t, parent in pages if n not in skipped and not self._on_disk(n)]
        for i in range(0, len(todo), MAX_BATCH_PAGES):
            chunk = todo[i:i + MAX_BATCH_PAGES]
            if self.pending_write_bytes + len(chunk) * self.block_bytes > MAX_PENDING_WRITE_BYTES:
                skipped.update(n for _, n, _, _ in todo[i:])
                break
            self._write_through([p for p, _, _, _ in chunk], [(n, t, parent) for _, n, t, parent in chunk])
        if skipped:  # the disk is behind: a cache may drop what it cannot keep up with
            self.stats.persist_skipped += len(skipped)
            self._warn_behind(len(skipped))

    def _warn_behind(self, skipped: int) -> None:
        """Log that ``skipped`` pages were not written through, at most once a ``BEHIND_WARN_INTERVAL_S``."""
        self._behind_skipped += skipped
        now = time.monotonic()
        if self._behind_warned is not None and now - self._behind_warned < BEHIND_WARN_INTERVAL_S:
            return
        since = "" if self._behind_warned is None else f" in the last {now - self._behind_warned:.0f} s"
        log.warning("disk writer behind by %.1f GiB: %d pages not written through%s (kept in host RAM only: a "
                    "restart will not find them)", self.pending_write_bytes / 2**30, self._behind_skipped, since)
        self._behind_warned, self._behind_skipped = now, 0

    def _write_through(self, pages: list[int], blocks: list[tuple[bytes, bytes, bytes | None]]) -> None:
        """Gather pages on the device now (they may be reused by the next step) and hand the buffer
        to the writer, which copies it down and writes the files: the engine thread only launches."""
        staging = self._gather(pages)
        ready = None
        if self._cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._writer.put_pages(staging, ready, blocks)

    @property
    def pending_write_bytes(self) -> int:
        """Pages handed to the disk writer and not yet written (gathered, or read from their host rows),
        and those waiting for their host copy before they go."""
        if self._writer is None:
            return 0
        return self._writer.pending_bytes + len(self._host_writes) * self.row_bytes

    def _gather(self, pages: list[int], settle: bool = True) -> torch.Tensor:
        self._observe_uploads()
        # pinned: a copy from pageable memory may wait for the stream (a persist beside a prefill step)
        index = int64_rows(pages, pin=self._cuda)[0]
        return self.kv.gather_pages(index.to(self.kv.data.device, non_blocking=True), settle=settle)

    def _side(self, after=None):
        """A context on the copy stream, after the work queued so far on the compute stream (or only up
        to ``after``, a ``compute_mark``)."""
        if not self._cuda:
            return contextlib.nullcontext()
        if after is None:
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.kv.data.device))
        else:
            self._copy_stream.wait_event(after)
        # a slot a restore still reads must not be overwritten by a spill into it
        self._copy_stream.wait_stream(self._restore_stream)
        return torch.cuda.stream(self._copy_stream)

    def _done(self, staging: torch.Tensor):
        """An event after the side stream's copies (None on CPU, where they are done already)."""
        if not self._cuda:
            return None
        staging.record_stream(self._copy_stream)  # the allocator keeps it until the copies ran
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    def _queue_disk_write(self, name: bytes, tokens: bytes, data: torch.Tensor,
                          parent: bytes | None, ready) -> None:
        """``data`` is a host tensor the writer owns from now on (valid once ``ready`` has passed);
        ``parent`` the previous page's name where the caller knows it."""
        if self.disk is not None and not self._on_disk(name):
            self._writer.put_block(name, tokens, data, parent, ready)

    def _on_disk(self, name: bytes) -> bool:  # or handed to the writer already, or waiting for its host copy
        return self.disk.contains(name) or name in self._host_writes or self._writer.queued(name)

    def flush(self) -> None:
        """Wait for queued disk writes (shutdown, tests); kept pages whose write waits for their host copy
        have it queued now."""
        if self._host_writes:
            waiting = self._host_writes.waiting_slots()
            self._copy_deferred_now([s for s in list(self._deferred_slots) if s in waiting])
        self.flush_spills()
        if self._writer is not None:
            self._writer.join()

    def save_rates(self) -> None:
        if self.disk is not None:
            save_rates(self.planner, self.disk.dir)

    def close(self) -> None:
        """Finish the queued writes and release the disk store (idempotent)."""
        if self._writer is not None:
            if self._reader:  # (first: its reads' ends tell the writer)
                self._reader.close()
            self.save_rates()
            self.flush()
            self._writer.close()
            self._writer = None
            self._loader.shutdown(wait=True)
            self.disk.close()


def _nothing() -> None:
    pass
