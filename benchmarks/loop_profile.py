"""cProfile of the engine's loop thread, for benchmarks that want the host's side of a step
(``engine_h200.py --profile-loop``): scheduling, tier bookkeeping, launches, and the waits
inside them. torch.profiler shows the device; this shows which Python call waited."""

from __future__ import annotations

from pathlib import Path


def profile_engine_loops(out: Path) -> None:
    """Each engine's loop thread runs under cProfile (the host's side of a step: scheduling, tier
    bookkeeping, launches, and the waits inside them); when the engine stops, the stats go to
    ``out/loop-{cumulative,tottime}.txt`` and the tiers' and scheduler's callees to
    ``out/loop-callees.txt`` (the last engine of the run wins)."""
    import cProfile
    import io
    import pstats

    from qml_runtime import engine as engine_mod

    loop = engine_mod.Engine._loop

    def profiled(self):
        prof = cProfile.Profile()
        prof.enable()
        try:
            loop(self)
        finally:
            prof.disable()
            for key in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(key).print_stats(80)
                (out / f"loop-{key}.txt").write_text(text.getvalue())
            text = io.StringIO()
            pstats.Stats(prof, stream=text).print_callees(
                "_admit|restore_host|_upload|_upload_layers|flush_spills|_gather_spills|_copy_down|_gather$|"
                "gather_pages|spill|pump|_fill_first|_iterate|_prepare")
            (out / "loop-callees.txt").write_text(text.getvalue())

    engine_mod.Engine._loop = profiled


class TurnProfile:
    """cProfile of the engine thread's loop iterations only while ``on`` is set (one turn, not the
    prompts around it): ``with prof.turn(): ...`` around a request, then ``prof.dump(path)``."""

    def __init__(self):
        import cProfile
        import threading

        from qml_runtime import engine as engine_mod

        self.on = threading.Event()
        self.prof = cProfile.Profile()
        iterate = engine_mod.Engine._iterate
        prof, on = self.prof, self.on

        def profiled(engine, inflight):
            if not on.is_set():
                return iterate(engine, inflight)
            prof.enable()
            try:
                return iterate(engine, inflight)
            finally:
                prof.disable()

        engine_mod.Engine._iterate = profiled

    def turn(self):
        import contextlib

        @contextlib.contextmanager
        def scope():
            self.on.set()
            try:
                yield
            finally:
                self.on.clear()
        return scope()

    def dump(self, path: Path, lines: int = 60) -> str:
        import io
        import pstats

        text = io.StringIO()
        for key in ("cumulative", "tottime"):
            pstats.Stats(self.prof, stream=text).sort_stats(key).print_stats(lines)
        path.write_text(text.getvalue())
        return text.getvalue()


# names of device activity, by what it is in a turn (first match wins)
TIMELINE_CLASSES = (
    ("pagecopy", ("_page_copy_kernel",)),
    ("attention", ("attention",)),
    ("gemm", ("nvjet", "gemm", "gemv", "cutlass", "splitKreduce")),
    ("DtoH", ("Memcpy DtoH", "Device -> Pageable", "Device -> Pinned")),
    ("HtoD", ("Memcpy HtoD",)),
    ("DtoD", ("Memcpy DtoD",)),
)


