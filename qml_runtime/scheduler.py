"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step is one forward pass over a ragged batch. Running sequences are served
first (a decoding one needs one token; one whose prompt is still being prefilled
gets as many as the budget allows), then waiting requests are admitted in arrival
order while tokens and pages remain. A long prompt is therefore cut into chunks
and never stalls the decoding of others. When pages run out, the most recently
admitted running sequence is preempted: its pages are freed and it is recomputed
later from its tokens.

With prefix caching, a request is admitted onto the pages of the longest cached
prefix of its tokens (verified token by token) and only the rest is computed; after
every step, pages that became full are named by content so later requests (the next
turn of the conversation, a preempted sequence coming back) can find them.

Finding that prefix is on the host, before the request's first step launches. For the next
turn of a 27k-token conversation (1,700 blocks, CPU, benchmarks/host_turn_cpu.py) it took
~1.4 ms: ~1 ms to hash every block's name again, ~0.3 ms to build and compare a tuple of tokens
per block. A finished sequence's names are now kept (``kv.prefix.KnownChains``) and the next
turn copies those of the tokens it shares with it (one byte comparison), hashing only its new
blocks; the pages' tokens are checked in one comparison of packed bytes (``BlockManager.lookup_run``).

A history evicted to host RAM is found, restored and registered the same way, from the turn's
names and packed tokens: one pass over the host tier (``KVTiers.locate_run``, ``restore_host``)
and one over the pages (``BlockManager.register_run``), no tuple per block. On CPU
(benchmarks/host_turn_cpu.py --tier host, 27k tokens, ~1,700 blocks, the copy itself left out)
the turn's scheduling went 3.8 -> 1.8 ms: locating the blocks 1.0 -> 0.23, restoring them
0.5 -> 0.23, registering them and the rest 2.0 -> 1.15 (most of it now the ~1,700 pages the
restore takes, each evicting another conversation's page). The turn waits for the restore's copy, not
for that bookkeeping: its pages are taken, the copy launched, and only then are the evicted pages'
names dropped (``_admit``; benchmarks/restore_admit_cpu.py: the schedule's time before the copy
1.84-2.03 -> 1.40-1.53 ms on CPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from qml_runtime import turn_trace
from qml_runtime.config import SchedulerConfig
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.kv.prefix import ROOT, TOKEN_BYTES, KnownChains, chain_packed, pack
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # tokens to compute for each sequence in this step

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, fingerprint: bytes = b"",
                 prefix_caching: bool = True, tiers: KVTiers | None = None):
        self.config = config
        self.blocks = blocks
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found
        # names of finished sequences' blocks, for the next turns to copy: a history's worth of them
        # for every page of the pool (its pages may be anywhere in the tiers below it too)
        self.known = KnownChains(blocks.block_size, max_blocks=2 * blocks.num_blocks)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        limit = self.config.budget(len(self.running) + len(self.waiting))
        for seq in list(self.running):
            # recomputed each time: a preemption below can hand tokens back
            budget = limit - sum(batch.num_tokens)
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = self._fit(self._computable(seq), budget, self._decode_rows(batch))
            if n == 0:
                continue  # waiting for blocks to stream in
            if not self._reserve(seq, n, batch):
                continue
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        budget = limit - sum(batch.num_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget, self._decode_rows(batch))
            if n is None:
                break  # keep arrival order: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            if n:
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
        return batch

    def continue_decode(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """The step after a decode step still on the device, scheduled before its tokens are known:
        ``seqs`` are that step's sequences, each with one token to compute (its last token, a
        placeholder). Only when it is the step ``schedule`` would make: every running sequence
        decodes, nobody waits to be admitted, and the pages it needs are free without preempting
        anyone. Otherwise None, with nothing changed."""
        if self.waiting or self.running != seqs or len(seqs) > self.config.budget(len(seqs)):
            return None
        if any(s.num_uncomputed != 1 or s.pending_load is not None for s in seqs):
            return None
        need = sum(self.blocks.blocks_needed(s.block_table, s.num_tokens) for s in seqs)
        if need > self.blocks.num_free:
            return None
        for seq in seqs:
            self.blocks.grow(seq.block_table, seq.num_tokens)
        return ScheduledBatch(list(seqs), [1] * len(seqs))

    @staticmethod
    def _decode_rows(batch: ScheduledBatch) -> int:
        return sum(1 for n in batch.num_tokens if n == 1)

    @staticmethod
    def _fit(want: int, budget: int, decode_rows: int) -> int:
        """The chunk a prefill gets: the budget, or all it wants when the decode rows already in the
        step are what keeps it out. Without this, once k conversations decode, a prompt of exactly
        the budget is cut into two steps, the second of k tokens (32 x 2,048-token prompts on the
        H200: TTFT p50 2.1 s, against 0.94 s with 2,000-token prompts). A step grows by at most
        its decode rows (max_num_seqs)."""
        return want if want <= budget + decode_rows else budget

    def _computable(self, seq: Sequence) -> int:
        """Tokens of ``seq`` that can be computed now: up to where blocks are streaming in, and
        past them once they have landed (copied into their pages here)."""
        load = seq.pending_load
        if load is not None and seq.num_computed == load.start:
            if not load.done() and not self.tiers.cut_load(load):
                return 0
            self._finish_load(seq)
            load = seq.pending_load
        if load is not None:
            return load.start - seq.num_computed
        return seq.num_uncomputed

    def loading(self) -> list:
        """Pending loads of running sequences that wait for nothing else."""
        return [s.pending_load for s in self.running
                if s.pending_load is not None and s.num_computed == s.pending_load.start]

    def _finish_load(self, seq: Sequence) -> None:
        load, seq.pending_load = seq.pending_load, None
        S = self.blocks.block_size
        try:
            landed = self.tiers.apply_load(load)
        except Exception:  # a failed read is a miss: those blocks are computed instead
            landed = 0
        if turn_trace.ENABLED:
            turn_trace.stamp(seq.request_id, "load_applied")
            if load.landing is not None and load.landing.last > load.landing.first:  # (the reader process's reads)
                turn_trace.stamp(seq.request_id, "reads_begun", load.landing.first)
                turn_trace.stamp(seq.request_id, "reads_ended", load.landing.last)
        first = load.start // S
        self.blocks.register_run(load.pages[:landed], load.names[:landed], self._packed(seq, first, first + landed))
        seq.num_computed = load.start + landed * S
        if seq.num_committed == first:
            seq.num_committed = first + landed
        missed = (load.end - load.start) // S - landed
        if missed:  # what did not land is computed instead, on the pages it would have filled
            seq.num_cached -= missed * S
            self.prefix_hits -= missed * S

    def _admit(self, seq: Sequence, budget: int, slack: int = 0) -> int | None:
        """Put the cached prefix of ``seq`` under it and pages for it; returns the first chunk's token
        count (0: it first waits for blocks streaming in), or None if it does not fit (it waits).
        The chunk is ``budget`` tokens, or up to ``slack`` more when that ends the prompt (``_fit``).

        The prefix is the run of full blocks found on GPU pages, continued by blocks found in host
        RAM or on disk, as the restore plan says: copied in now (host), recomputed, or streamed in
        while the blocks before them are recomputed (``RestorePlanner.plan``).
        """
        S = self.blocks.block_size
        turn_trace.stamp(seq.request_id, "admit")
        pages = self._cached_prefix(seq) if self.prefix_caching else []
        below = self._restorable(seq, len(pages)) if self.prefix_caching and self.tiers else []  # their tiers
        if below:
            turn_trace.stamp(seq.request_id, "located")
        on_gpu = len(pages)
        # every block below the GPU gets a page at admission, whether it is copied, loaded or computed
        covered = (on_gpu + len(below)) * S
        worst = max(covered, min(seq.num_tokens, on_gpu * S + budget))
        # pages found in the cache but free right now leave the free list when taken: counted only where the fit
        # is in doubt with all of them taken out (a turn's ~1,700 pages: 0.03 ms on CPU, as many as ``acquire``)
        need = -(-worst // S) - on_gpu
        if need > self.blocks.num_free - len(pages) \
                and need > self.blocks.num_free - list(map(self.blocks.ref.__getitem__, pages)).count(0):
            return None
        self.blocks.acquire(pages)
        seq.block_table = pages
        computed = on_gpu * S
        if below:
            plan = self.tiers.plan(below, S, on_gpu * S, seq.num_tokens - covered)
            turn_trace.stamp(seq.request_id, "planned")
            # the pages the history lands in: the copy into them is launched before the bookkeeping of what
            # they held (their names, the recency of their host copies), which only the tiers' own work and
            # the registrations below read (``BlockManager.take``, ``KVTiers.spill_first``)
            evicted = self.blocks.take(seq.block_table, covered)
            rest = self.tiers.spill_first(evicted)
            turn_trace.stamp(seq.request_id, "evicted")
            got = 0
            try:
                if plan.host_now:
                    end = on_gpu + plan.host_now
                    got = self.tiers.restore_host(seq.block_names[on_gpu:end], self._packed(seq, on_gpu, end),
                                                  seq.block_table[on_gpu:end])
                    turn_trace.stamp(seq.request_id, "restore")  # (its copy launched)
            finally:
                rest()
                self.blocks.forget(evicted)
            if got:
                end = on_gpu + got
                self.blocks.register_run(seq.block_table[on_gpu:end], seq.block_names[on_gpu:end],
                                         self._packed(seq, on_gpu, end))
            computed = (on_gpu + got) * S
            if got == plan.host_now and plan.load:  # (a missing host block: compute from there on)
                first = on_gpu + plan.host_now + plan.recompute
                end = on_gpu + len(below)
                loaded = [(below[i - on_gpu], seq.block_names[i], self._packed(seq, i, i + 1))
                          for i in range(first, end)]
                # (a prefetch: these are host blocks of the run located above, copied from now on)
                seq.pending_load = self.tiers.start_load(loaded, seq.block_table[first:end], first * S, end * S,
                                                         first - on_gpu if plan.prefetch else None)
        seq.num_computed = computed
        seq.num_committed = computed // S
        if not seq.admitted:
            seq.admitted = True
            load = seq.pending_load
            seq.num_cached = computed + (load.end - load.start if load is not None else 0)
            self.prefix_queries += seq.num_prompt_tokens
            self.prefix_hits += seq.num_cached
        # a failed restore leaves more to compute than planned: the chunk stops where pages run out
        room = (len(seq.block_table) + self.blocks.num_free) * S - computed
        n = min(self._fit(self._computable(seq), budget, slack), room)
        if n <= 0 and seq.pending_load is None:
            self.blocks.release(seq.block_table)  # named pages stay cached: the next try finds them
            seq.block_table = []
            seq.num_computed = seq.num_committed = 0
            return None
        n = max(n, 0)
        self.blocks.grow(seq.block_table, seq.num_computed + n)
        return n

    def _drop_load(self, seq: Sequence) -> None:
        """A load not applied (planned again if ``seq`` comes back): its copies must land before its pages
        go to anyone else."""
        load, seq.pending_load = seq.pending_load, None
        if load is not None:
            self.tiers.drop_load(load)

    def _restorable(self, seq: Sequence, start: int) -> list[str]:
        """The tiers ("host", "disk") of the run of blocks from ``start`` on that the lower tiers hold, up to
        the last full block before the last token (as ``_cached_prefix``)."""
        full = (seq.num_tokens - 1) // self.blocks.block_size
        self._name_blocks(seq, full)
        return self.tiers.locate_run(seq.block_names[start:full], self._packed(seq, start, full))

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding the longest cached run of ``seq``'s full blocks, at least one token short of
        the end (the last token must be computed to give the logits of the next one)."""
        full = (seq.num_tokens - 1) // self.blocks.block_size
        self._name_blocks(seq, full)  # all at once: each is needed by now or at commit
        B = self.blocks.block_size * TOKEN_BYTES
        return self.blocks.lookup_run(seq.block_names[:full], seq.named_tokens[:full * B])

    def _name_blocks(self, seq: Sequence, n: int) -> None:
        """Name the first ``n`` full blocks of ``seq`` (those not named yet), in one pass: copied from a
        sequence named before as far as it has the same tokens, hashed from there."""
        have = len(seq.block_names)
        if have >= n:
            return
        S = self.blocks.block_size
        if seq.packed_prompt is not None and n * S <= seq.num_prompt_tokens:  # (the prompt never changes)
            data = seq.packed_prompt[have * S * TOKEN_BYTES:n * S * TOKEN_BYTES]
        else:
            data = pack(seq.token_ids[have * S:n * S])
        known = self.known.names(seq.salt, data) if have == 0 else []
        seq.block_names.extend(known)
        seq.block_names.extend(chain_packed(data[len(known) * S * TOKEN_BYTES:], S, self.fingerprint, seq.salt,
                                            start=seq.block_names[-1] if seq.block_names else ROOT))
        seq.named_tokens += data

    def _packed(self, seq: Sequence, first: int, end: int) -> bytes:
        """The packed tokens of named blocks ``first`` to ``end`` (excluded) of ``seq``: what their names hashed."""
        B = self.blocks.block_size * TOKEN_BYTES
        return bytes(seq.named_tokens[first * B:end * B])

    def commit(self, seq: Sequence) -> None:
        """After a step: name the pages of ``seq`` that became full and computed."""
        if not self.prefix_caching:
            return
        first, full = seq.num_committed, seq.num_computed // self.blocks.block_size
        if full > first:
            self._name_blocks(seq, full)
            self.blocks.register_run(seq.block_table[first:full], seq.block_names[first:full],
                                     self._packed(seq, first, full))
        seq.num_committed = max(seq.num_committed, full)

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
        self._drop_load(seq)
        self.blocks.release(seq.block_table, seq.retain)  # its full pages stay cached: coming back, it finds them
        seq.num_computed = seq.num_committed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the queues and free its pages; its block names are kept for the next turn."""
        if self.prefix_caching and seq.block_names:
            self.known.add(seq.salt, bytes(seq.named_tokens), list(seq.block_names))
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._drop_load(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq.block_table, seq.retain)
