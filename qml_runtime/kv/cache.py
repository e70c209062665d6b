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

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, 0], self.data[i, 1]

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

    def gather_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages ``pages`` [n] (int64, on the cache's device) -> [n, block_bytes] uint8 on the device,
        each row laid out as ``read_page`` writes it (two kernels, whatever n)."""
        n = pages.numel()
        rows = self.data.index_select(2, pages).movedim(2, 0).contiguous()  # [n, L, 2, S, Hkv, Dh]
        return rows.view(n, -1).view(torch.uint8)

    def scatter_pages(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """The inverse of ``gather_pages``: rows [n, block_bytes] uint8 on the device into ``pages``."""
        L, two, _, S, Hkv, Dh = self.data.shape
        src = rows.view(self.data.dtype).view(-1, L, two, S, Hkv, Dh).movedim(0, 2)  # [L, 2, n, S, Hkv, Dh]
        self.data.index_copy_(2, pages, src)
