"""The spills waiting for their copy down: (GPU page, host slot) pairs, with their slots counted.

``KVTiers`` queues a pair when a cached page is evicted for reuse (or a kept page's deferred copy
must happen now) and gathers the whole queue at the next ``flush_spills``. Before a full host tier
hands a slot to a new page it asks whether that slot's copy is still queued (``_settle_slot``),
once per entry it evicts: with the queue a list, a turn that restored a 27k-token history and
evicted ~1,700 entries asked ~1,700 times over a queue of up to ~1,700 pairs (~1.4M comparisons on
the engine thread). The count per slot answers in O(1) and stays in step with the pairs because
every change goes through this class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator


class SpillQueue:
    def __init__(self) -> None:
        self._pairs: list[tuple[int, int]] = []
        self._slots: Counter[int] = Counter()

    def append(self, page: int, slot: int) -> None:
        self._pairs.append((page, slot))
        self._slots[slot] += 1

    def extend(self, pairs: Iterable[tuple[int, int]]) -> None:
        for page, slot in pairs:
            self.append(page, slot)

    def has_slot(self, slot: int) -> bool:
        """A queued copy goes into host slot ``slot``."""
        return slot in self._slots

    def any_slot_in(self, slots: set[int]) -> bool:
        """A queued copy goes into one of ``slots``."""
        small, large = (slots, self._slots) if len(slots) <= len(self._slots) else (self._slots, slots)
        return any(slot in large for slot in small)

    def drain_by_slot(self) -> list[tuple[int, int]]:
        """Every queued pair, in host-slot order (a copy per run of consecutive slots), and the queue
        empty."""
        pairs = sorted(self._pairs, key=lambda pair: pair[1])
        self._pairs, self._slots = [], Counter()
        return pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def __bool__(self) -> bool:
        return bool(self._pairs)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._pairs)
