"""The prefill steps' times the restore planner learns from, measured where the work runs.

On a GPU a step's host time is not its device time. A step that samples no token (a split's head, a long
prompt's first chunk) returns once its kernels are queued: on the H200 a 20.5k-token head came back after 41-123
ms for ~650 ms of device work. The planner took those times to mean a prefill ran at half its curve (its ratio's
floor), and its prefill scale fell by ~0.1 after every split turn: the next turn's plan then priced its head ~10%
too fast (est. 644 ms, took ~700; benchmarks/results/sessions-h200-2026-12-06.md). And a step that samples waits
for whatever ran before it on the stream, which its host time counts too.

So on a GPU each such step is bracketed by two timing events on the compute stream, and its time is read once the
device has passed the second one (``poll``: at each step, without waiting). On a CPU the work runs in the call, and
the host time is the step's time.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

# steps waiting for their events; the device runs them in order, so more than a few means nobody polls
MAX_PENDING = 64


class PrefillClock:
    """``start()`` before a step, ``stop(...)`` after it; the planner's ``observe_prefill`` hears of it when the
    step's time is known. ``events``: makes a timing event (``torch.cuda.Event(enable_timing=True)``-like:
    ``record()``, ``query()``, ``elapsed_time(other)`` in ms), or None to time on the host."""

    def __init__(self, observe: Callable[[Sequence[tuple[int, int]], float, bool], None],
                 events: Callable[[], object] | None = None):
        self._observe = observe
        self._events = events
        self._pending: collections.deque = collections.deque()  # (chunks, beside, start event, end event)

    def start(self):
        """A mark before the step: an event recorded on the stream (or None on the host)."""
        if self._events is None:
            return None
        mark = self._events()
        mark.record()
        return mark

    def stop(self, mark, chunks: Sequence[tuple[int, int]], host_seconds: float, beside: bool = False) -> None:
        """The step begun at ``mark`` has been launched (and, if it sampled, has run); ``host_seconds``: its
        time on the host, which is the step's own where there are no events."""
        if mark is None:
            self._observe(chunks, host_seconds, beside)
            return
        end = self._events()
        end.record()
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
        self._pending.append((list(chunks), beside, mark, end))
        self.poll()

    def poll(self) -> int:
        """Hand the planner the steps the device has finished, oldest first; how many are still running."""
        while self._pending and self._pending[0][3].query():
            chunks, beside, mark, end = self._pending.popleft()
            self._observe(chunks, mark.elapsed_time(end) / 1e3, beside)
        return len(self._pending)
