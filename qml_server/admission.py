"""Load shedding: a bound on the requests waiting in the engine.

Past the bound a new generation request is answered at once with 503 and
``Retry-After`` instead of joining a queue whose wait would only grow; the requests
already admitted, and the server, carry on. The bound is checked against the
engine's own count of waiting requests (``engine.stats()["num_requests_waiting"]``),
so an engine without ``stats()`` is never refused.

The check is not atomic with the engine's queue. A request joins that queue only
when its stream is first advanced, one or more event-loop turns after its check, so
requests checked in between all see the same count: a burst can overshoot the bound
by about the number of requests that arrive within that window. That is acceptable
for what the bound is for, keeping queueing delay and memory for pending requests
in check; the engine itself never fails because its queue is longer.
"""

from __future__ import annotations

from qml_server.errors import queue_full
from qml_server.metrics import EngineStats, ServerMetrics

DEFAULT_MAX_QUEUED_REQUESTS = 256
RETRY_AFTER_S = 1


class Admission:
    def __init__(self, engine_stats: EngineStats | None, max_queued: int | None, metrics: ServerMetrics):
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued_requests must be positive, got {max_queued}")
        self.engine_stats = engine_stats
        self.max_queued = max_queued  # None: unbounded
        self.metrics = metrics

    def check(self) -> None:
        """Raise the 503 ``queue_full`` error when the engine's waiting queue is at the bound."""
        if self.engine_stats is None or self.max_queued is None:
            return
        waiting = int(self.engine_stats().get("num_requests_waiting", 0))
        if waiting >= self.max_queued:
            self.metrics.requests_rejected.inc()
            raise queue_full(self.max_queued, RETRY_AFTER_S)
