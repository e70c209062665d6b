"""The paged KV pool: per layer, K and V tensors of ``[P, S, Hkv, Dh]``."""

from __future__ import annotations

import torch

from qml_kernels import kv_codec
from qml_runtime.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device, dtype, codec: bool = False):
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
        # rows (a page in the tiers below, all layers) in ``qml_kernels.kv_codec``'s form: ~77% of the bytes
        # over the host link for KV-like bf16, the same bits back; only where the codec applies (bf16, chunks
        # of whole 512-value segments)
        self.codec = codec and kv_codec.codec_applies(self.data.dtype, self._width)
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
        """Bytes of KV in one page across all layers, K and V (what the planner weighs)."""
        return self.data[:, :, 0].numel() * self.data.element_size()

    @property
    def _width(self) -> int:
        """W: values of one page's K (or V) of one layer, a chunk."""
        return self.data[0, 0, 0].numel()

    @property
    def row_bytes(self) -> int:
        """Bytes of one page as the lower tiers store it (a host slot, a disk payload): ``block_bytes`` raw,
        or the codec's chunks (``kv_codec.encoded_chunk_bytes``) for each layer's K and V."""
        if not self.codec:
            return self.block_bytes
        return self.data.shape[0] * 2 * kv_codec.encoded_chunk_bytes(self._width)

    def _page_view(self, buffer: torch.Tensor) -> torch.Tensor:
        L, two, _, S, Hkv, Dh = self.data.shape
        return buffer.view(self.data.dtype).view(L, two, S, Hkv, Dh)

    def read_page(self, page: int, dst: torch.Tensor) -> None:
        """Copy page ``page`` of every layer into ``dst``, a uint8 host buffer of ``row_bytes``."""
        if self.codec:
            L, two = self.data.shape[:2]
            values = self.data[:, :, page].reshape(L * two, self._width).to(dst.device)
            kv_codec.encode_chunks_ref(values, dst.view(L * two, -1))
            return
        self._page_view(dst).copy_(self.data[:, :, page])

    def write_page(self, page: int, src: torch.Tensor) -> None:
        """The inverse of ``read_page``."""
        if self.codec:
            L, two = self.data.shape[:2]
            values = kv_codec.decode_chunks_ref(src.view(L * two, -1), self._width)
            self.data[:, :, page].copy_(values.view(self.data[:, :, page].shape))
            return
        self.data[:, :, page].copy_(self._page_view(src))

    def _chunks(self) -> torch.Tensor:
        """The pool as ``[C, P, W]``."""
        L, two, P = self.data.shape[:3]
        return self.data.view(L * two, P, self._width)

    def chunk_views(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool as ``[C, P, W]`` and host rows ``table`` ([N, row_bytes] uint8, each laid out as
        ``read_page`` writes it) as ``[N, C, W]`` (raw: ``qml_kernels.page_copy``'s layout) or ``[N, C, E]``
        uint8 (the codec's: ``kv_codec.kv_load``'s): C = layers x 2 runs of W elements, a page's slots of
        one layer's K or V, contiguous on both sides."""
        L, two = self.data.shape[:2]
        W = self._width
        pool = self._chunks()
        if self.codec:
            return pool, table.view(-1, L * two, kv_codec.encoded_chunk_bytes(W))
        return pool, table.view(self.data.dtype).view(-1, L * two, W)

    def gather_pages(self, pages: torch.Tensor, settle: bool = True) -> torch.Tensor:
        """Pages ``pages`` [n] (int64, on the cache's device) -> [n, row_bytes] uint8 on the device,
        each row laid out as ``read_page`` writes it (two kernels, whatever n; one with the codec).
        ``settle=False``: the caller knows no restore in flight writes these pages (evicted pages: a page
        being restored belongs to a sequence until that sequence's step, which settles, has run)."""
        if settle:
            self.settle()
        n = pages.numel()
        if self.codec:
            pool = self._chunks()
            rows = torch.empty(n, pool.shape[0], kv_codec.encoded_chunk_bytes(self._width), dtype=torch.uint8,
                               device=self.data.device)
            kv_codec.kv_save(rows, torch.arange(n, device=pages.device), pool, pages)
            return rows.view(n, -1)
        rows = self.data.index_select(2, pages).movedim(2, 0).contiguous()  # [n, L, 2, S, Hkv, Dh]
        return rows.view(n, -1).view(torch.uint8)

    def scatter_pages(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of ``gather_pages``: rows [n, row_bytes] uint8 on the device into ``pages``."""
        self.settle()
        if self.codec:
            pool, table = self.chunk_views(rows)
            kv_codec.kv_load(pool, pages, table, torch.arange(pages.numel(), device=pages.device))
            return
        L, two, _, S, Hkv, Dh = self.data.shape
        src = rows.view(self.data.dtype).view(-1, L, two, S, Hkv, Dh).movedim(0, 2)  # [L, 2, n, S, Hkv, Dh]
        self.data.index_copy_(2, pages, src)
