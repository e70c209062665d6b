"""The restore plan: for the history blocks a request needs that are not on GPU pages, copy them
from host RAM, recompute them, or recompute the head while the tail streams in (from disk, or from
host RAM when ``host_split`` is on), whichever gives the first token soonest, from measured rates
(``RestorePlanner``)."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Plan:
    """How a request gets the history blocks that are not on GPU pages: the first ``host_now`` are
    copied from host RAM at admission, the next ``recompute`` are computed, and the ``load`` after
    those stream in (from disk, or host RAM) while they are."""

    host_now: int = 0
    recompute: int = 0
    load: int = 0
    seconds: float = 0.0  # the planner's estimate for the history, against...
    recompute_seconds: float = 0.0  # ...computing all of it
    # the streamed blocks are all in host RAM and are copied from admission on, beside the recompute of
    # the head (a split of a host-RAM history); otherwise they are copied up when the head is done
    prefetch: bool = False

    @property
    def kind(self) -> str:
        if self.load and self.recompute:
            return "split"
        return "restore" if self.load or self.host_now else "recompute"


@dataclass
class RestorePlanner:
    """Chooses restore, recompute or a split from measured rates (exponential averages, starting
    from conservative guesses): prefill tokens/s, host->GPU and disk read bytes/s.

    Host RAM nearly always wins. Disk loses to recompute per block on a fast GPU (H200:
    128 KiB/token of Llama-3.1-8B KV at 1.46 GB/s is ~90 us/token against ~32 us/token to
    recompute), but the two run at once: the GPU recomputes the head of the history while the
    tail streams from disk, and the split that ends both together minimises the time to the
    first token; it is never slower than recomputing everything, which is one of its options.
    """

    prefill_tokens_per_s: float = 1_000.0  # used while there is no measured curve
    host_bytes_per_s: float = 2e10  # pinned copies: 55 GB/s measured on the H200, less through many small ones
    disk_bytes_per_s: float = 5e8
    alpha: float = 0.2  # weight of a new measurement
    # [(tokens, seconds)] of fresh prefills measured at start-up (qml_runtime.warmup), sorted; the time
    # per token grows with the length (attention), so it is interpolated, and extrapolated on the line
    # through the last two points. ``prefill_scale`` follows what running prefills take against it.
    prefill_curve: list = field(default_factory=list)
    prefill_scale: float = 1.0
    # a host-RAM history may be split too: its head recomputed while the tail is copied in beside it, when
    # that ends sooner than copying all of it (the copy is the turn's whole time: ~70 ms for 27k tokens of
    # Llama-3.1-8B, whose turn computes in ~12 ms of it). Off unless QML_HOST_SPLIT=1: measured on the H200 it
    # loses, 141-181 ms against 81 to copy everything (benchmarks/results/turn-h200-2026-12-05.md): the head
    # is a step of its own before the turn's, which gives up the copy's layer-by-layer overlap with the turn,
    # and a token costs ~10x more to recompute than to copy. ``beside_scale``: how much slower a prefill runs
    # beside such a copy than the curve says (learnt from those steps; 1.5 until then).
    host_split: bool = field(default_factory=lambda: os.environ.get("QML_HOST_SPLIT") == "1")
    beside_scale: float = 1.5

    # the rates that are measurements (here or by an earlier run), not the guesses above: a first
    # measurement replaces a guess, later ones are averaged in
    measured: set = field(default_factory=set)
    # of those, the ones a probe measured (the disk's, read alone at start-up): the first measurement of the
    # work itself replaces them when it is slower, as it does a guess. On an H100 host the probe gave 1.13 GB/s
    # (its 85%) and the restores after it read 0.5-0.8; averaged in at 0.2, the second turn was still planned at
    # 0.84.
    provisional: set = field(default_factory=set)
    # The disk's rate is learnt unevenly: a slower measurement moves it by ``disk_alpha_down``, a faster one by
    # ``alpha`` (and a faster first load only by ``alpha`` from the probe). Why: a split ends when the later of
    # its recompute and its reads does, and the reads' time per token (~73 us at 1.8 GB/s for Llama-3.1-8B) is
    # ~2.3x the recompute's (~32 us), so streaming too much costs more than streaming too little: with the rate
    # 18% too high the turn takes ~12% longer than the best split, 18% too low ~5% (a test has the sums). On
    # H100s (session 35) a first load measured 1.87 and 2.04 GB/s against the probe's 1.51-1.54, replaced it,
    # and the second turn, planned on it, took 663 and 687 ms against 613 and 584 estimated
    # (sessions-h100-2026-12-06d.md).
    disk_alpha_down: float = 0.5

    def observe(self, kind: str, amount: float, seconds: float, provisional: bool = False) -> None:
        """A measured rate of ``kind``; ``provisional``: by a probe, not by the work the plans price."""
        if seconds <= 0 or amount <= 0:
            return
        attr = {"prefill": "prefill_tokens_per_s", "host": "host_bytes_per_s", "disk": "disk_bytes_per_s"}[kind]
        if self.alpha == 0:  # rates held fixed (tests, experiments)
            return
        value, now = amount / seconds, getattr(self, attr)
        if attr not in self.measured:
            alpha = 1.0  # a guess
        elif kind == "disk" and value < now:
            alpha = 1.0 if attr in self.provisional else self.disk_alpha_down
        else:
            alpha = self.alpha
        setattr(self, attr, (1 - alpha) * now + alpha * value)
        self.measured.add(attr)
        if provisional:
            self.provisional.add(attr)
        else:
            self.provisional.discard(attr)

    def observe_prefill(self, chunks: Sequence[tuple[int, int]], seconds: float, beside: bool = False) -> None:
        """A step that computed ``chunks`` [(cached context, new tokens)] took ``seconds``. Only
        chunks over no more cached context than their own length count: what recomputing a
        history costs (a short chunk over a long history runs another kernel, split-KV, and its
        step often also carries the upload of that history, restored just before). ``beside``: the
        step ran beside a host-RAM copy (a split's head): it teaches ``beside_scale`` instead."""
        if not self.learns_from(chunks):
            return
        if not self.prefill_curve:
            if not beside:
                self.observe("prefill", sum(n for _, n in chunks), seconds)
            return
        predicted = sum(self.fresh_seconds(start + n) - self.fresh_seconds(start) for start, n in chunks)
        if predicted > 0 and seconds > 0 and self.alpha > 0:
            # bounded: one odd step (a stall, a copy queued ahead of it) must not swing the plans far
            if beside:  # against the plain prefill's time, as the plan uses it
                ratio = min(max(seconds / (predicted * self.prefill_scale), 1.0), 4.0)
                self.beside_scale = (1 - self.alpha) * self.beside_scale + self.alpha * ratio
            else:
                ratio = min(max(seconds / predicted, 0.5), 4.0)
                self.prefill_scale = (1 - self.alpha) * self.prefill_scale + self.alpha * ratio

    @staticmethod
    def learns_from(chunks: Sequence[tuple[int, int]]) -> bool:
        """Whether ``observe_prefill`` counts a step of these chunks (the engine times only those)."""
        return all(start <= n for start, n in chunks)

    def fresh_seconds(self, tokens: int) -> float:
        """The measured curve's time to prefill ``tokens`` from nothing (unscaled)."""
        curve = self.prefill_curve
        if tokens <= 0:
            return 0.0
        if len(curve) == 1 or tokens <= curve[0][0]:
            n, s = curve[0]
            return tokens * s / n
        # the first point at or past ``tokens`` (a plan asks this for every block of a 27k history)
        i = min(bisect.bisect_left(curve, tokens, key=lambda point: point[0]), len(curve) - 1)
        (n0, s0), (n1, s1) = curve[i - 1], curve[i]
        r0, r1 = s0 / n0, s1 / n1  # seconds per token, linear in the length between (and past) the points
        return tokens * max(r0 + (r1 - r0) * (tokens - n0) / (n1 - n0), min(r0, r1))

    def prefill_seconds(self, start: int, tokens: int) -> float:
        """Time to compute ``tokens`` tokens after ``start`` cached ones."""
        if not self.prefill_curve:
            return tokens / self.prefill_tokens_per_s
        return self.prefill_scale * (self.fresh_seconds(start + tokens) - self.fresh_seconds(start))

    def rates(self) -> dict:
        """The measured rates (a guess saved would read as a measurement at the next start; a probe's, too: the
        next start probes again)."""
        return {key: getattr(self, key) for key in sorted(self.measured - self.provisional)}

    def load_rates(self, saved: dict) -> None:
        """Rates measured by an earlier run on this machine (the disk store keeps them): better
        first guesses than the defaults. Values that are not positive numbers are ignored."""
        for key in ("host_bytes_per_s", "disk_bytes_per_s", "prefill_tokens_per_s"):
            value = saved.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
                setattr(self, key, float(value))
                self.measured.add(key)

    def worth_restoring(self, tier: str, block_bytes: int, block_tokens: int, start: int = 0) -> bool:
        rate = self.host_bytes_per_s if tier == "host" else self.disk_bytes_per_s
        return block_bytes / rate < self.prefill_seconds(start, block_tokens)

    def plan(self, tiers: Sequence[str], block_bytes: int, block_tokens: int, start: int = 0,
             after: int = 0) -> Plan:
        """``tiers``: where each block after the GPU-cached ones lives ("host" or "disk"), in order;
        ``start``: the tokens cached on the GPU before them; ``after``: the tokens the request computes
        after them (its new turn: computed beside a copy from host RAM, after a recompute)."""
        bt = block_tokens
        host_block = block_bytes / self.host_bytes_per_s
        disk_block = block_bytes / self.disk_bytes_per_s
        n = len(tiers)
        everything = self.prefill_seconds(start, n * bt)
        # the leading host blocks copied now: the longest run whose copy beats computing it (a block
        # costs more to compute the later it lies, so the first blocks alone can be cheaper to compute
        # than to copy while the run as a whole is not)
        # (the first block not in host RAM, found without a Python step per block)
        run = next(itertools.compress(itertools.count(), map("host".__ne__, tiers)), n)
        # from the longest run down: the whole run nearly always wins at once (one evaluation, not
        # one per block: 1,708 of them took 26 ms of three 27k-token turns under cProfile on the H200)
        h = next((r for r in range(run, 0, -1) if r * host_block < self.prefill_seconds(start, r * bt)), 0)
        rest = tiers[h:]
        m = len(rest)
        if m == 0:
            plan = Plan(host_now=h, seconds=h * host_block, recompute_seconds=everything)
            return self._host_split(plan, n, host_block, bt, start, after) if self.host_split and after else plan
        # k blocks recomputed while the other m - k are read (disk reads dominate; host ones are
        # nearly free), then copied up: minimise max(compute(k), read(m - k)) + upload(m - k)
        read = [disk_block if t == "disk" else 0.0 for t in rest]
        suffix = [0.0] * (m + 1)
        for i in range(m - 1, -1, -1):
            suffix[i] = suffix[i + 1] + read[i]
        head = start + h * bt
        best_k, best = m, self.prefill_seconds(head, m * bt)
        for k in range(m + 1):
            t = max(self.prefill_seconds(head, k * bt), suffix[k]) + (m - k) * host_block
            if t < best - 1e-12:
                best_k, best = k, t
        return Plan(host_now=h, recompute=best_k, load=m - best_k, seconds=h * host_block + best,
                    recompute_seconds=everything)

    def _host_split(self, whole: Plan, n: int, host_block: float, bt: int, start: int, after: int) -> Plan:
        """``whole`` copies all ``n`` blocks from host RAM, and the turn computes beside the copy (layer by
        layer), so the copy is the time. A split recomputes the first k blocks while the other n - k are
        copied in, then computes the turn: max(head(k) + turn, copy(n - k)), least where the two meet
        (a bisection: the first grows with k, the second shrinks). The split's ``seconds`` are the
        history's part of that time (the turn's own taken out), as ``whole``'s are."""
        turn = max(self.prefill_seconds(start + n * bt, after), 0.0)  # (a curve measured out of order: < 0)

        def head(k: int) -> float:
            return self.beside_scale * self.prefill_seconds(start, k * bt)

        lo, hi = 1, n - 1  # the first k whose head and turn outlast the copy of the rest
        if hi < lo:
            return whole
        while lo < hi:
            mid = (lo + hi) // 2
            if head(mid) + turn >= (n - mid) * host_block:
                hi = mid
            else:
                lo = mid + 1
        best_k, best = 0, max(whole.seconds, turn)
        for k in (lo - 1, lo):
            if 1 <= k < n:
                t = max(head(k) + turn, (n - k) * host_block)
                if t < best - 1e-12:
                    best_k, best = k, t
        if not best_k:
            return whole
        return Plan(host_now=0, recompute=best_k, load=n - best_k, seconds=max(best - turn, head(best_k)),
                    recompute_seconds=whole.recompute_seconds, prefetch=True)
