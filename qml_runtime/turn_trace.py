"""Timestamps along a request's way to its first token, for finding where a served TTFT goes.

Off unless ``QML_TURN_TRACE`` names a file: then the server and the engine stamp each request at the
points below (``time.perf_counter``, one clock for both threads), and a request's stamps are appended
to that file as one JSON line once its first token has been written to the client (``sent``), or
when it finishes without one. Each stamp costs a dict lookup and a list append; disabled, a global
test.

Points, in order: ``handler`` (the route is entered), ``prompt`` (its ids are ready), ``submit``
(``Engine.submit`` made the sequence), ``drained`` (the engine thread took it from the inbox), ``admit`` (the
scheduler first tries to place it); for a history below the GPU ``located`` (its blocks found in host RAM or
on disk), ``planned`` (the restore planner has chosen), ``evicted`` (the pages it takes are free to overwrite)
and ``restore`` (its copy from host RAM is launched); ``scheduled`` (its first batch is scheduled), ``step``
(the runner is called), ``staged`` and ``replayed`` (a prefill graph's inputs written, its replay call
returned), ``announced`` (a streamed request's empty first output, ``Engine.submit``'s ``announce``),
``token`` (the step's tokens are on the host), ``emit`` (its first token handed to the server),
``first_out`` (the server's stream has it), ``sent`` (the event with the first token was written to the
socket).

Beside the points, a record keeps ``steps``: ``[start, end, tokens]`` of each step the request ran in up to its
first token (a history recomputed in several chunks, then the turn's own step), and for a history streamed in from
disk ``reads_begun`` / ``reads_ended`` (its first read's start, its last read's end, on the reader's clock: the
same monotonic clock) and ``load_applied`` (the engine took the landed blocks into its pages).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

PATH = os.environ.get("QML_TURN_TRACE") or None
ENABLED = PATH is not None
_records: dict[str, dict[str, Any]] = {}  # points -> seconds; "steps" -> [start, end, tokens]s
_current: list[str] = []  # the request ids of the step the engine is running (stamped from inside it)
_lock = threading.Lock()


ORDER = ("handler", "prompt", "submit", "drained", "admit", "located", "planned", "evicted", "restore", "scheduled",
         "step", "staged", "replayed", "announced", "token", "emit", "first_out", "sent")
ENTRIES = ("handler", "submit")  # the points that open a record; the others only add to an open one
MAX_OPEN = 4096  # records never written (a request that failed before its first token): the oldest go


def stamp(request_id: str, point: str, when: float | None = None) -> None:
    """The first time ``request_id`` reaches ``point`` (now, or ``when``: a ``time.perf_counter`` value taken
    elsewhere)."""
    if ENABLED:
        record = _records.get(request_id)
        if record is None:
            if point not in ENTRIES:
                return  # (written already: its later steps are not traced)
            record = _records[request_id] = {}
            if len(_records) > MAX_OPEN:
                _records.pop(next(iter(_records)))
        record.setdefault(point, time.perf_counter() if when is None else when)


def stamp_step(point: str) -> None:
    """``point`` for every request of the step being run (``running``)."""
    if ENABLED:
        now = time.perf_counter()
        for rid in _current:
            record = _records.get(rid)
            if record is not None:
                record.setdefault(point, now)


def step_ran(start: float, end: float, tokens: list[int]) -> None:
    """The step being run (``running``) ran from ``start`` to ``end``, computing ``tokens[i]`` of request i."""
    if ENABLED:
        for rid, n in zip(_current, tokens):
            record = _records.get(rid)
            if record is not None and "emit" not in record:  # (up to the step of its first token)
                record.setdefault("steps", []).append([start, end, n])


def running(request_ids: list[str]) -> None:
    """The requests of the step about to run (``stamp_step``'s)."""
    if ENABLED:
        _current[:] = request_ids


def finished(request_id: str) -> None:
    """The engine is done with ``request_id``: its record is written unless the server opened it (the server
    writes it once the first token is sent)."""
    if ENABLED and "handler" not in _records.get(request_id, ("handler",)):
        done(request_id)


def done(request_id: str) -> None:
    """Write ``request_id``'s stamps (once) and forget them."""
    if not ENABLED:
        return
    record = _records.pop(request_id, None)
    if not record:
        return
    line = json.dumps({"id": request_id, **record}) + "\n"
    with _lock, open(PATH, "a") as f:
        f.write(line)


def gaps(record: dict[str, float]) -> dict[str, float]:
    """A record's time (ms) between consecutive points it has, and ``total`` from ``handler`` to ``sent``."""
    have = [p for p in ORDER if p in record]
    out = {f"{a}->{b}": (record[b] - record[a]) * 1e3 for a, b in zip(have, have[1:])}
    if "handler" in record and "sent" in record:
        out["total"] = (record["sent"] - record["handler"]) * 1e3
    return out
