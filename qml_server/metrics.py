"""Prometheus metrics, served at GET /metrics.

Names mirror vLLM's (``vllm:`` becomes ``qml:``) so existing dashboards carry over.
Two sources feed them:

* Latencies and token counts are measured here, in the server, from each request's
  stream of outputs (request start, first token, each later token, finish). They do
  not depend on engine internals, so they mean the same on any engine.
* Engine state is read at scrape time from ``engine.stats()``. An engine without it
  simply has none of those families (and no queue bound, see admission.py). The one
  engine-side latency, queue time (arrival to first scheduled), is pushed by the
  engine through ``engine.set_queue_time_observer(fn)`` when it has that method.

The ``engine.stats()`` contract: a dict, cheap, callable from any thread (values may
be a step old); a missing key only hides its family.

==========================================  =====  ===================================================
``num_requests_running``                    int    requests in the running batch
``num_requests_waiting``                    int    submitted, not yet scheduled (includes preempted)
``kv_cache_usage``                          float  fraction of KV pages held by requests, 0..1
``prefix_cache_queries``                    int    cumulative prompt tokens looked up in the prefix cache
``prefix_cache_hits``                       int    cumulative prompt tokens found there
``kv_tier_bytes``                           dict   tier name ("gpu", "host", "disk") -> bytes of
                                                   reusable (content-named) KV held in that tier
``kv_restored_blocks``                      dict   tier ("host", "disk") -> cumulative KV pages copied
                                                   back to the GPU instead of recomputed
``kv_recomputed_blocks``                    int    cumulative pages found on disk but recomputed,
                                                   because the planner judged that faster
``kv_spilled_blocks``                       dict   tier ("host", "disk") -> cumulative pages written down
``kv_restore_seconds``                      float  cumulative time spent copying pages back
``kv_restore_plans``                        dict   plan ("restore", "recompute", "split") -> cumulative
                                                   requests whose history below the GPU got that plan
``kv_restore_cuts``                         int    cumulative loads from disk cut short (their late
                                                   blocks computed: faster than waiting for them)
``kv_restore_planned_seconds``              float  cumulative planner estimates for the histories
                                                   it planned (restore, recompute or split)
``kv_restore_recompute_planned_seconds``    float  the same for computing each of them
                                                   all instead
``kv_restore_rates``                        dict   tier ("host", "disk") -> bytes/s the planner prices
                                                   a restore from it at now (measured, or its guess)
==========================================  =====  ===================================================

Every app owns its registry: tests build many apps in one process, and a global
registry would refuse the second set of metric names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Mapping
from contextlib import aclosing
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from qml_runtime import turn_trace
from qml_runtime.sampling_params import RequestOutput

log = logging.getLogger("qml.server")

EngineStats = Callable[[], Mapping[str, Any]]

# Buckets in seconds, wide enough for a GPU (a few ms per token) and a CPU (a few
# hundred ms per token, seconds to the first one) alike.
TOKEN_LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                         0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                           7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
E2E_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                       120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FINISH_REASONS = ("stop", "length", "abort")

# The classic text format, which every Prometheus version reads; prometheus_client's
# CONTENT_TYPE_LATEST announces 1.0.0 in recent releases, which older servers may not.
# The names here need nothing beyond it (colons are classic).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServerMetrics:
    """The registry of one app, and the instruments the routes record into."""

    def __init__(self, model_name: str, engine_stats: EngineStats | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine_stats = engine_stats
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram(
            "qml:time_to_first_token_seconds", "From the request reaching the server to its first token.",
            REQUEST_LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "qml:inter_token_latency_seconds", "Between successive outputs of one request.", TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "qml:e2e_request_latency_seconds", "From the request reaching the server to its finish.",
            E2E_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "qml:request_queue_time_seconds", "From the engine receiving a request to its first scheduling.",
            REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = counter("qml:prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = counter("qml:generation_tokens", "Tokens generated.")
        self.requests_rejected = counter("qml:requests_rejected", "Requests refused with 503: the queue was full.")
        success = Counter("qml:request_success", "Requests that ran to a finish_reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self._success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self._success_family = success
        if engine_stats is not None:
            self.registry.register(_EngineCollector(model_name, engine_stats))

    def watch_replies(self, replies: Any) -> None:
        """Export a ``qml_server.replies.ReplyMemory``'s counts at each scrape."""
        self.registry.register(_RepliesCollector(self.model_name, replies))

    def observe_queue_time(self, seconds: float) -> None:
        """The engine's hook (called on its thread; prometheus_client is thread-safe)."""
        self.request_queue_time.observe(max(0.0, seconds))

    def finished(self, reason: str) -> None:
        child = self._success.get(reason)
        if child is None:  # a reason this module did not foresee still gets counted
            child = self._success[reason] = self._success_family.labels(self.model_name, reason)
        child.inc()

    def track(self, stream: AsyncGenerator[RequestOutput, None], started: float,
              primary: bool = True) -> AsyncGenerator[RequestOutput, None]:
        """``stream``, passed through unchanged while its timings and token counts are recorded.

        ``started`` is the ``time.monotonic()`` at which the request reached the server.
        Closing the returned generator closes ``stream`` (that is how the engine aborts).
        Of a request's other choices (``primary=False``) only the generated tokens count:
        the request's prompt, latencies and finish are its first choice's.
        """
        return _tracked(self, stream, started, primary)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


