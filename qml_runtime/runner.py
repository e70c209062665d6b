"""One engine step on the device: build the batch's inputs, run the model, sample.

Decode batches (one new token per sequence) replay a CUDA graph when the runner has them
(qml_runtime.cuda_graphs); prefill and mixed batches run eagerly, with the metadata built
on the host in one pass and sent in a few copies, so no layer waits on the device.
"""

from __future__ import annotations

import time

import torch

from qml_kernels.attention import AttentionMetadata
from qml_kernels.sampling import sample
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from qml_runtime.kv.cache import KVCache
from qml_runtime.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device, *,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None):
        self.model, self.kv, self.device = model, kv, device
        self.block_size = kv.block_size
        self.graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        # host time from the start of a step until its work is queued on the device (the rest
        # of the step is waiting for the tokens): when it nears the step time, the host is the limit
        self.launch_seconds = 0.0

    def capture(self) -> None:
        for family in (self.prefill_graphs, self.graphs):  # the largest graphs first: they size the pool
            if family is not None and family.capture_enabled:
                family.capture_all()

    def _prepare(self, batch: ScheduledBatch):
        S = self.block_size
        ids, positions, slots = [], [], []
        cu_seqlens_q, context_lens, sample_rows = [0], [], []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed, seq.num_computed + n
            ids.extend(seq.token_ids[start:end])
            pos = torch.arange(start, end)
            positions.append(pos)
            table = torch.tensor(seq.block_table[start // S:(end - 1) // S + 1])
            slots.append(table[pos // S - start // S] * S + pos % S)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            context_lens.append(end)
            if end == seq.num_tokens:  # the whole sequence is in cache: its next token can be sampled
                sample_rows.append(cu_seqlens_q[-1] - 1)
        dev = self.device
        slot_list = torch.cat(slots)
        meta = AttentionMetadata.build(slot_list, [s.block_table for s in batch.seqs], cu_seqlens_q, context_lens, dev)
        return (torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True),
                torch.cat(positions).to(dev, non_blocking=True), meta, sample_rows)

    def _graph_tokens(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's sampled tokens through a CUDA graph [B] (device), or None when no graph fits."""
        seqs, counts = batch.seqs, batch.num_tokens
        g = self.graphs
        if g is not None and all(n == 1 for n in counts) and all(s.num_computed + 1 == s.num_tokens for s in seqs) \
                and g.fits(len(seqs), max(len(s.block_table) for s in seqs)):
            return g.run(seqs)
        p = self.prefill_graphs
        if p is not None and len(seqs) == 1 and p.fits(counts[0], len(seqs[0].block_table)):
            return p.run(seqs[0], counts[0])
        return None

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> list[int | None]:
        """Run the batch; returns, per sequence, the sampled token or None (prefill chunk not last)."""
        t0 = time.perf_counter()
        tokens = self._graph_tokens(batch)
        if tokens is not None:
            for seq, n in zip(batch.seqs, batch.num_tokens):
                seq.num_computed += n
            self.launch_seconds += time.perf_counter() - t0
            values = tokens.tolist()
            return [t if s.num_computed == s.num_tokens else None for s, t in zip(batch.seqs, values)]
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv, meta)  # [T, D]
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        sampling = [s for s in batch.seqs if s.num_computed == s.num_tokens]
        if not sampling:
            return [None] * len(batch.seqs)
        logits = self.model.logits(hidden[sample_rows])  # [B', V]
        tokens = self._sample(logits, sampling, t0)
        by_seq = dict(zip(map(id, sampling), tokens))
        return [by_seq.get(id(s)) for s in batch.seqs]

    def _sample(self, logits: torch.Tensor, seqs: list, t0: float) -> list[int]:
        params = [s.params for s in seqs]
        # one host tensor per dtype, one copy each: explicit dtypes, since a request may give
        # temperature=1 as an int
        floats = torch.tensor([[p.temperature for p in params], [p.top_p for p in params],
                               [p.min_p for p in params]], dtype=torch.float32).to(logits.device, non_blocking=True)
        ints = torch.tensor([[p.top_k for p in params], [s.seed for s in seqs],
                             [s.num_output_tokens for s in seqs]], dtype=torch.int64).to(logits.device,
                                                                                         non_blocking=True)
        tokens = sample(logits, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2])
        self.launch_seconds += time.perf_counter() - t0
        return tokens.tolist()
