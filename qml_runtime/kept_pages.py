"""A finished request's pages handed to the KV tiers after it (``KeptPages``, the engine's mixin): when, how
many at a time, and what holds that work back.

The hand-over (``KVTiers.persist``: host slots for the pages, their disk write-through) is Python on the
engine thread, ~40 us a page on the H200 when it evicts host entries, and a 27k-token request has ~1,700
pages. Whatever the thread does when the next request arrives delays that request, so the pages go in large
chunks only where nothing can wait on them (beside a step, whose tokens the host waits for anyway; while a
decode step is on the device; at shutdown), and otherwise in small chunks, with the inbox checked between
them, and not at all while a request is being prepared (``expect_request``).
"""

from __future__ import annotations

import time

# a finished request's pages handed to the tiers this many at a time, between which a new request goes
# first while idle (a 27k-token request's 1,700 pages took ~5-8 ms of the engine thread on the H200, and
# the next request, sent as soon as the client had the last token, waited for all of it)
PERSIST_CHUNK = 256
# while idle the chunk is smaller: a request arriving meanwhile waits for the chunk in hand, and 256 pages
# took ~2 ms of the H200 engine thread (in-process host turn, --call-timers: 8.4 ms in 4 calls), which the
# next turn of a conversation, sent as soon as its client had the last token, spent waiting. At 64 the turn
# right after a fresh 27k-token prompt still found a chunk in hand (its schedule began 2-4 ms after it
# arrived, H200 in-process --call-timers, 2026-12-03): a page costs ~40 us there (a host slot evicted, its
# bytes copied for the disk writer), so 16. At 16 the chunk in hand at a turn's arrival still took 0.7-2.1 ms
# when its pages evicted host entries not yet on disk (H200 in-process, --call-timers spans, 2026-12-04), so 4
PERSIST_IDLE_CHUNK = 4
# a request on its way (its body parsed, its prompt rendered and tokenized on the server's threads, or being
# built in ``submit``) holds the idle loop's background work (handing pages to the tiers, pumping them down)
# for up to this long: that work is Python on the engine thread, and it shared the GIL with the request being
# prepared (H200 in-process, --call-timers spans: persist chunks went on 1.2-2.4 ms after a turn's submit
# began, before it reached the inbox). ``expect_request`` starts the hold, ``submit`` ends it.
EXPECT_HOLD_S = 0.05
# after a step, the pages of requests that ended before it go on for this share of the step's time (at
# least one chunk): under back-to-back long prompts the loop is never idle, and with one chunk a step
# the pages left waiting were evicted by later prompts before they went down, as spills (gathered
# beside those prompts, then copied both ways at once beside a restore: the H200's first host turn
# after a burst went 88 -> 152 ms)
PERSIST_SHARE = 0.02
# while a prefill of 64 tokens or more runs, the pages go down for up to this share of its expected time
# (the host has nothing else to do until its tokens are ready; on the H200 the 2% after a 20k-token
# prompt's step held the next request for ~13 ms, in-process --call-timers). Then none after the step.
PERSIST_BESIDE_SHARE = 0.5
# kept pages are pumped down beside a prefill of at least this many new tokens: a burst's prompts, not a
# conversation's next turn, whose first token is the latency that counts (a long prefill hides the copies:
# ~7 of an 8,890-token prompt's 173 ms on the H200). Sessions bench on the H200 (Llama-3.1-8B shapes,
# results/sessions-h200-2026-12-04.md): the pump switched off entirely took the second user's GPU turn
# 25.0 -> 22.3 ms but the host turn after a burst 97.5 -> 123.6; with this rule the host row stayed (91.3)
# and the second user's turn too (24.7: its time goes elsewhere), so it costs nothing measured
PUMP_BESIDE_MIN_TOKENS = 1024