async def _tracked(metrics: ServerMetrics, stream: AsyncGenerator[RequestOutput, None],
                   started: float, primary: bool) -> AsyncGenerator[RequestOutput, None]:
    last_token_at: float | None = None
    async with aclosing(stream):
        async for out in stream:
            now = time.monotonic()
            if not primary:
                metrics.generation_tokens.inc(len(out.token_ids))
            elif out.token_ids:
                if last_token_at is None:
                    turn_trace.stamp(out.request_id, "first_out")
                    metrics.time_to_first_token.observe(now - started)
                    # counted once the prompt has really been through the model
                    metrics.prompt_tokens.inc(out.prompt_tokens)
                else:
                    # one observation per output: the engine emits one output per step
                    metrics.inter_token_latency.observe(now - last_token_at)
                last_token_at = now
                metrics.generation_tokens.inc(len(out.token_ids))
            if primary and out.finish_reason is not None:
                metrics.e2e_request_latency.observe(now - started)
                metrics.finished(out.finish_reason)
            yield out


class _EngineCollector(Collector):
    """Engine gauges and counters, read from ``engine.stats()`` at each scrape."""

    def __init__(self, model_name: str, stats: EngineStats):
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = dict(self.stats())
        except Exception:
            # a scrape must still return the server's own metrics
            log.exception("engine.stats() failed during a /metrics scrape")
            return
        labels, model = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, key: str) -> Iterator[Metric]:
            if key in stats:
                family = GaugeMetricFamily(name, doc, labels=labels)
                family.add_metric(model, float(stats[key]))
                yield family

        def counter(name: str, doc: str, key: str) -> Iterator[Metric]:
            if key in stats:
                family = CounterMetricFamily(name, doc, labels=labels)
                family.add_metric(model, float(stats[key]))
                yield family

        def by_label(kind: type, name: str, doc: str, key: str, label: str) -> Iterator[Metric]:
            """A family of ``kind`` from the dict ``stats[key]``: a sample per entry, its key as ``label``."""
            if stats.get(key):
                family = kind(name, doc, labels=["model_name", label])
                for value, amount in stats[key].items():
                    family.add_metric([self.model_name, str(value)], float(amount))
                yield family

        yield from gauge("qml:num_requests_running", "Requests in the engine's running batch.",
                         "num_requests_running")
        yield from gauge("qml:num_requests_waiting", "Requests waiting in the engine for their first scheduling.",
                         "num_requests_waiting")
        yield from gauge("qml:kv_cache_usage_perc", "Fraction of KV pages held by requests (0 to 1).",
                         "kv_cache_usage")
        yield from counter("qml:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           "prefix_cache_queries")
        yield from counter("qml:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           "prefix_cache_hits")
        yield from by_label(GaugeMetricFamily, "qml:kv_tier_bytes", "Bytes of reusable (content-named) KV held per "
                            "tier.", "kv_tier_bytes", "tier")
        for key, name, doc, label in (
            ("kv_restored_blocks", "qml:kv_restored_blocks", "KV pages copied back to the GPU from a lower tier.",
             "tier"),
            ("kv_spilled_blocks", "qml:kv_spilled_blocks", "KV pages written down to a lower tier.", "tier"),
            ("kv_restore_plans", "qml:kv_restore_plans", "Requests whose history below the GPU was restored, "
             "recomputed, or split (head recomputed while the tail streamed in).", "plan"),
        ):
            yield from by_label(CounterMetricFamily, name, doc, key, label)
        yield from counter("qml:kv_recomputed_blocks", "KV pages found on disk but recomputed (judged faster).",
                           "kv_recomputed_blocks")
        yield from counter("qml:kv_restore_seconds", "Time spent copying KV pages back to the GPU.",
                           "kv_restore_seconds")
        yield from counter("qml:kv_restore_cuts", "Loads from disk cut short: their late blocks were computed "
                           "instead, once that was faster than waiting for them.", "kv_restore_cuts")
        yield from counter("qml:kv_restore_planned_seconds", "The restore planner's estimates for the histories "
                           "below the GPU it planned (copied, recomputed or split).", "kv_restore_planned_seconds")
        yield from counter("qml:kv_restore_recompute_planned_seconds", "The restore planner's estimates for "
                           "computing each of those histories all instead.", "kv_restore_recompute_planned_seconds")
        yield from by_label(GaugeMetricFamily, "qml:kv_restore_rate_bytes_per_second", "The rate the restore "
                            "planner prices a copy from this tier at (measured, or its first guess).",
                            "kv_restore_rates", "tier")


class _RepliesCollector(Collector):
    """Kept replies (qml_server.replies): what is held, and how often a chat prompt reused one."""

    def __init__(self, model_name: str, replies: Any):
        self.model_name = model_name
        self.replies = replies

    def collect(self) -> Iterator[Metric]:
        stats = self.replies.stats()
        for name, doc, key, family_type in (
            ("qml:kept_replies", "Conversations whose replies' generated ids are kept.", "entries", GaugeMetricFamily),
            ("qml:kept_reply_tokens", "Token ids held by the kept replies.", "tokens", GaugeMetricFamily),
            ("qml:kept_reply_hits", "Chat prompts that reused a kept reply's ids.", "hits", CounterMetricFamily),
            ("qml:kept_reply_misses", "Chat prompts that found no kept reply to reuse.", "misses",
             CounterMetricFamily),
            ("qml:kept_reply_reused_tokens", "Prompt tokens taken from kept replies instead of encoded.",
             "reused_tokens", CounterMetricFamily),
        ):
            family = family_type(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(stats[key]))
            yield family


async def metrics_endpoint(request: Request) -> Response:
    # Public, like /health: scrapers carry no API key, and nothing here is a secret.
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.exposition(), media_type=CONTENT_TYPE)
