"""Kept pages written through to disk from their host-RAM copies (``KVTiers.persist``).

A kept page that gets a host slot is not gathered on the GPU for the disk writer: it waits here
until the copy into its slot is queued, then goes to the writer, which reads the pinned row in
place (``DiskWriter.put_block(borrowed=True)``). Its bytes cross the link once and no device
staging holds them. Two states per slot:

- waiting: registered, its copy down not queued yet (the pump defers it). A slot that changes
  hands first (``evicted``) drops the registration: the eviction writes the entry from a copy.
- borrowed: handed over; the writer may still read the row. Before the slot takes other bytes
  (``reusing``), the writer detaches the block (a copy of the row, or a wait for its write).
"""

from __future__ import annotations

import torch


class HostWrites:
    def __init__(self):
        self._waiting: dict[int, tuple[bytes, bytes, bytes | None]] = {}  # slot -> (name, tokens, parent)
        self._waiting_names: set[bytes] = set()  # the same names, for ``KVTiers._on_disk``'s question
        self._borrowed: dict[int, bytes] = {}  # slot -> name handed to the writer (maybe written since)

    def __len__(self) -> int:
        """Blocks waiting for their host copy."""
        return len(self._waiting)

    def __contains__(self, name: bytes) -> bool:
        return name in self._waiting_names

    def register(self, slot: int, name: bytes, tokens: bytes, parent: bytes | None) -> None:
        self._waiting[slot] = (name, tokens, parent)
        self._waiting_names.add(name)

    def waiting_slots(self) -> set[int]:
        return set(self._waiting)

    def evicted(self, slot: int) -> tuple[bool, bytes | None]:
        """The entry in ``slot`` leaves host RAM: (whether a write waited for it, its parent name)."""
        block = self._waiting.pop(slot, None)
        if block is None:
            return False, None
        self._waiting_names.discard(block[0])
        return True, block[2]

    def hand_over(self, slots: list[int], ready, rows: torch.Tensor, writer) -> None:
        """Copies into host ``slots`` (rows of ``rows``) are queued, complete once ``ready`` has passed
        (None: done): the blocks waiting for them go to ``writer``, borrowing their rows."""
        if not self._waiting:
            return
        for slot in slots:
            block = self._waiting.pop(slot, None)
            if block is not None:
                name, tokens, parent = block
                self._waiting_names.discard(name)
                self._borrowed[slot] = name
                writer.put_block(name, tokens, rows[slot], parent, ready, borrowed=True)

    def reusing(self, slot: int, writer) -> None:
        """``slot`` is about to take other bytes: a write that may still read it gets its own copy."""
        name = self._borrowed.pop(slot, None)
        if name is not None:
            writer.detach(name)
