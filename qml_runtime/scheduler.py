"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is one forward pass over a ragged batch. Running sequences are served
first (a decoding one needs one token; one whose prompt is still being prefilled
gets as many as the budget allows), then waiting requests are admitted in arrival
order while tokens and pages remain. A long prompt is therefore cut into chunks
and never stalls the decoding of others. When pages run out, the most recently
admitted running sequence is preempted: its pages are freed and it is recomputed
later from its tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from qml_runtime.config import SchedulerConfig
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens to compute for each sequence in this step

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager):
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        for seq in list(self.running):
            # recomputed each time: a preemption below can hand tokens back
            budget = self.config.max_batched_tokens - sum(batch.num_tokens)
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            if not self._reserve(seq, n, batch):
                continue
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        budget = self.config.max_batched_tokens - sum(batch.num_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_grow(seq.block_table, seq.num_computed + n):
                break  # keep arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Get pages for ``n`` more tokens of ``seq``, preempting later sequences if needed."""
        target = seq.num_computed + n
        while not self.blocks.can_grow(seq.block_table, target):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        self.blocks.grow(seq.block_table, target)
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if seq in batch.seqs:
            i = batch.seqs.index(seq)
            del batch.seqs[i], batch.num_tokens[i]
        self.blocks.release(seq.block_table)
        seq.num_computed = 0
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues and free its pages."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table)
