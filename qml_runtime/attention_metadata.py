"""Per-step attention metadata: built once per batch by the runner, read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and what each query sees.

    The batch is B sequences with ragged query counts; see ``qml_kernels.attention``
    for the conventions. Host lists are kept beside device tensors so reference code
    can loop without synchronizing with the device.
    """

    slot_mapping: torch.Tensor  # [T] int64, cache slot written by each token
    block_tables: torch.Tensor  # [B, pages per seq] int32
    cu_seqlens_q: list[int]  # [B+1] query row offsets
    context_lens: list[int]  # [B] tokens in cache after this step

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)
