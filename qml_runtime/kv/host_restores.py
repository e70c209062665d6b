"""Restoring a history from host RAM into GPU pages (``KVTiers.locate_run``, ``plan``, ``restore_host``).

The scheduler asks where the blocks after the GPU-cached prefix live (``locate_run``: host RAM, then disk),
has the planner weigh copying them against computing them (``plan``), and copies the leading host blocks
into the pages it took for them (``restore_host``). From the pinned host tier the copy reads the rows in
place, one ``qml_kernels.page_copy`` launch per layer (or per group of layers: ``QML_RESTORE_GROUPS``) on a
high-priority restore stream, with an event per layer that the prefill waits for before reading that
layer (``KVCache.layer``): the turn computes beside the copy. Rows in plain memory go through a GPU staging
buffer scattered into the pages on the compute stream.

A turn over a history in host RAM waits for this copy (a 27k-token Llama-3.1-8B history: 3.58 GB, ~71 ms on
the H200), so what the host does before its first launch adds to the turn one for one: the lookups and
index building here run as C loops, and ``restore_launched`` stamps the launch for the benchmarks.

``HostRestores`` is a part of ``KVTiers`` (a mixin, as ``disk_loads.DiskLoads`` is: it uses the tiers' pool,
host tier, disk store, planner, stats, streams and spill queue), kept in its own file so that the tiers'
module stays about the copies down.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from array import array
from collections.abc import Sequence

import torch

from qml_runtime.kv.host_tier import slot_runs
from qml_runtime.kv.planner import Plan

log = logging.getLogger("qml.kv.tiers")

MAX_BATCH_PAGES = 512  # pages per gathered copy: bounds the GPU staging buffer (1 GiB at 2 MiB pages)
# the restore's page_copy programs: 64 moved a 27k-token Llama-3.1-8B history (3.58 GB, 32 launches of one
# layer) in 70.7-71.0 ms against 72.2-72.3 with 32 (50.5 against 49.5 GB/s; 128: 71.0-71.2; the copy
# engines' 2D copies of the same 32 KiB runs 70.7-71.1, one flat copy 67 ms: the link, not the kernel, is the
# limit); benchmarks/results/kv-upload-dma-h200-2026-12-03.md
RESTORE_PROGRAMS = 64
# the copy of a split's tail runs beside the head's prefill, which wants every SM: its programs can be fewer
# (32 moved the history at 49.5 GB/s against 50.5 with 64, above). Not yet measured beside a prefill.
SPLIT_RESTORE_PROGRAMS = int(os.environ.get("QML_SPLIT_COPY_PROGRAMS", RESTORE_PROGRAMS))
# QML_RESTORE_GROUPS: the restore's launches over several layers each (``layer_groups``): "halves" (16, 8, 4, 2,
# 1, 1 of 32 layers) or sizes ("8,8,8,4,2,1,1"). A page's layers lie one after another in its host row, so a
# launch over g layers reads runs of g x 64 KiB; one layer's 32 KiB runs moved 50.5 GB/s where one flat copy
# moved 53.4 (kv-upload-dma-h200-2026-12-03.md: the 2D copies of the same runs were no faster than the kernel).
# Measured since (H100, restore-h100-2026-12-05.md): the kernel moves ~50.7 GB/s over groups of 2-32 layers as
# over one, so the groups buy nothing on the link; off (one layer a launch).
RESTORE_GROUPS = os.environ.get("QML_RESTORE_GROUPS", "")
# QML_RESTORE_STAGED=g: the restore through the copy engines (``_upload_staged``): g layers of every page a 2D
# copy into a device staging ring, scattered into the pages by page_copy on the restore stream. On the H200
# (restore-h200-2026-12-05.md) the 2D copies move 55.0-55.4 GB/s against the zero-copy kernel's 50.8 (65.1
# against 70.4 ms for a 27k-token history), and the engine's host-RAM turn took 74.2 / 75.9 ms against
# 80.0-82.3 with the kernel. On by default (g = 2); 0 restores through the kernel. Taken only where the rows
# come in few slot runs (a 2D copy per run and group) and the ring fits STAGED_MAX_BYTES.
RESTORE_STAGED = int(os.environ.get("QML_RESTORE_STAGED", "2"))
STAGED_REGIONS = 3  # the ring: the copy engines fill one region while a scatter drains the one before
STAGED_MAX_RUNS = 64
STAGED_MAX_BYTES = 1 << 30
STAGED_SCATTER_PROGRAMS = 132  # HBM to HBM: every SM, for the ~0.2 ms a region takes


def int64_rows(*rows: list[int], pin: bool = False) -> torch.Tensor:
    """Lists of Python ints, all of one length, as an int64 tensor ``[len(rows), n]`` (in pinned memory when
    ``pin``), through an ``array("q")``: torch.tensor on the lists took 0.31 ms for a restore's 2 x 1,700
    page and slot ids on CPU, this ~0.04, and the restore's copy is launched right after it."""
    flat = array("q", rows[0])
    for row in rows[1:]:
        flat.extend(row)
    if not flat:
        out = torch.empty((len(rows), 0), dtype=torch.int64)
    else:
        out = torch.frombuffer(flat, dtype=torch.int64).view(len(rows), -1)  # (holds ``flat``)
    return out.pin_memory() if pin else out


