"""The host-RAM KV tier: whole KV pages in (pinned) CPU memory, LRU under a byte budget.

A GPU page about to be overwritten is copied here instead of being dropped; a page
here is copied back to the GPU when a request asks for its name. Pinned memory lets
the copies run at the bus's speed (55 GB/s measured on the H200 machine) and
asynchronously on the CUDA stream, so they are ordered with the kernels around them.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    def __init__(self, block_bytes: int, budget_bytes: int, pin: bool):
        self.block_bytes = block_bytes
        self.capacity = max(0, budget_bytes // block_bytes)
        # one allocation: slots are rows; pinning is what makes host<->GPU copies fast and async
        self.slots = torch.empty((self.capacity, block_bytes), dtype=torch.uint8, pin_memory=pin and self.capacity > 0)
        self._lru: OrderedDict[bytes, tuple[int, tuple[int, ...]]] = OrderedDict()  # name -> (slot, tokens)
        self._free = list(range(self.capacity))

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def bytes_used(self) -> int:
        return len(self._lru) * self.block_bytes

    def find(self, name: bytes, tokens: tuple[int, ...]) -> int | None:
        """The slot holding ``name`` if its tokens match (refreshing its recency), else None."""
        entry = self._lru.get(name)
        if entry is None or entry[1] != tokens:
            return None
        self._lru.move_to_end(name)
        return entry[0]

    def reserve(self, name: bytes, tokens: tuple[int, ...]) -> tuple[int | None, list[tuple[bytes, tuple, int]]]:
        """A slot for ``name`` (None: no room, or already here) and the entries evicted to make room,
        as (name, tokens, slot). An evicted entry's bytes are still in its slot, which may be the
        one returned: the caller spills them before writing the new page."""
        if self.capacity == 0:
            return None, []
        if name in self._lru:
            self._lru.move_to_end(name)
            return None, []  # already here
        evicted = []
        if not self._free:
            old_name, (slot, old_tokens) = self._lru.popitem(last=False)
            evicted.append((old_name, old_tokens, slot))
            self._free.append(slot)
        slot = self._free.pop()
        self._lru[name] = (slot, tokens)
        return slot, evicted

