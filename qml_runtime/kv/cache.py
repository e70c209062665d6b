"""The paged KV pool: per layer, K and V tensors of ``[P, S, Hkv, Dh]``."""

from __future__ import annotations

import torch

from qml_runtime.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks, self.block_size = num_blocks, block_size
        # one allocation for all layers: [L, 2, P, S, Hkv, Dh]
        self.data = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                device=device, dtype=dtype)
        # per layer, the event after which that layer's pages restored from host RAM have landed
        # (KVTiers copies on a side stream, layer by layer): a forward that asks for layer i waits
        # for event i on its own stream, so layer 0 computes while layer 1's pages still arrive
        self._restoring: list | None = None
        self._restore_number = 0  # which restore (KVTiers' count) ``_restoring`` belongs to

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._restoring is not None:
            self._wait(self._restoring[i])
        return self.data[i, 0], self.data[i, 1]

    @property
    def restoring(self) -> bool:
        """Pages are still being restored into the pool (``settle`` before reading it otherwise)."""
        return self._restoring is not None

    def restore_events(self, events: list, number: int = 0) -> None:
        """Events, one per layer in layer order on one stream, of a restore in flight (``number``: its place
        in the stream's order). A newer restore replaces an older one's events: its layer-i event comes
        after all of the older copies. An older one handed in later (a split's copy, held until its
        sequence reads those pages: ``KVTiers.apply_load``) is covered by the newer's events, or was
        waited for when they were settled."""
        assert len(events) == self.data.shape[0], (len(events), self.data.shape[0])
        if self._restoring is not None and number < self._restore_number:
            return
        self._restoring = list(events)
        self._restore_number = number

    def settle(self) -> None:
        """Order what the current stream runs next after every restore in flight (no host wait)."""
        if self._restoring is not None:
            self._wait(self._restoring[-1])
            self._restoring = None

    def _wait(self, event) -> None:
        """The current stream waits for ``event`` (the device waits, not the host)."""
        torch.cuda.current_stream(self.data.device).wait_event(event)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one page across all layers, K and V: the unit the lower tiers store."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    def _page_view(self, buffer: torch.Tensor) -> torch.Tensor:
        L, two, _, S, Hkv, Dh = self.data.shape
        return buffer.view(self.data.dtype).view(L, two, S, Hkv, Dh)

    def read_page(self, page: int, dst: torch.Tensor) -> None:
        """Copy page ``page`` of every layer into ``dst``, a uint8 host buffer of ``block_bytes``."""
        self._page_view(dst).copy_(self.data[:, :, page])

    def write_page(self, page: int, src: torch.Tensor) -> None:
        """The inverse of ``read_page``."""
        self.data[:, :, page].copy_(self._page_view(src))

    def chunk_views(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool as ``[C, P, W]`` and host rows ``table`` ([N, block_bytes] uint8, each laid out as
        ``read_page`` writes it) as ``[N, C, W]``: C = layers x 2 runs of W elements, a page's
        slots of one layer's K or V, contiguous on both sides (``qml_kernels.page_copy``'s layout)."""
        L, two, P = self.data.shape[:3]
        W = self.data[0, 0, 0].numel()
        return self.data.view(L * two, P, W), table.view(self.data.dtype).view(-1, L * two, W)

    def gather_pages(self, pages: torch.Tensor, settle: bool = True) -> torch.Tensor:
        """Pages ``pages`` [n] (int64, on the cache's device) -> [n, block_bytes] uint8 on the device,
        each row laid out as ``read_page`` writes it (two kernels, whatever n). ``settle=False``: the
        caller knows no restore in flight writes these pages (evicted pages: a page being restored
        belongs to a sequence until that sequence's step, which settles, has run)."""
        if settle:
            self.settle()
        n = pages.numel()
        rows = self.data.index_select(2, pages).movedim(2, 0).contiguous()  # [n, L, 2, S, Hkv, Dh]
        return rows.view(n, -1).view(torch.uint8)

    def scatter_pages(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of ``gather_pages``: rows [n, block_bytes] uint8 on the device into ``pages``."""
        self.settle()
        L, two, _, S, Hkv, Dh = self.data.shape
        src = rows.view(self.data.dtype).view(-1, L, two, S, Hkv, Dh).movedim(0, 2)  # [L, 2, n, S, Hkv, Dh]
        self.data.index_copy_(2, pages, src)
