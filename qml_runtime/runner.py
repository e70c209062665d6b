"""One engine step on the device: build the batch's inputs, run the model, sample.

Decode batches (one new token per sequence) replay a CUDA graph when the runner has them
(qml_runtime.cuda_graphs); prefill and mixed batches run eagerly, with the metadata built
on the host in one pass and sent in a few copies, so no layer waits on the device.

The graphs sample inside themselves. When a sequence of the step needs more than the
sampler does (logit bias, penalties, min_tokens: qml_runtime.logits) or asks for
logprobs, the step's logits are taken from the graph (its ``last_logits`` buffer) and
processed, sampled and turned into logprobs outside it, batched on the device; the
graph's own tokens are dropped. Steps of plain requests never pay for that.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qml_kernels.attention import AttentionMetadata, host_to_device
from qml_kernels.sampling import sample
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs, sampling_rows
from qml_runtime.kv.cache import KVCache
from qml_runtime.logits import LogitsProcessor, gather_logprobs
from qml_runtime.sampling_params import TokenLogprob
from qml_runtime.scheduler import ScheduledBatch

Logprobs = list[TokenLogprob | None] | None  # per sequence of the step; None when no sequence asked

# A prompt chunk of at least this many tokens over at least CHUNK_EAGER_CONTEXT cached ones runs eagerly where
# qml_kernels.attention_chunk can take its attention (cuDNN's paged SDPA, not captured: a graph's lengths change on
# the device), rather than replaying a prefill graph (Triton's attention). Such a step's GPU time (~50 ms at 1,024
# tokens over 20k for Llama-3.1-8B) is well above its launches' host time (~20 ms), so the graph saves nothing,
# while cuDNN's attention is faster: 2,048 queries over 21,504 keys 1.48 against 1.94 ms a layer (H100).
# QML_CHUNK_EAGER=0 keeps the graphs.
CHUNK_EAGER_TOKENS = 1024
CHUNK_EAGER_CONTEXT = 8192


@dataclass
class Launched:
    """A decode step queued on the device and not waited for (``ModelRunner.launch``)."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # [B] on the device: the graph's output buffer, the next step's inputs
    host: torch.Tensor  # [B] the tokens' copy on the host, valid once ``ready`` has passed
    ready: torch.cuda.Event | None  # None on CPU, where the copy is done when queued
    launch_seconds: float


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device, *,
                 decode_graphs: DecodeGraphs | None = None, prefill_graphs: PrefillGraphs | None = None,
                 stop_ids: frozenset[int] = frozenset()):
        self.model, self.kv, self.device = model, kv, device
        self.logits_processor = LogitsProcessor(device, stop_ids)
        self.block_size = kv.block_size
        self.graphs = decode_graphs
        self.prefill_graphs = prefill_graphs
        # host time from the start of a step until its work is queued on the device (the rest
        # of the step is waiting for the tokens): when it nears the step time, the host is the limit
        self.launch_seconds = 0.0
        self.eager_long_chunks = device.type == "cuda" and os.environ.get("QML_CHUNK_EAGER", "1") != "0"

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
        # every input through pinned memory (host_to_device): the host queues the whole step, the rows to
        # sample included, without waiting for the device, which may still wait for restored KV
        return (host_to_device(torch.tensor(ids, dtype=torch.int64), dev),
                host_to_device(torch.cat(positions), dev), meta,
                host_to_device(torch.tensor(sample_rows, dtype=torch.int64), dev))

    def _graph_tokens(self, batch: ScheduledBatch):
        """The step's sampled tokens through a CUDA graph [B] (device) and the graph family that ran
        (its ``last_logits`` hold the step's logits), or None when no graph fits."""
        seqs, counts = batch.seqs, batch.num_tokens
        if self._is_decode(batch) and self._decode_graph_fits(seqs):
            self.kv.settle()  # a replay waits for restores in flight as a whole
            return self.graphs.run(seqs), self.graphs
        p = self.prefill_graphs
        # with pages still arriving from host RAM the prefill runs eagerly: each layer then waits
        # only for its own pages (KVCache.layer), and computes while the later layers' arrive
        if p is not None and len(seqs) == 1 and not self.kv.restoring \
                and p.fits(counts[0], len(seqs[0].block_table)) and not self._long_chunk(seqs[0], counts[0]):
            return p.run(seqs[0], counts[0]), p
        return None

    def _long_chunk(self, seq, n: int) -> bool:
        """A chunk that runs faster eagerly, its attention on cuDNN (``CHUNK_EAGER_TOKENS``)."""
        if not (self.eager_long_chunks and n >= CHUNK_EAGER_TOKENS and seq.num_computed >= CHUNK_EAGER_CONTEXT):
            return False
        from qml_kernels import attention_chunk

        return attention_chunk.available()

    @staticmethod
    def _is_decode(batch: ScheduledBatch) -> bool:
        """One token for each sequence, its last (the step samples every row)."""
        return all(n == 1 for n in batch.num_tokens) and all(s.num_computed + 1 == s.num_tokens for s in batch.seqs)

    def _decode_graph_fits(self, seqs: list, extra_pages: int = 0) -> bool:
        g = self.graphs
        return g is not None and g.fits(len(seqs), max(len(s.block_table) for s in seqs) + extra_pages)

    def can_launch(self, seqs: list, extra_pages: int = 0) -> bool:
        """Whether the decode step of ``seqs`` (one token each) can be launched without waiting for it:
        a decode graph takes it, each table grown by up to ``extra_pages``, and no row needs sampling
        outside the graph."""
        return self._decode_graph_fits(seqs, extra_pages) and not any(s.custom_sampling for s in seqs)

    def launchable(self, batch: ScheduledBatch) -> bool:
        """Whether ``batch`` is a decode step that ``launch`` takes (``can_launch``)."""
        return self._is_decode(batch) and self.can_launch(batch.seqs)

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: Launched | None = None) -> Launched:
        """Queue a plain decode step (``can_launch``) and return without waiting for its tokens.

        ``after``: the step launched just before, over the same sequences in the same order, not
        waited for either: its tokens (still on the device) are this step's inputs, and each
        sequence's last token is a placeholder the engine fills in once that step is collected.
        The tokens are copied to the host behind the step, so the next replay of the same graph
        (which rewrites its output buffer) cannot overtake the copy."""
        t0 = time.perf_counter()
        seqs = batch.seqs
        assert self._is_decode(batch)
        self.kv.settle()
        tokens = self.graphs.run(seqs, None if after is None else after.tokens)
        for seq in seqs:
            seq.num_computed += 1
        cuda = tokens.device.type == "cuda"
        host = torch.empty(len(seqs), dtype=tokens.dtype, pin_memory=cuda)
        host.copy_(tokens, non_blocking=cuda)
        ready = None
        if cuda:
            ready = torch.cuda.Event()
            ready.record()
        elapsed = time.perf_counter() - t0
        self.launch_seconds += elapsed
        return Launched(batch, tokens, host, ready, elapsed)

    @staticmethod
    def collect(launched: Launched) -> list[int]:
        """Wait for a launched step; its tokens, one per sequence."""
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.host.tolist()

    def release(self, seq) -> None:
        """``seq`` is finished: free its logits-processing state."""
        self.logits_processor.release(seq)

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch, eager: bool = False,
             while_running: Callable[[], None] | None = None) -> tuple[list[int | None], Logprobs]:
        """Run the batch; returns, per sequence, the sampled token or None (prefill chunk not last),
        and the tokens' logprobs for the sequences that asked (None when none did). ``eager``: no
        CUDA graph even where one fits (the warm-up runs the path a restoring turn takes).
        ``while_running``: called once the step's kernels are queued, before the host waits for
        its tokens (host work that then hides behind the device's; the tokens are copied down
        before it, so device work it queues does not delay them)."""
        try:
            return self._step(batch, eager, while_running)
        finally:
            self.kv.settle()  # a failed step too: nothing after it may overtake a restore it was to read

    @staticmethod
    def _host_values(tokens: torch.Tensor, while_running: Callable[[], None] | None) -> list[int]:
        """``tokens.tolist()``, with ``while_running`` called in between the copy's launch and the wait."""
        if while_running is None:
            return tokens.tolist()
        if tokens.device.type != "cuda":
            while_running()
            return tokens.tolist()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        while_running()
        ready.synchronize()
        return host.tolist()

    def _step(self, batch: ScheduledBatch, eager: bool = False,
              while_running: Callable[[], None] | None = None) -> tuple[list[int | None], Logprobs]:
        t0 = time.perf_counter()
        special = any(s.custom_sampling for s in batch.seqs)
        ran = None if eager else self._graph_tokens(batch)
        if ran is not None:
            tokens, family = ran
            for seq, n in zip(batch.seqs, batch.num_tokens):
                seq.num_computed += n
            if not special:
                self.launch_seconds += time.perf_counter() - t0
                values = self._host_values(tokens, while_running)
                return [t if s.num_computed == s.num_tokens else None for s, t in zip(batch.seqs, values)], None
            # the graph's own tokens are dropped: its logits are sampled again, processed, below
            rows = [i for i, s in enumerate(batch.seqs) if s.num_computed == s.num_tokens]
            if not rows:
                if while_running is not None:
                    while_running()
                return [None] * len(batch.seqs), None
            sampling = [batch.seqs[i] for i in rows]
            n = len(rows)  # the sampling rows are the first ones of the graph's batch
            params = family.sampling
            drawn = self._draw(family.last_logits[:n], sampling, params.floats[:, :n], params.ints[:, :n], t0,
                               while_running)
            return self._per_seq(batch.seqs, sampling, *drawn)
        input_ids, positions, meta, sample_index = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv, meta)  # [T, D]
        self.kv.settle()  # what runs next (sampling, graphs, spills) comes after every restored layer
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        sampling = [s for s in batch.seqs if s.num_computed == s.num_tokens]
        if not sampling:
            if while_running is not None:
                while_running()
            return [None] * len(batch.seqs), None
        logits = self.model.logits(hidden.index_select(0, sample_index))  # [B', V]
        floats, ints = self._sampling_tensors(sampling, logits.device)
        return self._per_seq(batch.seqs, sampling, *self._draw(logits, sampling, floats, ints, t0, while_running))

    @staticmethod
    def _per_seq(seqs: list, sampling: list, tokens: list[int], logprobs: Logprobs) -> tuple[list, Logprobs]:
        """The sampled rows' results spread over the whole batch (None where a sequence sampled nothing)."""
        by_seq = dict(zip(map(id, sampling), range(len(sampling))))
        rows = [by_seq.get(id(s)) for s in seqs]
        out_tokens = [None if r is None else tokens[r] for r in rows]
        if logprobs is None:
            return out_tokens, None
        return out_tokens, [None if r is None else logprobs[r] for r in rows]

    @staticmethod
    def _sampling_tensors(seqs: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        floats, ints = sampling_rows(seqs)
        return host_to_device(floats, device), host_to_device(ints, device)

    def _draw(self, logits: torch.Tensor, seqs: list, floats: torch.Tensor, ints: torch.Tensor,
              t0: float, while_running: Callable[[], None] | None = None) -> tuple[list[int], Logprobs]:
        """Sample one token per row of ``logits`` [B, V] (row i: seqs[i]) with the sampling parameters
        ``floats`` (temperature, top_p, min_p) [3, B] and ``ints`` (top_k, seed, step) [3, B], after
        the logits processing the rows ask for; logprobs from the raw ``logits``."""
        special = any(s.params.processes_logits for s in seqs)
        processed = self.logits_processor.process(logits, seqs) if special else logits
        tokens = sample(processed, floats[0], ints[0], floats[1], floats[2], ints[1], ints[2])
        if special:
            self.logits_processor.observe(seqs, tokens)
        self.launch_seconds += time.perf_counter() - t0
        values = self._host_values(tokens, while_running)
        logprobs = gather_logprobs(logits, tokens, seqs) \
            if any(s.params.logprobs is not None for s in seqs) else None
        return values, logprobs
