"""The engine: a background loop that schedules, runs and samples, and the request API around it.

Requests enter through ``generate`` (async, for the server) or ``generate_sync``
(for scripts and notebooks). The loop runs on its own thread: each iteration
takes new requests and aborts from an inbox, schedules one batch, runs it, and
hands each request its new text through a callback. Model errors fail the
requests of that batch, never the loop.

Several choices for one prompt (OpenAI's ``n``) are several requests, the later ones
submitted with ``follow=`` the first: they wait outside the scheduler until the first
has its prompt in the cache, then are admitted onto its pages through the prefix cache,
computing only the prompt's last partial page.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import queue
import sys
import threading
import time
from concurrent import futures
from typing import Callable

import torch

from qml_runtime import turn_trace
from qml_runtime.config import CacheConfig, ModelConfig, SchedulerConfig
from qml_runtime.constrained import Grammars
from qml_runtime.cuda_graphs import DecodeGraphs, PrefillGraphs
from qml_runtime.engine_requests import Emit, Requests, _Add, _Flush
from qml_runtime.kept_pages import PUMP_BESIDE_MIN_TOKENS, KeptPages
from qml_runtime.kv import disk_loads
from qml_runtime.kv.block_manager import BlockManager
from qml_runtime.kv.cache import KVCache
from qml_runtime.kv.disk_store import ENCODABLE_SIZES, DiskStore
from qml_runtime.kv.host_tier import HostTier
from qml_runtime.kv.prefill_clock import PrefillClock
from qml_runtime.kv.prefix import model_fingerprint
from qml_runtime.kv.tiers import KVTiers
from qml_runtime.runner import Launched, ModelRunner
from qml_runtime.sampling_params import RequestOutput, TokenLogprob
from qml_runtime.scheduler import Scheduler
from qml_runtime.sequence import Sequence, Status
from qml_runtime.warmup import warm_up

log = logging.getLogger("qml.engine")

# the token of a step launched behind another whose tokens are not yet known (never a real token id)
PLACEHOLDER = -1
PUMP_POLL_S = 0.001  # while idle with kept pages still to copy down: how often the next chunk is tried


class Engine(KeptPages, Requests):  # (pages handed to the tiers: kept_pages; the callers' side: engine_requests)
    def __init__(self, model: torch.nn.Module, tokenizer, model_config: ModelConfig, *, model_id: str,
                 device: torch.device, dtype: torch.dtype, cache: CacheConfig, scheduler: SchedulerConfig,
                 context_length: int | None = None, info: dict | None = None, fingerprint: bytes = b"",
                 cuda_graphs: bool = True, warmup: bool | None = None, overlap: bool = True,
                 freeze_heap: bool | None = None):
        self.model, self.tokenizer, self.model_config = model, tokenizer, model_config
        self.model_id, self.device, self.dtype = model_id, device, dtype
        # QML_KV_CODEC=1: pages in host RAM and on disk in qml_kernels.kv_codec's lossless form (bf16). Off by
        # default: on the H200 the host-RAM turn took 86-96 ms with it against 81 without
        # (benchmarks/results/turn-h200-2026-12-05.md)
        self.kv = KVCache(model_config, cache.num_blocks, cache.block_size, device, dtype,
                          codec=os.environ.get("QML_KV_CODEC") == "1")
        capacity = cache.num_blocks * cache.block_size
        # one request must fit in the pool, or a full-context request could never be admitted
        self.context_length = min(context_length or model_config.context_length, model_config.context_length, capacity)
        if self.context_length < (context_length or model_config.context_length):
            log.warning("context length capped at %d tokens: that is all the KV cache holds", capacity)
        self.blocks = BlockManager(cache.num_blocks, cache.block_size)
        self.tiers = self._make_tiers(cache, fingerprint)
        if self.tiers is not None:
            self.blocks.on_evict = self.tiers.spill_many
        # the prefill steps the restore planner learns from, timed on the device where there is one (the
        # planner looked up at each: a test or a bench may give the tiers another)
        self.prefill_clock = None if self.tiers is None else PrefillClock(
            lambda chunks, seconds, beside: self.tiers.planner.observe_prefill(chunks, seconds, beside=beside),
            (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None)
        self.scheduler = Scheduler(scheduler, self.blocks, fingerprint, cache.enable_prefix_caching, self.tiers)
        graphs = {}
        if cuda_graphs and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()  # one memory pool: the graphs never run at once
            graphs["prefill_graphs"] = PrefillGraphs(model, self.kv, device, self.context_length, pool=pool)
            graphs["decode_graphs"] = DecodeGraphs(model, self.kv, device, scheduler.max_num_seqs,
                                                   self.context_length, pool=pool)
        self.runner = ModelRunner(model, self.kv, device, stop_ids=frozenset(tokenizer.eos_token_ids), **graphs)
        # on by default where there is something to compile (a GPU); on CPU a test turns it on
        self.warmup = device.type == "cuda" if warmup is None else warmup
        # decode steps launched one ahead of their tokens (_loop); False: every step waited for
        self.overlap = overlap
        self.hand_over = device.type == "cuda" and os.environ.get("QML_HANDOFF") == "1"  # (engine_requests.HANDOFF_S)
        self.pump_beside_min_tokens = PUMP_BESIDE_MIN_TOKENS
        # the start-up heap moved out of the cyclic GC's sight while serving (start): on by default on a GPU
        self.freeze_heap = device.type == "cuda" if freeze_heap is None else freeze_heap
        self._froze = False
        self.grammars = Grammars(tokenizer, model_config.vocab_size)
        self._info = dict(info or {})
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # until when (time.monotonic) a request is expected (``expect_request``): the idle loop holds its
        # background work meanwhile
        self._expected_until = 0.0
        self._emitters: dict[str, Emit] = {}
        self._seqs: dict[str, Sequence] = {}
        self._followers: dict[str, list[Sequence]] = {}  # leader's request id -> requests parked behind it
        # finished requests' pages still to hand to the tiers: [pages, block names, next index, steps run
        # when it ended] (_persist)
        self._to_persist: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._observe_queue_time: Callable[[float], None] | None = None
        # where the engine thread's time goes, cumulative: scheduling, the device step (launch to
        # tokens on the host), and the rest (commit, detokenize, emit)
        self.loop_seconds = {"schedule": 0.0, "step": 0.0, "post": 0.0}
        self.loop_steps = 0

    def _make_tiers(self, cache: CacheConfig, fingerprint: bytes) -> KVTiers | None:
        if not cache.enable_prefix_caching or (cache.host_bytes == 0 and cache.disk_dir is None):
            return None
        host = HostTier(self.kv.row_bytes, cache.host_bytes, pin=self.device.type == "cuda") \
            if cache.host_bytes else None
        # blocks written encoded (their values' high halves compressed: ~1.5x fewer bytes to read back after
        # a restart); QML_KV_DISK_ENCODE=0 writes them raw, for A/B runs. Rows in the KV codec's form are
        # written as they are, under their own fingerprint (a store of raw rows reads as misses, and back)
        encode = os.environ.get("QML_KV_DISK_ENCODE", "1") != "0" and not self.kv.codec
        element_size = self.kv.data.element_size() if encode else 0
        if self.kv.codec:
            fingerprint = model_fingerprint(fingerprint, "qml_kernels.kv_codec rows, v1")
        disk = DiskStore(cache.disk_dir, fingerprint, cache.disk_bytes,
                         element_size=element_size if element_size in ENCODABLE_SIZES else 0) \
            if cache.disk_dir else None
        if disk is not None:
            log.info("disk KV tier at %s: %d blocks (%.2f GiB) found from earlier runs", cache.disk_dir,
                     len(disk), disk.bytes_used / 2**30)
        return KVTiers(self.kv, host, disk)

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self.runner.capture()  # CUDA graphs before serving: capturing later would stall requests
            if self.warmup:  # the eager paths' compiles too, and the prefill curve for the planner
                warm_up(self)
            if self.freeze_heap:
                # A full collection of Python's cyclic GC walks every tracked object: ~200k after
                # start-up (torch, the model, Triton's kernels), ~100 ms on a CI core, on whichever
                # thread happened to allocate, the engine's loop included. Served Qwen3-30B-A3B prompts
                # showed such stalls (a 130-token TTFT of 45.9 ms among runs of 17.8-20.0). What is alive
                # now lives as long as the engine: frozen, later collections walk only what requests
                # create. Unfrozen at shutdown, so that the engine's own cycles can go.
                gc.collect()
                gc.freeze()
                self._froze = True
            # The loop shares the GIL with whoever consumes its tokens (the server's event loop).
            # Python's default 5 ms switch interval lets either hold it that long while the other
            # has a step to launch or a token to send: 0.5 ms keeps those waits short (not swept on a GPU:
            # QML_SWITCH_INTERVAL_US sets another for an A/B).
            interval = float(os.environ.get("QML_SWITCH_INTERVAL_US", 500)) / 1e6
            sys.setswitchinterval(min(sys.getswitchinterval(), interval))
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="qml-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._froze:
            gc.unfreeze()
            self._froze = False
        if self.tiers is not None:
            self.tiers.close()  # the last writes reach the disk before the process goes

    def info(self) -> dict:
        return {**self._info, "context_length": self.context_length, "vocab_size": self.model_config.vocab_size,
                "kv_cache_tokens": self.blocks.num_blocks * self.blocks.block_size}

    @property
    def idle(self) -> bool:
        """No request in flight or on its way in (read from any thread: one step old at most)."""
        return not self._seqs and self._inbox.empty()

    def stats(self) -> dict:
        """A snapshot for /metrics and the server's queue bound (qml_server.metrics has the keys).

        Cheap and safe from any thread: sizes and counters the engine thread updates, read
        without a lock, so a value may be one step old.
        """
        tiers = {"gpu": self.blocks.num_cached * self.kv.block_bytes}  # content-named pages: reusable KV
        if self.tiers is not None and self.tiers.host is not None:
            tiers["host"] = self.tiers.host.bytes_used
        if self.tiers is not None and self.tiers.disk is not None:
            tiers["disk"] = self.tiers.disk.bytes_used
        restores = {}
        if self.tiers is not None:
            t, planner = self.tiers.stats, self.tiers.planner
            restores = {"kv_restored_blocks": {"host": t.restored_host, "disk": t.restored_disk},
                        "kv_spilled_blocks": {"host": t.spilled_host + t.kept_host, "disk": t.written_disk},
                        "kv_recomputed_blocks": t.skipped_disk, "kv_restore_seconds": t.restore_seconds,
                        "kv_restore_plans": dict(t.plans), "kv_restore_cuts": t.cuts,
                        "kv_restore_planned_seconds": t.planned_seconds,
                        "kv_restore_recompute_planned_seconds": t.recompute_planned_seconds,
                        # (for the tiers this engine has: those ``tiers`` counts the bytes of)
                        "kv_restore_rates": {tier: getattr(planner, f"{tier}_bytes_per_s") for tier in ("host", "disk")
                                             if tier in tiers}}
        return {
            **restores,
            "num_requests_running": len(self.scheduler.running),
            # the inbox counts as waiting, so a burst is seen before the loop wakes
            "num_requests_waiting": len(self.scheduler.waiting) + self._inbox.qsize(),
            "kv_cache_usage": self.blocks.usage,
            "prefix_cache_queries": self.scheduler.prefix_queries,
            "prefix_cache_hits": self.scheduler.prefix_hits,
            "kv_tier_bytes": tiers,
        }

    def set_queue_time_observer(self, observe: Callable[[float], None] | None) -> None:
        """``observe(seconds)`` is called on the engine thread once per request, when it is first
        scheduled, with the time since it was submitted. None removes it."""
        self._observe_queue_time = observe

    def _note_first_scheduled(self, seqs: list[Sequence]) -> list[Sequence]:
        """Mark the sequences scheduled for the first time; -> those of them to announce once their step runs."""
        now = time.monotonic()
        announce = []
        for seq in seqs:
            if seq.first_scheduled_time is None:  # a preempted sequence coming back is not counted again
                seq.first_scheduled_time = now
                turn_trace.stamp(seq.request_id, "scheduled")
                if seq.announce or seq.started is not None:
                    announce.append(seq)
                if self._observe_queue_time is not None:
                    try:
                        self._observe_queue_time(now - seq.arrival_time)
                    except Exception:  # metrics never stop the loop
                        log.exception("the queue time observer failed")
        return announce

    # --- the loop (engine thread) -----------------------------------------------------

    def _loop(self) -> None:
        inflight: Launched | None = None  # a decode step on the device, its tokens not yet taken
        while not self._stopping:
            try:
                inflight = self._iterate(inflight)
            except Exception as exc:  # a bug must not kill the loop and leave every request hanging
                log.exception("the engine loop failed; failing %d request(s)", len(self._seqs))
                inflight = None
                for seq in list(self._seqs.values()):
                    if seq.status is not Status.FINISHED:
                        self._fail(seq, exc)
        if inflight is not None:
            self._complete(inflight)
        self._persist(everything=True, yield_to_inbox=False)  # what finished is kept before the tiers close
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", "")
        while not self._inbox.empty():  # a flush asked for as the loop stopped: shutdown flushes the tiers
            msg = self._inbox.get_nowait()
            if isinstance(msg, _Flush):
                msg.done.set()

    def _iterate(self, inflight: Launched | None) -> Launched | None:
        """One turn of the loop; returns the decode step left in flight, if any."""
        drained = self._drain_inbox()
        if inflight is not None:
            # Overlap: the next decode step is queued before this one's tokens are waited for, so
            # the host's work (collecting, detokenizing, streaming, launching) hides behind the
            # device's. Anything new (a request, an abort) first waits for the step in flight.
            following = None if drained or self._first_token_out(inflight) else self._launch_following(inflight)
            self._complete(inflight)
            # one chunk: a large one while the step after it is on the device already, else a small one (a request
            # that came in waits for it)
            self._persist(large=following is not None)
            self._pump()
            return following
        if not self.scheduler.has_work():
            wait = self._expecting()
            if wait:  # a request is on its way: the host is its until it is in the inbox
                self._wakeup.wait(wait)
                self._wakeup.clear()
                return None
            if self._to_persist:  # (unless a request came in meanwhile: then it goes first)
                self._persist(everything=True)
                return None
            # finished requests' pages go down to host RAM a chunk at a time while nothing runs
            self._wakeup.wait(PUMP_POLL_S if self._pump() else None)
            self._wakeup.clear()
            return None
        # the disk writer's threads wait while this thread schedules and launches (its launches release the GIL,
        # and the writers' Python took it each time): they have the host back while the device runs the step
        release = self.tiers.hold_writes() if self.tiers is not None else (lambda: None)
        try:
            return self._schedule_and_run(release)
        finally:
            release()

    def _schedule_and_run(self, release: Callable[[], None]) -> Launched | None:
        """Schedule a batch and run it: a decode step is launched and left in flight (returned), any other
        runs to its tokens. ``release`` is called once the step is queued on the device."""
        t_start = time.perf_counter()
        if self.prefill_clock is not None:
            self.prefill_clock.poll()  # the steps the device has finished since: before this step's plans
        batch = self.scheduler.schedule()  # (a scheduler bug fails every request: _loop's handler)
        if not batch:
            release()  # nothing to launch: the writers need not wait for this thread
            for seq in self._seqs.values():  # nor the submitters of requests that wait (engine_requests.HANDOFF_S)
                if seq.started is not None:
                    seq.started.set()
            loads = self.scheduler.loading()
            if loads:  # everything runnable waits for blocks streaming in from disk
                # (with cuts on, not long: a load that falls behind is cut as soon as computing its rest is faster)
                futures.wait([load.future for load in loads], timeout=0.01 if disk_loads.CUT else 0.05,
                             return_when=futures.FIRST_COMPLETED)
                return None
            if not self.scheduler.waiting:  # (a bug: running sequences with nothing to compute)
                for seq in list(self.scheduler.running):
                    self._fail(seq, RuntimeError("the scheduler found nothing to run for this request"))
                return None
            # nothing running and the head of the queue does not fit: it never will
            seq = self.scheduler.waiting[0]
            self._fail(seq, MemoryError("the KV cache cannot hold this request"))
            return None
        if self.tiers is not None:
            self.tiers.flush_spills()  # pages evicted while scheduling are copied out before reuse
        announce = self._note_first_scheduled(batch.seqs)
        self.loop_seconds["schedule"] += time.perf_counter() - t_start
        if self.overlap and self.runner.launchable(batch):
            try:
                inflight = self.runner.launch(batch)
            except Exception as exc:
                log.exception("engine step failed; failing %d request(s)", len(batch.seqs))
                for seq in batch.seqs:
                    self._fail(seq, exc)
                return None
            self.loop_seconds["step"] += inflight.launch_seconds
            self._announce_started(announce)
            return inflight
        # the prefill chunks (cached context, new tokens): what the restore planner weighs reading
        # KV against; a step with decode rows is not one (their time is not a prefill's)
        chunks = ([(s.num_computed, n) for s, n in zip(batch.seqs, batch.num_tokens)]
                  if self.tiers is not None else [])
        new_tokens = sum(n for _, n in chunks)
        pure_prefill = new_tokens >= 64 and all(n > 1 for _, n in chunks)
        seconds = sum(self.tiers.planner.prefill_seconds(start, n) for start, n in chunks) if pure_prefill else 0.0
        # a split's head computed beside its tail's copy from host RAM: its time teaches the planner how much
        # that copy slows a prefill, not how fast a prefill is
        beside_copy = pure_prefill and self.tiers.copying([s.pending_load for s in batch.seqs if s.pending_load])
        # kept pages go down beside a long prefill (a burst of prompts never idles the loop, and a turn
        # arriving after it would otherwise evict pages whose copies still wait: 3.5 GB to gather and copy
        # beside its restore, ~100 ms more on the H200)
        pump_pages = (self.tiers.pages_beside(seconds) if pure_prefill and self.tiers.deferred
                      and new_tokens >= self.pump_beside_min_tokens
                      and self.tiers.pump_beside and self._pool_tight() else 0)
        # finished requests' pages go to the tiers while the device runs the prefill, not after it, where
        # the next request (sent as soon as its client had this step's token) waited for them
        persist_beside = pure_prefill and bool(self._to_persist)
        # both once the step is queued: the pump's copies queued before it cost the turn their host
        # time (1-2 ms of a GPU-history turn right after a long prompt, H200 in-process), and they
        # still run beside the step, ordered after what the compute stream held before it
        before_step = self.tiers.compute_mark() if pump_pages or persist_beside else None

        def beside_step() -> None:
            release()
            # the step is queued: the server's response can start now, beside it (a step that never calls
            # this announces nothing: its tokens come next)
            self._announce_started(announce)
            if pump_pages or persist_beside:
                try:
                    if pump_pages:
                        self.tiers.pump(pump_pages, beside_step=True, after=before_step)
                    if persist_beside:
                        self._persist_beside(seconds)
                except Exception:  # the tiers' trouble is not the step's: its tokens stand
                    log.exception("handing finished requests' pages to the KV tiers failed")
        if turn_trace.ENABLED:
            turn_trace.running([s.request_id for s in batch.seqs])
            turn_trace.stamp_step("step")
        # (a turn over a cached history teaches nothing: no events on its path)
        timed = pure_prefill and self.tiers.planner.learns_from(chunks)
        mark = self.prefill_clock.start() if timed else None
        t0 = time.perf_counter()
        try:
            tokens, logprobs = self.runner.step(batch, while_running=beside_step)
        except Exception as exc:  # a failed step fails its requests, not the server
            log.exception("engine step failed; failing %d request(s)", len(batch.seqs))
            for seq in batch.seqs:
                self._fail(seq, exc)
            return None
        t1 = time.perf_counter()
        if turn_trace.ENABLED:
            turn_trace.stamp_step("token")
            turn_trace.step_ran(t0, t1, batch.num_tokens)
        self.loop_seconds["step"] += t1 - t0
        self.loop_steps += 1
        if timed:  # (no chunks without tiers)
            self.prefill_clock.stop(mark, chunks, t1 - t0, beside=beside_copy)
        self._take_tokens(batch, tokens, logprobs)
        if not persist_beside:  # (a step that returns has called beside_step)
            self._persist_after(t1 - t0)
        self.loop_seconds["post"] += time.perf_counter() - t1
        return None

    def _announce_started(self, seqs: list[Sequence]) -> None:
        """The empty output of ``submit``'s ``announce``, for each of ``seqs`` still running; submitters waiting
        for the step's launch (engine_requests.HANDOFF_S) go on."""
        for seq in seqs:
            if seq.announce and seq.status is not Status.FINISHED:
                self._emit(seq, RequestOutput(seq.request_id, "", []))
            if seq.started is not None:
                seq.started.set()
        seqs.clear()

    def _first_token_out(self, inflight: Launched) -> bool:
        """Whether ``inflight`` is the first decode step of a request running alone, whose first token was just
        emitted: with the hand-over on (engine_requests.HANDOFF_S), the step after it is not launched ahead, so
        that the engine thread waits for the device, without the GIL, while the server sends that token (one step
        of this request's decode then runs without the overlap)."""
        seqs = inflight.batch.seqs
        return self.hand_over and len(seqs) == 1 and len(self._seqs) == 1 and seqs[0].num_output_tokens == 1

    def _launch_following(self, inflight: Launched) -> Launched | None:
        """Launch the decode step after ``inflight`` before its tokens are known, when it is certain to
        be wanted: the same sequences, none of which can end on a length limit with the token in
        flight (one that ends on a stop token or string wastes its row of this step). Each sequence
        gets a placeholder for that token, filled in by ``_complete``."""
        seqs = inflight.batch.seqs
        for seq in seqs:
            if seq.status is not Status.RUNNING or seq.grammar is not None \
                    or seq.num_output_tokens + 1 >= seq.params.max_tokens \
                    or seq.num_tokens + 1 >= self.context_length:
                return None
        if not self.runner.can_launch(seqs, extra_pages=1):
            return None
        t0 = time.perf_counter()
        for seq in seqs:
            seq.token_ids.append(PLACEHOLDER)
        batch = self.scheduler.continue_decode(seqs)
        if batch is None:
            for seq in seqs:
                seq.token_ids.pop()
            return None
        if self.tiers is not None:
            self.tiers.flush_spills()
        self.loop_seconds["schedule"] += time.perf_counter() - t0
        try:
            launched = self.runner.launch(batch, after=inflight)
        except Exception:  # the step in flight is still collected; these sequences then go on synchronously
            log.exception("launching an overlapped decode step failed")
            for seq in seqs:
                seq.token_ids.pop()
                seq.num_computed = min(seq.num_computed, seq.num_tokens)
            return None
        self.loop_seconds["step"] += launched.launch_seconds
        return launched

    def _complete(self, launched: Launched) -> None:
        """Wait for a launched step and hand its tokens to its sequences."""
        t0 = time.perf_counter()
        try:
            tokens = self.runner.collect(launched)
        except Exception as exc:
            log.exception("engine step failed; failing %d request(s)", len(launched.batch.seqs))
            for seq in launched.batch.seqs:
                if seq.status is not Status.FINISHED:
                    self._fail(seq, exc)
            return
        t1 = time.perf_counter()
        self.loop_seconds["step"] += t1 - t0
        self.loop_steps += 1
        self._take_tokens(launched.batch, tokens, None)
        self.loop_seconds["post"] += time.perf_counter() - t1

    def _take_tokens(self, batch, tokens: list, logprobs) -> None:
        """After a step: name the pages it filled, then give each sequence its token. A sequence that
        finished while the step was on the device (an abort; a stop in the step before, with this
        one launched behind it) gets nothing: its row was wasted work."""
        live = [i for i, seq in enumerate(batch.seqs) if seq.status is not Status.FINISHED]
        placed = set()
        for i in live:  # before the pages are named: a placeholder may sit in a page that became full
            seq, token = batch.seqs[i], tokens[i]
            if token is not None and seq.token_ids[-1] == PLACEHOLDER:
                seq.token_ids[-1] = token  # the step after this one is in flight: its input is known now
                placed.add(i)
        for i in live:
            try:
                self.scheduler.commit(batch.seqs[i])  # before any finishes: its pages are named, then released
            except Exception as exc:
                log.exception("request %s failed after its step", batch.seqs[i].request_id)
                self._fail(batch.seqs[i], exc)
        for i in live:
            seq, token = batch.seqs[i], tokens[i]
            if token is None or seq.status is Status.FINISHED:
                continue
            try:
                self._append(seq, token, None if logprobs is None else logprobs[i], placed=i in placed)
            except Exception as exc:
                log.exception("request %s failed after its step", seq.request_id)
                self._fail(seq, exc)

    def _drain_inbox(self) -> bool:
        """Take new requests and aborts; whether there were any."""
        drained = False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if isinstance(msg, _Add):
                turn_trace.stamp(msg.seq.request_id, "drained")
                self._seqs[msg.seq.request_id] = msg.seq
                self._emitters[msg.seq.request_id] = msg.emit
                leader = self._seqs.get(msg.follow) if msg.follow else None
                if leader is not None and leader.num_output_tokens == 0:
                    self._followers.setdefault(leader.request_id, []).append(msg.seq)
                else:
                    self.scheduler.add(msg.seq)
            elif isinstance(msg, _Flush):
                self._settle_tiers()
                msg.done.set()
            elif msg.request_id in self._seqs:
                self._finish(self._seqs[msg.request_id], "abort", "")

    def _release_followers(self, leader: Sequence) -> None:
        for seq in self._followers.pop(leader.request_id, ()):
            if seq.request_id in self._seqs:  # not aborted while parked
                self.scheduler.add(seq)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None, placed: bool = False) -> None:
        """Give ``seq`` its next token (``placed``: already in ``token_ids``, where a placeholder was)."""
        if not placed:
            seq.token_ids.append(token)
        if seq.num_output_tokens == 1:
            self._release_followers(seq)  # its prompt's pages are named (committed) by now
        p = seq.params
        stop_token = token in p.stop_token_ids or (token in self.tokenizer.eos_token_ids and not p.ignore_eos)
        if seq.grammar is not None and not stop_token:
            seq.grammar.accept(token)  # a refusal fails the request (the mask allowed the token)
        text = "" if stop_token else seq.detokenizer.push(token)
        logprobs = None if p.logprobs is None else ([] if stop_token or logprob is None else [logprob])
        reason = None
        # a complete grammar ends the sequence at once: its only next token would be EOS
        if stop_token or seq.detokenizer.stopped or (seq.grammar is not None and seq.grammar.done):
            reason = "stop"
        elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.context_length:
            reason = "length"
        if reason is None:
            self._emit(seq, RequestOutput(seq.request_id, text, [token], logprobs=logprobs))
        else:
            self._finish(seq, reason, text, [token], logprobs)

    def _finish(self, seq: Sequence, reason: str, text: str, tokens: list[int] | None = None,
                logprobs: list[TokenLogprob] | None = None) -> None:
        # its pages, to keep in the tiers below once the client has its last token: released just below,
        # they keep their names (and K/V) until an allocation takes them, and none happens before then
        table = list(seq.block_table) if self.tiers is not None and reason in ("stop", "length") else []
        if seq.started is not None:
            seq.started.set()
        if seq.status is not Status.FINISHED:
            self.scheduler.finish(seq, reason)
        self.runner.release(seq)
        self._release_followers(seq)
        if reason != "abort":
            text += seq.detokenizer.flush()
        if logprobs is None and seq.params.logprobs is not None:
            logprobs = []
        self._emit(seq, RequestOutput(seq.request_id, text, tokens or [], reason, logprobs=logprobs))
        self._seqs.pop(seq.request_id, None)
        self._emitters.pop(seq.request_id, None)
        turn_trace.finished(seq.request_id)
        if table:
            # after the client has its last token, and after any request that comes in meanwhile
            # (_persist): the conversation so far goes to host RAM and to disk in the background, so
            # a later turn, even after a restart, finds it there
            self._queue_persist(table, seq.block_names)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if seq.started is not None:
            seq.started.set()
        self.scheduler.finish(seq, "error")
        self.runner.release(seq)
        self._release_followers(seq)
        self._send(seq.request_id, exc)
        self._seqs.pop(seq.request_id, None)
        self._emitters.pop(seq.request_id, None)

    def _emit(self, seq: Sequence, out: RequestOutput) -> None:
        turn_trace.stamp(seq.request_id, "emit" if out.token_ids else "announced")
        out.prompt_tokens = seq.num_prompt_tokens
        out.completion_tokens = seq.num_output_tokens
        out.cached_tokens = seq.num_cached
        self._send(seq.request_id, out)

    def _send(self, request_id: str, payload: RequestOutput | BaseException) -> None:
        emit = self._emitters.get(request_id)
        if emit is not None:
            try:
                emit(payload)
            except RuntimeError:  # the receiving event loop is closed: nobody is listening
                pass