class KeptPages:
    """The engine's hand-over of finished requests' pages to the tiers. Uses the engine's ``_to_persist``
    (entries ``[table, names, next index, loop step it ended in]``, oldest first), ``_expected_until``,
    ``_inbox``, ``_stopping``, ``loop_steps``, ``blocks``, ``scheduler``, ``tiers`` and ``context_length``."""

    def expect_request(self, seconds: float = EXPECT_HOLD_S) -> None:
        """A request is being prepared for ``submit`` (its body parsed, its prompt rendered and tokenized):
        while idle, the loop holds its background work (pages handed to the tiers, pumped down) until it
        arrives, for at most ``seconds``, so that the two do not share the host (and the GIL) meanwhile."""
        self._expected_until = max(self._expected_until, time.monotonic() + seconds)

    def _expecting(self) -> float:
        """Seconds left of a hold started by ``expect_request`` (0: none)."""
        return max(0.0, self._expected_until - time.monotonic())

    def _persist_beside(self, step_seconds: float) -> None:
        """While a prefill expected to take ``step_seconds`` runs: ``PERSIST_BESIDE_SHARE`` of it."""
        self._persist(budget_s=PERSIST_BESIDE_SHARE * step_seconds, during_step=True)

    def _persist_after(self, step_seconds: float) -> None:
        """After a step that took ``step_seconds``: ``PERSIST_SHARE`` of it."""
        self._persist(budget_s=PERSIST_SHARE * step_seconds)

    def _persist(self, everything: bool = False, budget_s: float = 0.0, yield_to_inbox: bool = True,
                 during_step: bool = False, large: bool = False) -> None:
        """Hand finished requests' named pages to the tiers (``KVTiers.persist``), ``PERSIST_CHUNK`` at a time
        beside a step, at shutdown and when ``large`` (a decode step on the device), else
        ``PERSIST_IDLE_CHUNK``. While idle
        (``everything``): until none is left, stopping as soon as a new request or an abort is in the inbox
        (it goes first), or while one is on its way (``expect_request``). After a step: the
        requests that ended before that step, one chunk and more while ``budget_s`` lasts, unless a request
        waits in the inbox; those that ended in it wait for the loop to be idle (small chunks, the inbox
        checked between them) or for the next step. A turn is sent as soon as its client has the last
        token of the one before: a chunk of that request's pages begun right after its step held the
        turn for that chunk (see ``PERSIST_IDLE_CHUNK``). ``during_step``: called while a step runs
        (``runner.step``'s ``while_running``), so the requests that ended before it may all go. A page
        taken for another block since its request ended is skipped: when it was evicted the tiers got
        its copy (``KVTiers.spill``), and its K/V now belong to another block."""
        named, t0, chunks = self.blocks.named, time.perf_counter(), 0
        step = self.loop_steps + during_step  # the step that ends next: requests that end in it wait
        # large chunks only where nothing can wait on them: beside a step (its tokens come after it anyway) and
        # at shutdown; after a step and while idle a request may arrive mid-chunk (H200, --call-timers spans: a
        # 256-page chunk begun after a step held the next turn ~1.8 ms)
        size = PERSIST_CHUNK if large or during_step or not yield_to_inbox else PERSIST_IDLE_CHUNK
        while self._to_persist:
            entry = self._to_persist[0]
            if everything:
                if yield_to_inbox and not self._stopping and (not self._inbox.empty() or self._expecting()):
                    return
            elif entry[3] == step or (not during_step and not self._inbox.empty()) \
                    or (chunks and time.perf_counter() - t0 >= budget_s):
                return
            chunks += 1
            table, names, start, _ = entry
            end = min(start + size, len(table))
            pages = []
            for i in range(start, end):
                page = table[i]
                got = named(page)
                if got is not None and (i >= len(names) or got[0] == names[i]):
                    pages.append((page, *got, names[i - 1] if 0 < i <= len(names) else None))
            if end == len(table):
                self._to_persist.popleft()
            else:
                entry[2] = end
            if pages:
                self.tiers.persist(pages)

    def _queue_persist(self, table: list[int], names: list[bytes]) -> None:
        """``table``'s pages (a finished request's, whose block names are ``names``) go to the tiers
        after it (``_persist``)."""
        self._to_persist.append([table, list(names), 0, self.loop_steps])

    def _settle_tiers(self) -> None:
        """Every queued page handed to the tiers, and their disk writes landed (``flush_kv``)."""
        self._persist(everything=True, yield_to_inbox=False)
        self.tiers.flush()

    def _pump(self) -> bool:
        """One more chunk of kept pages to host RAM, between decode steps or while idle (never while
        prompts wait: their prefill, or a restore, would share the link with it). True while some
        remain."""
        if self.tiers is None or self.scheduler.waiting:
            return False
        return self.tiers.pump()

    def _pool_tight(self) -> bool:
        """Whether the next request could evict kept pages: fewer pages surely empty (free and holding no
        cached K/V; a lower bound, as cached pages in use count against it) than the longest request takes.
        While the pool is roomy, kept pages go down only between steps: beside a prefill the pump's copies
        took SMs and bandwidth from it (an 8,890-token Qwen3-30B-A3B prompt served in 172.8 ms with them,
        165.8 without, H200), for pages no allocation was about to take."""
        blocks = self.scheduler.blocks
        return blocks.num_free - blocks.num_cached < -(-self.context_length // blocks.block_size)
