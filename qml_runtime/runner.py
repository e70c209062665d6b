"""One engine step on the device: build the batch's inputs, run the model, sample."""

from __future__ import annotations

import torch

from qml_kernels.attention import AttentionMetadata
from qml_kernels.sampling import sample
from qml_runtime.kv.cache import KVCache
from qml_runtime.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size

    def _prepare(self, batch: ScheduledBatch):
        ids, positions, slots = [], [], []
        cu_seqlens_q, context_lens, sample_rows = [0], [], []
        S = self.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // S] * S + p % S for p in range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            context_lens.append(end)
            if end == seq.num_tokens:  # the whole sequence is in cache: its next token can be sampled
                sample_rows.append(cu_seqlens_q[-1] - 1)
        dev = self.device
        meta = AttentionMetadata.build(slots, [s.block_table for s in batch.seqs], cu_seqlens_q, context_lens, dev)
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), meta, sample_rows)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> list[int | None]:
        """Run the batch; returns, per sequence, the sampled token or None (prefill chunk not last)."""
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv, meta)  # [T, D]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        sampling = [s for s in batch.seqs if s.num_computed == s.num_tokens]
        if not sampling:
            return [None] * len(batch.seqs)
        logits = self.model.logits(hidden[sample_rows])  # [B', V]
        params = [s.params for s in sampling]
        dev = logits.device
        f32, i64 = torch.float32, torch.int64  # explicit: a request may give temperature=1 as an int
        tokens = sample(
            logits,
            torch.tensor([p.temperature for p in params], dtype=f32, device=dev),
            torch.tensor([p.top_k for p in params], dtype=i64, device=dev),
            torch.tensor([p.top_p for p in params], dtype=f32, device=dev),
            torch.tensor([p.min_p for p in params], dtype=f32, device=dev),
            torch.tensor([s.seed for s in sampling], dtype=i64, device=dev),
            torch.tensor([s.num_output_tokens for s in sampling], dtype=i64, device=dev),  # the step
        ).tolist()
        by_seq = dict(zip(map(id, sampling), tokens))
        return [by_seq.get(id(s)) for s in batch.seqs]