def layer_groups(num_layers: int, sizes: str | Sequence[int] = "") -> list[tuple[int, int]]:
    """The restore's launches as (first layer, end layer), in order, covering ``num_layers``: ``sizes`` a list
    of group sizes or its comma-separated text (clipped at the last layer; layers left over go one a launch),
    "halves" (half the layers, then half the rest, ..., down to one, and the last one alone: the compute
    that waits for the last group is one layer's), or empty (one layer a launch)."""
    if isinstance(sizes, str):
        if sizes.strip() == "halves":
            sizes, left = [], num_layers
            while left > 1:
                sizes.append(left // 2)
                left -= left // 2
        else:
            sizes = [int(part) for part in sizes.split(",") if part.strip()]
    if any(size < 1 for size in sizes):
        raise ValueError(f"restore groups must hold one layer or more, got {list(sizes)}")
    groups, lo = [], 0
    for size in sizes:
        if lo >= num_layers:
            break
        groups.append((lo, min(lo + size, num_layers)))
        lo = groups[-1][1]
    return groups + [(layer, layer + 1) for layer in range(lo, num_layers)]


def staged_copies(runs: Sequence[tuple[int, int, int]], host: int, row_bytes: int, chunk_bytes: int,
                  region: int, chunk_lo: int, n_chunks: int) -> list[tuple[int, int, int, int, int, int]]:
    """The 2D copies that fill a staging region ``[n, n_chunks, chunk_bytes]`` (at address ``region``) from
    host rows of ``row_bytes`` (the table at ``host``): per run (staging row d, host row s, count), ``count``
    rows of the ``n_chunks`` chunks from ``chunk_lo`` on. As ``copy_2d_to_device``'s arguments (dst,
    dst_pitch, src, src_pitch, width, height)."""
    width = n_chunks * chunk_bytes
    return [(region + d * width, width, host + s * row_bytes + chunk_lo * chunk_bytes, row_bytes, width, count)
            for d, s, count in runs]


def _ring_elems(n_pages: int, table: torch.Tensor) -> int:
    """The staging ring's elements for ``n_pages`` (``STAGED_REGIONS`` regions of ``RESTORE_STAGED`` layers of each
    page, and one host row's width each side of them: ``HostRestores._upload_staged``)."""
    C, W = table.shape[1], table.shape[2]
    return 2 * C * W + STAGED_REGIONS * n_pages * 2 * RESTORE_STAGED * W


class HostRestores:
    """``KVTiers``' way up: finding a history's blocks in the tiers below, planning, and copying them in."""

    def locate(self, name: bytes, tokens) -> str | None:
        """Which tier holds this block: "host", "disk", or None (``tokens``: packed, or the ids). A block the disk
        writer holds a copy of, its file not written yet, is "disk": ``start_load`` takes it from that copy."""
        if self.host is not None and self.host.find(name, tokens) is not None:
            return "host"
        if self.disk is not None and self.disk.contains(name):
            return "disk"
        if self._writer is not None and self._writer.copy_of(name, tokens) is not None:
            return "disk"
        return None

    def locate_run(self, names: list[bytes], packed: bytes | bytearray) -> list[str]:
        """``locate`` for block i under ``names[i]`` with the tokens of ``packed``'s block i, for each i up
        to the first found in no tier: the tiers of that run. Its leading host blocks are found in
        one pass (``HostTier.find_run``); from the first other block on, one by one."""
        if not names:
            return []
        B = len(packed) // len(names)
        slots = self.host.find_run(names, packed) if self.host is not None else []
        n = len(slots)
        self._located = (names, bytes(packed[:n * B]), slots, self.host.removals) if n else None
        where = ["host"] * n
        for i in range(n, len(names)):
            tier = self.locate(names[i], packed[i * B:(i + 1) * B])
            if tier is None:
                break
            where.append(tier)
        return where

    def plan(self, tiers: Sequence[str], block_tokens: int, start: int = 0, after: int = 0) -> Plan:
        # the restores that have landed since teach the host rate first (on a GPU nothing else asked them once
        # the pages went down in place: a served H100 run planned every restore at the 20 GB/s guess)
        self._observe_uploads()
        plan = self.planner.plan(tiers, self.block_bytes, block_tokens, start, after)
        self.stats.plans[plan.kind] += 1
        self.stats.planned_seconds += plan.seconds
        self.stats.recompute_planned_seconds += plan.recompute_seconds
        if plan.recompute:
            self.stats.skipped_disk += tiers[plan.host_now:plan.host_now + plan.recompute].count("disk")
        if tiers and log.isEnabledFor(logging.INFO):
            log.info("restore plan: %d blocks below the GPU -> %d from host now, %d recomputed, %d streamed in "
                     "(%s; est. %.1f ms vs %.1f ms to recompute all; rates: prefill %s, host %.1f GB/s, "
                     "disk %.2f GB/s)", len(tiers), plan.host_now, plan.recompute, plan.load, plan.kind,
                     plan.seconds * 1e3, plan.recompute_seconds * 1e3, self._prefill_rate_text(),
                     self.planner.host_bytes_per_s / 1e9, self.planner.disk_bytes_per_s / 1e9)
        return plan

    def _prefill_rate_text(self) -> str:
        p = self.planner
        if not p.prefill_curve:
            return f"{p.prefill_tokens_per_s:.0f} tok/s"
        n = p.prefill_curve[-1][0]
        return f"{n / p.prefill_seconds(0, n):.0f} tok/s at {n} tokens (x{p.prefill_scale:.2f} of the start-up curve)"

    def restore_host(self, names: list[bytes], packed: bytes | bytearray, pages: list[int]) -> int:
        """Copy host blocks into ``pages``, in order: block i under ``names[i]`` with the tokens of
        ``packed``'s block i. Returns how many were found (the first missing one and those after it
        are not copied). The slots ``locate_run`` found for the same blocks are taken as they are when no
        host entry has left since (a second lookup of a 27k-token history's ~1,700 blocks took 0.3-0.6 ms
        of the H200 engine thread before the copies could start); else the blocks are looked up again."""
        slots = self._host_slots(names, packed)
        if slots:
            self._upload(pages[:len(slots)], [(self.host.slots, i, s, n) for i, s, n in slot_runs(slots)])
            self.stats.restored_host += len(slots)
        return len(slots)

    def _host_slots(self, names: list[bytes], packed: bytes | bytearray, offset: int = 0) -> list[int]:
        """The host slots of the run of blocks ``names`` (tokens ``packed``), up to the first missing one:
        those ``locate_run`` found moments before, ``offset`` blocks into its run, when no host entry has
        left since; else looked up again."""
        located, self._located = self._located, None
        if located is not None and names and offset + len(names) <= len(located[2]) \
                and located[0][offset] == names[0] and located[3] == self.host.removals:
            B = len(packed) // len(names)
            if located[1][offset * B:offset * B + len(packed)] == packed:
                return located[2][offset:offset + len(names)]
        return self.host.find_run(names, packed)

    def _upload(self, pages: list[int], sources: list[tuple[torch.Tensor, int, int, int]],
                hold: bool = False) -> tuple[list, int] | None:
        """Copy host rows into GPU pages: ``sources`` are (host tensor of rows, destination row, source
        row, row count); destination row i goes to ``pages[i]``. Rows of the pinned host tier go
        layer by layer on a side stream (``_upload_layers``); others through a GPU staging buffer
        on the compute stream. ``hold``: a layered copy's events are returned (with the restore's number)
        rather than handed to the pool, for a later step to wait on (``apply_load``); steps before it
        do not read these pages."""
        self._fill_first(sources)
        if self.layered and self._in_place and all(src is self.host.slots for src, _, _, _ in sources):
            # a page spilled to make room is gathered before the restore overwrites it, but copied down
            # after it: both ways at once, the restore ran at ~half speed (kv_upload_h200: 3.5 GB up
            # beside 3.5 GB down took 104 ms against 70 alone), and the turn waits only on the restore
            gathered = self._gather_spills()  # (with a host tier nothing goes to disk directly)
            events = self._upload_layers(pages, sources, hold)
            self._copy_down(gathered)
            return (events, self._uploads) if hold else None
        self.flush_spills()  # a page spilled earlier must be copied out before it is overwritten
        dev = self.kv.data.device
        if self._cuda:
            # only the copies filling the slots read here must be complete (the GPU waits, not the
            # host): copies of other slots, down, overlap these, up
            for event in self._slot_waits(sources):
                torch.cuda.current_stream(dev).wait_event(event)
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for i in range(0, len(pages), MAX_BATCH_PAGES):
            n_pages = min(MAX_BATCH_PAGES, len(pages) - i)
            staging = torch.empty((n_pages, self.row_bytes), dtype=torch.uint8, device=dev)
            for src, d, s, n in sources:  # the part of each run that falls in this chunk
                lo, hi = max(d, i), min(d + n, i + n_pages)
                if lo < hi:
                    staging[lo - i:hi - i].copy_(src[s + lo - d:s + hi - d], non_blocking=self._cuda)
            index = int64_rows(pages[i:i + n_pages])[0].to(dev, non_blocking=True)
            self.kv.scatter_pages(index, staging)
            if i == 0:
                self.restore_launched = time.perf_counter()
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._timing.append((start, end, len(pages) * self.block_bytes))
        else:
            self.planner.observe("host", len(pages) * self.block_bytes, time.perf_counter() - t0)

    def _fill_first(self, sources) -> None:
        """A restore reading a host slot whose copy down has not been queued (deferred, or a spill
        gathered in this same schedule) queues those copies first: ``_slot_waits`` then orders the
        restore after them. (Rare: such a page is still on the GPU, where the prefix is looked up
        first.)"""
        if self.host is None or not (self._deferred_slots or self._pending):
            return
        read = self._slots_read(sources)
        self._copy_deferred_now(sorted(self._deferred_slots.keys() & read))
        if self._pending.any_slot_in(read):
            self.flush_spills()

    def _slots_read(self, sources) -> set[int]:
        """The host-tier slots ``sources`` read (a set built without a Python step per slot: a 27k-token
        history's ~1,700, before its restore's copy is launched)."""
        return set(itertools.chain.from_iterable(range(s, s + n) for src, _, s, n in sources
                                                 if src is self.host.slots))

    def _slot_waits(self, sources) -> list:
        """The spill copies still filling the host slots that ``sources`` read (once each)."""
        if self.host is None or not self._slot_events:
            return []
        events = self._slot_events
        # (events hash by identity: each once)
        return list(set(map(events.__getitem__, events.keys() & self._slots_read(sources))))

    def _compile_page_copy(self) -> None:
        """One copy of a page at start (the pool holds nothing yet): the kernel is compiled before a
        request's restore would wait for it."""
        from qml_kernels.kv_codec import kv_load, kv_save
        from qml_kernels.page_copy import page_copy, page_save

        self.host.slots[0].zero_()  # page 0 keeps the zeros it was made with (zeros decode to zeros too)
        pool, table = self.kv.chunk_views(self.host.slots)
        zero = torch.zeros(1, dtype=torch.int64, device=self.kv.data.device)
        (kv_load if self.kv.codec else page_copy)(pool, zero, table, zero, 0, 2)
        if self.save_in_place:  # and the other way (the first pump would compile it beside a prefill)
            (kv_save if self.kv.codec else page_save)(table, zero, pool, zero, 0, 2)
        torch.cuda.synchronize(self.kv.data.device)
        if not self.kv.codec and RESTORE_STAGED > 0:
            self._warm_staged(pool, table, zero)

    def _warm_staged(self, pool: torch.Tensor, table: torch.Tensor, zero: torch.Tensor) -> None:
        """A staged restore of that page at start, and the ring of the largest restore reserved on the restore
        stream: the first staged turn on the H200 began its copy 11.9 ms after its submit against 5.1-6.6 for
        the next ones (the CUDA runtime's loading, the DMA stream, the scatter's first launch, a 672 MB ring's
        allocation). A failure here only leaves those costs to the first restore."""
        dev = self.kv.data.device
        try:
            elems = self._staged_elems(1, 1, table)
            with torch.cuda.stream(self._restore_stream):
                ring = torch.empty(elems, dtype=table.dtype, device=dev)
                self._upload_staged(ring, pool, zero, table, [(self.host.slots, 0, 0, 1)])
                del ring
                # allocated and freed: torch's caching allocator keeps the block for this stream (and
                # releases it if another allocation would fail without it). No restore's ring is larger.
                largest = min(_ring_elems(min(self.kv.num_blocks, self.host.capacity), table),
                              STAGED_MAX_BYTES // table.element_size())
                torch.empty(largest, dtype=table.dtype, device=dev)
            torch.cuda.synchronize(dev)
        except Exception:  # noqa: BLE001 - the first restore pays what the warm-up could not do
            log.warning("the staged restore's warm-up failed; the first restore will pay it", exc_info=True)

    def _upload_layers(self, pages: list[int], sources: list[tuple[torch.Tensor, int, int, int]],
                       hold: bool = False) -> list:
        """Host-tier rows into GPU pages, read in place from pinned memory (``qml_kernels.page_copy``,
        ~51 GB/s on the H200, as fast as one large pinned copy) one layer per launch on the restore
        stream, with an event per layer handed to the pool (``KVCache.restore_events``): the
        prefill that reads them waits layer by layer, so it computes layer i while later layers
        still arrive, and a 3.5 GB history (~70 ms) hides the turn's own compute behind it."""
        from qml_kernels.kv_codec import KVCodecConfig, kv_load
        from qml_kernels.page_copy import PageCopyConfig, page_copy

        dev = self.kv.data.device
        compute = torch.cuda.current_stream(dev)
        stream = self._restore_stream
        stream.wait_stream(compute)  # pages spilled before this were gathered on the compute stream
        for event in self._slot_waits(sources):
            stream.wait_event(event)
        pool, table = self.kv.chunk_views(self.host.slots)
        staged = None if self.kv.codec else self._staged_elems(len(pages), len(sources), table)
        # rows padded to an even length: both start 16-byte aligned, as the kernel was compiled for
        width = len(pages) + len(pages) % 2
        if staged is None:
            slot_of = [0] * width
            for _, d, s, n in sources:
                slot_of[d:d + n] = range(s, s + n)
            index = int64_rows(pages + [0] * (width - len(pages)), slot_of, pin=True)
        else:  # (the staged copies name the slots themselves; the page ids alone go to the device)
            index = int64_rows(pages + [0] * (width - len(pages)), pin=True)
        events = []
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            index = index.to(dev, non_blocking=True)
            pages_d = index[0, :len(pages)]
            slots_d = index[1, :len(pages)] if staged is None else None
            programs = SPLIT_RESTORE_PROGRAMS if hold else RESTORE_PROGRAMS
            # encoded rows are decoded into the pages as they are read (``kv_codec.kv_load``)
            copy, config = (kv_load, KVCodecConfig(num_programs=programs)) if self.kv.codec else \
                (page_copy, PageCopyConfig(num_programs=programs))
            layers = self.kv.data.shape[0]
            for lo, hi in ([] if staged is not None else layer_groups(layers, RESTORE_GROUPS)):
                copy(pool, pages_d, table, slots_d, 2 * lo, 2 * hi, config=config)
                if lo == 0:
                    self.restore_launched = time.perf_counter()
                event = torch.cuda.Event(enable_timing=hi == layers)
                event.record()
                events += [event] * (hi - lo)  # a layer is read once its group has landed
            if staged is not None:
                ring = torch.empty(staged, dtype=table.dtype, device=dev)  # (on the restore stream)
                events = self._upload_staged(ring, pool, pages_d, table, sources)
        self._uploads += 1
        if not hold:
            self.kv.restore_events(events, self._uploads)
        self._restored = events[-1]
        self._reads.append(({s for _, _, s0, n in sources for s in range(s0, s0 + n)}, events[-1]))
        self._timing.append((start, events[-1], len(pages) * self.block_bytes))
        return events

    def _staged_elems(self, n_pages: int, n_runs: int, table: torch.Tensor) -> int | None:
        """The elements of the staging ring a staged restore of ``n_pages`` in ``n_runs`` slot runs takes (one
        row's width in front of the regions and one after them, so that a region seen as whole rows stays
        inside the tensor: ``_upload_staged``), or None where the restore goes through the kernel."""
        if RESTORE_STAGED < 1:
            return None
        elems = _ring_elems(n_pages, table)
        nbytes = elems * table.element_size()
        if n_runs > STAGED_MAX_RUNS or nbytes > STAGED_MAX_BYTES:
            log.debug("restore of %d pages in %d slot runs through the kernel: a staged one would take %d 2D "
                      "copies a group and %.0f MB of staging", n_pages, n_runs, n_runs, nbytes / 1e6)
            return None
        return elems

    def _upload_staged(self, staging: torch.Tensor, pool: torch.Tensor, pages_d: torch.Tensor,
                       table: torch.Tensor, sources) -> list:
        """The layered restore through the copy engines (``QML_RESTORE_STAGED``; on the restore stream,
        which is current): per group of g layers, 2D copies (one per slot run, ``staged_copies``) on the
        DMA stream fill a region of the staging ring, then page_copy scatters it into the pages on the
        restore stream and records the group's event; a region is filled again once its scatter is done.
        The staging lives until the last scatter: later allocations on the restore stream follow it."""
        from qml_kernels.page_copy import PageCopyConfig, page_copy
        from qml_runtime.kv.dma import copy_2d_to_device

        stream = torch.cuda.current_stream(staging.device)
        if self._dma_stream is None:
            self._dma_stream = torch.cuda.Stream(staging.device, priority=-1)
        dma = self._dma_stream
        dma.wait_stream(stream)  # after the restore stream's waits for the spills filling these slots
        n, C, W = pages_d.numel(), table.shape[1], table.shape[2]
        elem = table.element_size()
        layers = C // 2
        per = 2 * RESTORE_STAGED * W  # elements a staging row holds
        rows_d = torch.arange(n, device=staging.device)
        runs = [(d, s, count) for _, d, s, count in sources]
        config = PageCopyConfig(num_programs=STAGED_SCATTER_PROGRAMS)
        landed: list = [None] * STAGED_REGIONS
        events: list = []
        for k, (lo, hi) in enumerate(layer_groups(layers, [RESTORE_STAGED] * layers)):
            r, c_lo, c_n = k % STAGED_REGIONS, 2 * lo, 2 * (hi - lo)
            # region r seen as rows [n, C, W] whose chunk c_lo is the region's first element
            rows = staging.as_strided((n, C, W), (c_n * W, W, 1), C * W + r * n * per - c_lo * W)
            if landed[r] is not None:
                dma.wait_event(landed[r])
            for args in staged_copies(runs, table.data_ptr(), table.stride(0) * elem, W * elem,
                                      staging.data_ptr() + (C * W + r * n * per) * elem, c_lo, c_n):
                copy_2d_to_device(*args, stream=dma)
            if lo == 0:
                self.restore_launched = time.perf_counter()
            filled = torch.cuda.Event()
            filled.record(dma)
            stream.wait_event(filled)
            page_copy(pool, pages_d, rows, rows_d, c_lo, c_lo + c_n, config=config)
            event = torch.cuda.Event(enable_timing=hi == layers)
            event.record(stream)
            landed[r] = event
            events += [event] * (hi - lo)
        return events

    def _observe_uploads(self) -> None:
        """Fold finished uploads' GPU times into the host rate, without waiting for any."""
        still = []
        for start, end, nbytes in self._timing:
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                log.debug("host upload: %.1f MB in %.2f ms (%.1f GB/s)", nbytes / 1e6, seconds * 1e3,
                          nbytes / max(seconds, 1e-9) / 1e9)
                self.planner.observe("host", nbytes, seconds)
            else:
                still.append((start, end, nbytes))
        self._timing = still
