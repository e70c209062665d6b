"""Allocation of KV pages to sequences (block tables)."""

from __future__ import annotations

from collections import deque


class BlockManager:
    """A free list of page ids; a sequence holds the pages in its block table, in token order."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Pages to add so that ``block_table`` covers ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(block_table, num_tokens) <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append pages to ``block_table`` in place until it covers ``num_tokens`` tokens."""
        need = self.blocks_needed(block_table, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"KV cache: {need} pages needed, {len(self._free)} free")
        block_table.extend(self._free.popleft() for _ in range(need))

    def release(self, block_table: list[int]) -> None:
        self._free.extend(block_table)
        block_table.clear()
