"""Server-sent events, and noticing that the client has gone.

Why not Starlette's ``StreamingResponse``: under ASGI spec >= 2.4 it only learns of a
disconnect when a ``send`` fails, and during a long prefill nothing is sent, so an
abandoned request would keep the GPU busy. Here every piece of work that waits on the
engine is raced against a listener for ``http.disconnect``; whichever ends first
cancels the other, and the engine's generator is closed in a ``finally`` (closing it
is how the engine learns to abort the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any, TypeVar

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from qml_runtime import turn_trace
from qml_server.errors import ClientDisconnected

log = logging.getLogger("qml.server")

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: Mapping[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + data.encode("utf-8") + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    # Only valid once the request body has been read: before that, receive() hands
    # out body chunks, which this loop would swallow.
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` until it finishes or the client disconnects, whichever is first.

    Returns the work's result (or raises its exception). On disconnect the work is
    cancelled, its cleanup is awaited, and ``ClientDisconnected`` is raised.
    """
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch_task):
            task.cancel()
        # Wait for both to unwind, so the engine generator is really closed before we
        # return. Shielded: if we ourselves are being cancelled (server shutdown, a test
        # client hanging up), Starlette's anyio scope would otherwise cancel this wait
        # too and leave the cleanup running unsupervised.
        with anyio.CancelScope(shield=True):
            await asyncio.gather(work_task, watch_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def close_quietly(stream: Any) -> None:
    """``aclose()`` an async generator from cleanup code, never raising."""
    try:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
    except Exception:
        log.exception("error while closing an engine stream")


class EventStreamResponse(Response):
    """A ``text/event-stream`` response fed by an async iterator of encoded events.

    The iterator is closed in every outcome (finished, failed, client gone), so a
    ``finally`` in it, and the engine generator it wraps, always runs.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str] | None = None,
                 trace_id: str | None = None):
        self.events = events
        self.trace_id = trace_id  # (qml_runtime.turn_trace: stamped once its first token's event is sent)
        self.status_code = 200
        self.background = None
        # no-cache: proxies must not hold the stream; X-Accel-Buffering: nginx must not buffer it.
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await cancel_on_disconnect(receive, self._pump(send))
        except (ClientDisconnected, OSError):
            # OSError: a server speaking ASGI 2.4 reports a vanished client by failing send().
            log.info("client disconnected mid-stream; generation stopped")

    async def _pump(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            sent = 0
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                sent += 1
                # (a chat stream's events: the role's, then the first token's)
                if sent == 2 and self.trace_id is not None and turn_trace.ENABLED:
                    turn_trace.stamp(self.trace_id, "sent")
                    turn_trace.done(self.trace_id)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # If we were cancelled while awaiting send(), the iterator is suspended at a
            # yield and nothing else would ever close it.
            await close_quietly(self.events)
