"""The KV tiers below the GPU pages: host RAM (warm) and local disk (cold, survives restarts).

Down: a cached GPU page about to be overwritten is copied to host RAM; a host page
pushed out of its budget goes to disk. A finished request's pages are also written
through to disk in the background, so a conversation survives a restart. Writes to
disk never block a request: a writer thread does them from copies. (Copies between
GPU and host are synchronous for now: 2 MiB at 55 GB/s is ~40 us a page; overlapping
them with compute, layer by layer, is the next step.)

Up: when a request's prompt runs past the pages cached on the GPU, the next blocks are
looked up by name in host RAM, then on disk, and copied into fresh GPU pages, as long
as the planner says that is faster than computing them again (``RestorePlanner``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_store import DiskStore
from qml_runtime.kv.host_tier import HostTier

log = logging.getLogger("qml.kv.tiers")


@dataclass
class RestorePlanner:
    """Restore a block from a tier only if copying it in beats recomputing its tokens.

    Rates are measured as the engine runs (exponential averages), starting from
    conservative guesses. Host RAM nearly always wins; disk wins when prefill is slow
    (CPU, big models) and loses on a fast GPU (H200: 128 KiB/token of Llama-3.1-8B KV at
    1.46 GB/s is ~90 us/token against ~32 us/token to recompute).
    """

    prefill_tokens_per_s: float = 1_000.0
    host_bytes_per_s: float = 5e9
    disk_bytes_per_s: float = 5e8
    alpha: float = 0.2  # weight of a new measurement

    def observe(self, kind: str, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount <= 0:
            return
        attr = {"prefill": "prefill_tokens_per_s", "host": "host_bytes_per_s", "disk": "disk_bytes_per_s"}[kind]
        setattr(self, attr, (1 - self.alpha) * getattr(self, attr) + self.alpha * amount / seconds)

    def worth_restoring(self, tier: str, block_bytes: int, block_tokens: int) -> bool:
        rate = self.host_bytes_per_s if tier == "host" else self.disk_bytes_per_s
        return block_bytes / rate < block_tokens / self.prefill_tokens_per_s


@dataclass
class TierStats:
    restored_host: int = 0  # blocks
    restored_disk: int = 0
    skipped_disk: int = 0  # found on disk, recomputed because the planner said it was faster
    spilled_host: int = 0
    written_disk: int = 0
    restore_seconds: float = 0.0


class KVTiers:
    def __init__(self, kv: KVCache, host: HostTier | None, disk: DiskStore | None,
                 planner: RestorePlanner | None = None):
        self.kv, self.host, self.disk = kv, host, disk
        self.planner = planner or RestorePlanner()
        self.stats = TierStats()
        self.block_bytes = kv.block_bytes
        self._writes: queue.Queue = queue.Queue()
        self._writer = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="qml-kv-writer", daemon=True)
            self._writer.start()

    # --- down -------------------------------------------------------------------------

    def spill(self, page: int, name: bytes, tokens: tuple[int, ...]) -> None:
        """A cached GPU page is about to be reused: keep its content in host RAM (or on disk)."""
        if self.host is not None and self.host.capacity > 0:
            slot, evicted = self.host.reserve(name, tokens)
            for old_name, old_tokens, old_slot in evicted:
                # a copy: the slot is about to take the new page
                self._queue_disk_write(old_name, old_tokens, self.host.slots[old_slot].clone(), None)
            if slot is not None:
                self.kv.read_page(page, self.host.slots[slot])
                self.stats.spilled_host += 1
            return
        if self.disk is not None:
            staging = torch.empty(self.block_bytes, dtype=torch.uint8)
            self.kv.read_page(page, staging)
            self._queue_disk_write(name, tokens, staging, None)

    def persist(self, pages: list[tuple[int, bytes, tuple[int, ...], bytes | None]]) -> None:
        """Write a finished request's named pages (page, name, tokens, parent name) through to disk,
        in the background."""
        if self.disk is None:
            return
        for page, name, tokens, parent in pages:
            if self.disk.contains(name):
                continue
            staging = torch.empty(self.block_bytes, dtype=torch.uint8)
            self.kv.read_page(page, staging)
            self._queue_disk_write(name, tokens, staging, parent)

    def _queue_disk_write(self, name: bytes, tokens: tuple[int, ...], data: torch.Tensor,
                          parent: bytes | None) -> None:
        """``data`` is a host tensor the writer owns from now on; ``parent`` the previous page's
        name where the caller knows it (a page spilled on eviction does not carry it)."""
        if self.disk is not None and not self.disk.contains(name):
            self._writes.put((name, tokens, data, parent))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            name, tokens, data, parent = item
            # queued twice before the first landed: one write is enough (and counts once)
            if not self.disk.contains(name) and self.disk.put(name, parent, list(tokens), data):
                self.stats.written_disk += 1  # put never raises: a failed write is a later miss
            self._writes.task_done()

    def flush(self) -> None:
        """Wait for queued disk writes (shutdown, tests)."""
        if self._writer is not None:
            self._writes.join()

    def close(self) -> None:
        """Finish the queued writes and release the disk store (idempotent)."""
        if self._writer is not None:
            self.flush()
            self._writes.put(None)
            self._writer.join(timeout=30)
            self._writer = None
            self.disk.close()

    # --- up ---------------------------------------------------------------------------

    def locate(self, name: bytes, tokens: tuple[int, ...]) -> str | None:
        """Which tier would restore this block: "host", "disk", or None (recompute it)."""
        if self.host is not None and self.host.find(name, tokens) is not None:
            if self.planner.worth_restoring("host", self.block_bytes, len(tokens)):
                return "host"
        if self.disk is not None and self.disk.contains(name):
            if self.planner.worth_restoring("disk", self.block_bytes, len(tokens)):
                return "disk"
            self.stats.skipped_disk += 1
        return None

    def restore(self, tier: str, name: bytes, tokens: tuple[int, ...], page: int) -> bool:
        """Copy a block into GPU page ``page``; False if it turned out to be missing or damaged."""
        t0 = time.perf_counter()
        if tier == "host":
            slot = self.host.find(name, tokens)
            if slot is None:
                return False
            self.kv.write_page(page, self.host.slots[slot])
            self.planner.observe("host", self.block_bytes, time.perf_counter() - t0)
            self.stats.restored_host += 1
        else:
            staging = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.kv.data.is_cuda)
            if not self.disk.get_into(name, list(tokens), staging):
                return False
            self.kv.write_page(page, staging)
            self.planner.observe("disk", self.block_bytes, time.perf_counter() - t0)
            self.stats.restored_disk += 1
        self.stats.restore_seconds += time.perf_counter() - t0
        return True