def _timeline_class(name: str) -> str:
    for cls, keys in TIMELINE_CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def device_timeline(prof, path: Path, bin_ms: float = 5.0, marker: str | None = None) -> str:
    """What the device did over one profiled turn, from the profiler's chrome trace: per stream the
    busy time and span, then per ``bin_ms`` bin the busy ms of each class of work (restore copies,
    saves, attention, GEMMs, memcpys by direction, other kernels), so overlaps and idle gaps show.
    ``marker``: a ``record_function`` name (the turn's submit); times then count from it, and the
    bins start there. The trace goes to ``path`` (.json); the summary is returned."""
    import json

    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text()).get("traceEvents", [])
    events = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        return "no device events"
    marks = [float(e["ts"]) for e in trace if marker and e.get("name") == marker and "ts" in e]
    t0 = marks[0] if marks else min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)
    lines = [f"device until {(end - t0) / 1e3:.2f} ms after {marker if marks else 'the first event'}, "
             f"{len(events)} events (negative times: before it)"]
    streams: dict = {}
    for e in events:
        s = streams.setdefault(e.get("args", {}).get("stream", "?"), {"busy": 0.0, "first": 1e18, "last": 0.0,
                                                                      "n": 0, "classes": {}})
        ts, dur = float(e["ts"]) - t0, float(e.get("dur", 0))
        s["busy"] += dur
        s["n"] += 1
        s["first"], s["last"] = min(s["first"], ts), max(s["last"], ts + dur)
        cls = _timeline_class(e.get("name", ""))
        s["classes"][cls] = s["classes"].get(cls, 0.0) + dur
    for sid, s in sorted(streams.items(), key=lambda kv: -kv[1]["busy"]):
        parts = ", ".join(f"{c} {v / 1e3:.2f}" for c, v in sorted(s["classes"].items(), key=lambda kv: -kv[1]))
        lines.append(f"stream {sid}: {s['n']} events, busy {s['busy'] / 1e3:.2f} ms, "
                     f"{s['first'] / 1e3:.2f}-{s['last'] / 1e3:.2f} ms ({parts})")
    width = bin_ms * 1e3
    bins = [dict() for _ in range(int(max(end - t0, 0) // width) + 1)]
    for e in events:  # each event's time spread over the bins it covers (from t0 on), by class and stream
        a, b = max(float(e["ts"]) - t0, 0.0), float(e["ts"]) - t0 + float(e.get("dur", 0))
        key = f"{_timeline_class(e.get('name', ''))}@{e.get('args', {}).get('stream', '?')}"
        i = int(a // width)
        while a < b and i < len(bins):
            cut = min(b, (i + 1) * width)
            bins[i][key] = bins[i].get(key, 0.0) + cut - a
            a, i = cut, i + 1
    totals: dict = {}
    for row in bins:
        for k, v in row.items():
            totals[k] = totals.get(k, 0.0) + v
    keys = sorted(totals, key=lambda k: -totals[k])[:9]  # the page-copy kernel restores and saves: the stream tells
    # the host's side: kernel launches per bin (when the work was queued), and the runtime calls that
    # blocked (synchronizations, pageable copies) with their thread
    runtime = [e for e in trace if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
               and float(e["ts"]) >= t0]
    launches = [0] * len(bins)
    for e in runtime:
        if "Launch" in e.get("name", ""):
            i = int((float(e["ts"]) - t0) // width)
            if i < len(bins):
                launches[i] += 1
    lines.append("busy ms per bin, class@stream; ms from t0 | launches | " + " | ".join(keys))
    for i, row in enumerate(bins):
        lines.append(f"{i * bin_ms:7.1f} | {launches[i]:4d} | "
                     + " | ".join(f"{row.get(k, 0) / 1e3:5.2f}" for k in keys))
    # the last device events by name: what the turn's end waited for after the bulk of its work
    lines.append("the last 30 device events: start ms, ms, stream, name")
    for e in sorted(events, key=lambda e: float(e["ts"]))[-30:]:
        lines.append(f"  {(float(e['ts']) - t0) / 1e3:8.2f} {float(e.get('dur', 0)) / 1e3:7.3f} "
                     f"{e.get('args', {}).get('stream', '?')} {e.get('name', '')[:90]}")
    slow = [e for e in runtime if float(e.get("dur", 0)) >= 300]
    lines.append(f"runtime calls of 0.3 ms or more after t0 ({len(slow)}): start ms, ms, name, thread")
    for e in slow[:40]:
        lines.append(f"  {(float(e['ts']) - t0) / 1e3:8.2f} {float(e['dur']) / 1e3:7.2f} {e.get('name')} tid {e.get('tid')}")
    return "\n".join(lines)


class StackSampler:
    """A poor man's py-spy for one thread: every ``period_s`` the thread's Python stack is sampled
    (``sys._current_frames``), and every collection of the cyclic GC is timed (``gc.callbacks``),
    between ``start()`` and ``stop()``. ``summary()`` merges consecutive samples with the same
    innermost frames into spans: where a thread that launched nothing for tens of ms was."""

    def __init__(self, thread_id: int, period_s: float = 0.001, depth: int = 5):
        self.thread_id, self.period_s, self.depth = thread_id, period_s, depth
        self.samples: list = []
        self.gcs: list = []
        self._stop = None
        self._thread = None
        self._gc_t0 = None

    def _on_gc(self, phase, info) -> None:
        import time

        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0 is not None:
            self.gcs.append((self._gc_t0, time.perf_counter() - self._gc_t0, info.get("generation"),
                             info.get("collected")))
            self._gc_t0 = None

    def start(self) -> None:
        import gc
        import sys
        import threading
        import time

        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        gc.callbacks.append(self._on_gc)

        def run():
            while not self._stop.is_set():
                frame = sys._current_frames().get(self.thread_id)
                stack = []
                while frame is not None and len(stack) < self.depth:
                    code = frame.f_code
                    stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                self.samples.append((time.perf_counter(), tuple(stack)))
                time.sleep(self.period_s)

        self._thread = threading.Thread(target=run, name="stack-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        import gc

        self._stop.set()
        self._thread.join()
        gc.callbacks.remove(self._on_gc)

    def summary(self, min_ms: float = 1.0) -> str:
        """Spans of at least ``min_ms`` where the sampled stack stayed the same (innermost first),
        in ms from ``start()``; then the GC's collections."""
        lines, i = [], 0
        while i < len(self.samples):
            j = i
            while j + 1 < len(self.samples) and self.samples[j + 1][1] == self.samples[i][1]:
                j += 1
            t_a, t_b = self.samples[i][0] - self.t0, self.samples[min(j + 1, len(self.samples) - 1)][0] - self.t0
            if (t_b - t_a) * 1e3 >= min_ms:
                lines.append(f"{t_a * 1e3:8.2f} +{(t_b - t_a) * 1e3:6.2f} ms  " + " <- ".join(self.samples[i][1]))
            i = j + 1
        for t, dur, gen, collected in self.gcs:
            lines.append(f"gc gen {gen}: at {(t - self.t0) * 1e3:.2f} ms, {dur * 1e3:.2f} ms, {collected} collected")
        return "\n".join(lines)


class CallTimers:
    """Wall time the engine thread spends inside chosen methods, cheaply enough to leave on for a
    whole turn (two perf_counter calls a call, no profiler): ``CallTimers(engine, thread_id)`` wraps
    the engine's, its tiers', host tier's and runner's methods named in ``METHODS`` on those objects
    (instance attributes, so other engines are untouched). ``mark()`` before a request, ``delta()``
    after: per method the ms spent, the calls, and when the first call began (ms after the mark),
    counting only calls made on ``thread_id`` (the disk writer's threads call some of them too).
    Nested methods count in both (``_persist`` holds ``persist``). ``span_list()``: the calls of
    ``SPAN_MIN_MS`` or more one by one, in order, around the mark (what the engine thread did between a
    turn's arrival and its step)."""

    METHODS = {
        "engine": ("_persist", "_pump", "_drain_inbox", "_note_first_scheduled", "_take_tokens"),
        "scheduler": ("schedule", "_admit", "_restorable", "_cached_prefix"),
        "blocks": ("grow", "acquire", "register_run", "lookup_run"),
        "tiers": ("persist", "_write_through", "_gather", "flush_spills", "_gather_spills", "_copy_down",
                  "restore_host", "_upload", "_upload_layers", "pump", "plan", "locate_run", "_settle_slot",
                  "_fill_first", "hold_writes"),
        # (not the methods called once per page, as host.touch and host.reserve: ~1-2 us of timing each, ~2,500
        # calls in a host turn's evictions, made the spans of their callers several ms longer than untimed)
        "host": ("find_run",),
        "writes": ("hand_over",),
        "writer": ("detach", "put_pages", "hold"),
        "runner": ("step", "launch"),
    }
    # calls of at least this long are also kept one by one (``spans``), from SPAN_FROM_MS before the mark
    # to SPAN_TO_MS after it: what the engine thread did, in order, between a turn's arrival and its step
    SPAN_MIN_MS, SPAN_FROM_MS, SPAN_TO_MS = 0.1, -30.0, 40.0

    def __init__(self, engine, thread_id: int):
        import functools
        import threading
        import time

        self.thread_id, self.stats, self.t0 = thread_id, {}, time.perf_counter()
        self.spans: list[tuple[float, float, str]] = []  # (start, seconds, method), start absolute
        tiers = engine.tiers
        objects = {"engine": engine, "scheduler": engine.scheduler, "blocks": engine.scheduler.blocks,
                   "tiers": tiers, "host": getattr(tiers, "host", None),
                   "writes": getattr(tiers, "_host_writes", None), "writer": getattr(tiers, "_writer", None),
                   "runner": engine.runner}
        span_min = self.SPAN_MIN_MS / 1e3
        for kind, names in self.METHODS.items():
            obj = objects[kind]
            for name in names:
                fn = getattr(obj, name, None) if obj is not None else None
                if fn is None or not callable(fn):
                    continue
                key = f"{kind}.{name}"

                def timed(*a, _fn=fn, _key=key, **kw):
                    if threading.get_ident() != self.thread_id:
                        return _fn(*a, **kw)
                    start = time.perf_counter()
                    try:
                        return _fn(*a, **kw)
                    finally:
                        took = time.perf_counter() - start
                        rec = self.stats.setdefault(_key, [0.0, 0, None])
                        rec[0] += took
                        rec[1] += 1
                        if rec[2] is None:
                            rec[2] = start - self.t0
                        if took >= span_min:
                            self.spans.append((start, took, _key))

                setattr(obj, name, functools.wraps(fn)(timed))

    def mark(self) -> None:
        import time

        self.t0 = time.perf_counter()
        self.stats = {}
        # the calls still open at the mark are kept when they end; those ended long before are dropped
        self.spans = [sp for sp in self.spans if sp[0] - self.t0 >= self.SPAN_FROM_MS / 1e3]

    def span_list(self) -> list:
        """[start ms after mark(), ms, method] of the calls of SPAN_MIN_MS or more, from SPAN_FROM_MS before
        the mark to SPAN_TO_MS after it, in order of their start (a nested call follows its caller)."""
        rows = sorted(sp for sp in self.spans if self.SPAN_FROM_MS <= (sp[0] - self.t0) * 1e3 <= self.SPAN_TO_MS)
        return [[round((t - self.t0) * 1e3, 2), round(d * 1e3, 2), k] for t, d, k in rows]

    def delta(self, min_ms: float = 0.05) -> dict:
        """{method: [ms, calls, first call's start in ms after mark()]}, the longest first."""
        rows = sorted(self.stats.items(), key=lambda kv: -kv[1][0])
        return {k: [round(s * 1e3, 2), n, round(first * 1e3, 2)] for k, (s, n, first) in rows if s * 1e3 >= min_ms}
