"""The host-RAM KV tier: whole KV pages in (pinned) CPU memory, LRU under a byte budget.

A GPU page about to be overwritten is copied here instead of being dropped; a page
here is copied back to the GPU when a request asks for its name. Pinned memory lets
the copies run at the bus's speed (55 GB/s measured on the H200 machine) and
asynchronously on the CUDA stream, so they are ordered with the kernels around them.

A page's tokens are kept packed (``kv.prefix.pack``), as the GPU pages' are: a turn that restores
a 27k-token history finds its ~1,700 blocks with one lookup per name and one comparison of the
joined tokens (``find_run``), rather than a tuple built and compared per block (CPU,
benchmarks/host_turn_cpu.py --tier host: locating them 1.0 -> 0.23 ms, restoring 0.5 -> 0.23).
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from collections import OrderedDict, deque
from operator import itemgetter

import numpy as np
import torch

from qml_runtime.kv.prefix import as_packed

log = logging.getLogger("qml.kv.tiers")


class HostTier:
    def __init__(self, block_bytes: int, budget_bytes: int, pin: bool, shared: bool = True):
        """``shared``: the rows live in a memfd (``fd``), which the disk reader's process maps to read blocks
        into them (``kv.disk_reader``); pinned by registering them with CUDA. Where that fails, or with
        ``shared`` False, they are a private (pinned) allocation and ``fd`` is None."""
        self.block_bytes = block_bytes
        self.capacity = max(0, budget_bytes // block_bytes)
        self.fd: int | None = None
        self.pinned = pin and self.capacity > 0
        # one allocation: slots are rows; pinning is what makes host<->GPU copies fast and async
        slots = _shared_rows(self.capacity, block_bytes, self.pinned) if shared and self.capacity > 0 else None
        if slots is None:
            slots = torch.empty((self.capacity, block_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        else:
            slots, self.fd = slots
            weakref.finalize(self, os.close, self.fd)
        self.slots = slots
        self._lru: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()  # name -> (slot, packed tokens)
        # reversed: pop() hands out ascending slots, so pages spilled together land in runs that
        # copy as one
        self._free = list(range(self.capacity - 1, -1, -1))
        self._held: set[int] = set()  # slots being filled from disk: never evicted until released
        # counts the entries that left (evicted, discarded): slots found before are still theirs while it stands
        self.removals = 0

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_used(self) -> int:
        return len(self._lru) * self.block_bytes

    def find(self, name: bytes, tokens) -> int | None:
        """The slot holding ``name`` if its tokens match (refreshing its recency), else None. ``tokens``:
        packed (``kv.prefix.pack``), or the token ids."""
        entry = self._lru.get(name)
        if entry is None or entry[1] != as_packed(tokens):
            return None
        self._lru.move_to_end(name)
        return entry[0]

    def touch(self, name: bytes) -> bool:
        """Whether ``name`` is here (whatever its tokens); if so, it becomes the most recent, as a
        ``reserve`` of it would make it."""
        if name not in self._lru:
            return False
        self._lru.move_to_end(name)
        return True

    def holds_all(self, names: list[bytes]) -> bool:
        """Whether every one of ``names`` is here (whatever its tokens), without touching their recency."""
        return all(map(self._lru.__contains__, names))

    def touch_all(self, names: list[bytes]) -> None:
        """``touch`` each of ``names`` in order: those here become the most recent, the last one most."""
        lru = self._lru
        # (consumed by a zero-length deque: no Python frame per name, for the ~1,700 of a 27k-token history)
        deque(map(lru.move_to_end, filter(lru.__contains__, names)), maxlen=0)

    def find_run(self, names: list[bytes], packed: bytes | bytearray) -> list[int]:
        """Slots of the longest run of leading blocks held here: block i under ``names[i]`` with the tokens
        of ``packed``'s block i (a name held with other tokens is a miss, and the run ends before it).
        Each found block becomes the most recent, in order, as ``find`` one by one would leave them."""
        if not names:
            return []
        B, odd = divmod(len(packed), len(names))
        if odd:
            raise ValueError(f"{len(packed)} bytes of tokens for {len(names)} blocks")
        entries = list(map(self._lru.get, names))
        if None in entries:
            entries = entries[:entries.index(None)]
        if b"".join(map(itemgetter(1), entries)) != packed[:len(entries) * B]:
            entries = entries[:next(i for i, (_, tokens) in enumerate(entries) if tokens != packed[i * B:(i + 1) * B])]
        deque(map(self._lru.move_to_end, names[:len(entries)]), maxlen=0)
        return list(map(itemgetter(0), entries))

    def reserve(self, name: bytes, tokens) -> tuple[int | None, list[tuple[bytes, bytes, int]]]:
        """A slot for ``name`` (None: no room, or already here) and the entries evicted to make room,
        as (name, packed tokens, slot). An evicted entry's bytes are still in its slot, which may be
        the one returned: the caller spills them before writing the new page. ``tokens``: as ``find``."""
        if self.capacity == 0:
            return None, []
        if name in self._lru:
            self._lru.move_to_end(name)
            return None, []  # already here
        evicted = []
        if not self._free:
            victim = next((n for n, (s, _) in self._lru.items() if s not in self._held), None)
            if victim is None:
                return None, []  # every slot is held by a load in flight
            slot, old_tokens = self._lru.pop(victim)
            self.removals += 1
            evicted.append((victim, old_tokens, slot))
            self._free.append(slot)
        slot = self._free.pop()
        self._lru[name] = (slot, bytes(as_packed(tokens)))
        return slot, evicted

    def hold(self, slot: int) -> None:
        self._held.add(slot)

    def release(self, slot: int) -> None:
        self._held.discard(slot)

    def discard(self, name: bytes) -> None:
        """Forget ``name`` (its slot's bytes are not what the name says: a failed read)."""
        entry = self._lru.pop(name, None)
        if entry is not None:
            self.removals += 1
            self._held.discard(entry[0])
            self._free.append(entry[0])


def _shared_rows(capacity: int, row_bytes: int, pin: bool):
    """(rows, memfd) of ``capacity`` rows in a memfd, registered with CUDA when ``pin``; None where that cannot
    be done here (no memfd, no room, a failed registration). The registration ends with the mapping, once no
    tensor holds it (after its unmapping: the driver keeps the pages until then)."""
    size = capacity * row_bytes
    fd = None
    try:
        fd = os.memfd_create("qml-kv-host", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        rows = torch.frombuffer(mapping, dtype=torch.uint8).view(capacity, row_bytes)
        if pin:
            from qml_runtime.kv.dma import host_register, host_unregister

            host_register(rows.data_ptr(), size)
            weakref.finalize(mapping, host_unregister, rows.data_ptr())
        return rows, fd
    except (AttributeError, OSError, RuntimeError, ValueError) as exc:
        log.warning("host KV tier: shared rows unavailable (%s); a private allocation, read from disk on threads", exc)
        if fd is not None:
            os.close(fd)
        return None


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(position, first slot, length) of the runs of consecutive slots: one copy per run. (Where the
    slots break, found with numpy: 1,700 slots in one run took 0.2 ms one by one, 0.03 so.)"""
    if not slots:
        return []
    starts = (np.flatnonzero(np.diff(np.array(slots)) != 1) + 1).tolist()
    bounds = [0, *starts, len(slots)]
    return [(a, slots[a], b - a) for a, b in zip(bounds, bounds[1:])]

