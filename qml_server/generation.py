"""Driving one request through the engine, for both endpoints.

The engine hands back an async generator of ``RequestOutput`` deltas. Everything
here owns that generator from creation to ``aclose()``: closing it early is how the
engine is told to abort the request and free its KV blocks.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from qml_runtime.sampling_params import RequestOutput, SamplingParams
from qml_server.errors import log_internal_error
from qml_server.sse import SSE_DONE, cancel_on_disconnect, close_quietly, sse_event

log = logging.getLogger("qml.server")

EngineStream = AsyncGenerator[RequestOutput, None]


class EngineStreamError(RuntimeError):
    """The engine broke its contract (e.g. ended a stream without a finish_reason)."""


@dataclass
class Finished:
    """A whole completion, gathered from the deltas."""

    text: str
    finish_reason: str
    last: RequestOutput  # carries the cumulative token counts


async def first_output(request: Request, stream: EngineStream) -> RequestOutput:
    """Wait for the engine's first output before any response is sent.

    Waiting here (instead of inside the streamed body) means an error the engine
    raises at admission is still a real HTTP status rather than an error event
    after a 200. The wait is raced against a disconnect, since a prefill can be long.
    """
    try:
        return await cancel_on_disconnect(request.receive, _next(stream))
    except BaseException:
        await close_quietly(stream)
        raise


async def collect(request: Request, stream: EngineStream) -> Finished:
    """Run a non-streamed request to the end, stopping early if the client leaves."""
    return await cancel_on_disconnect(request.receive, _gather(stream))


async def outputs_until_finish(first: RequestOutput, stream: EngineStream) -> AsyncIterator[RequestOutput]:
    """``first``, then the rest of the stream, ending with the output that has a finish_reason.

    Closes the engine stream however the iteration ends; callers should wrap this in
    ``contextlib.aclosing`` so that happens promptly when they stop early.
    """
    try:
        out = first
        while True:
            yield out
            if out.finish_reason is not None:
                return
            out = await _next(stream)
    finally:
        await close_quietly(stream)


async def _next(stream: EngineStream) -> RequestOutput:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        raise EngineStreamError("the engine stream ended without a finish_reason") from None


async def _gather(stream: EngineStream) -> Finished:
    parts: list[str] = []
    try:
        while True:
            out = await _next(stream)
            parts.append(out.text)
            if out.finish_reason is not None:
                return Finished("".join(parts), out.finish_reason, out)
    finally:
        await close_quietly(stream)


def start_generation(
    request: Request, prompt_ids: list[int], params: SamplingParams, request_id: str, started: float,
    cache_salt: str | None = None, user: str | None = None,
) -> EngineStream:
    """Admit the request (503 when the engine's queue is full) and open its engine stream.

    The stream is measured for /metrics from ``started``, the ``time.monotonic()`` at
    which the request reached the handler. Nothing reaches the engine until the stream
    is first advanced.
    """
    state = request.app.state
    state.admission.check()
    # the authenticated key's tenant salts the KV cache: tenants never reuse each other's pages;
    # a request's own cache_salt narrows that further (within its tenant, never across)
    tenant = getattr(request.state, "tenant", None)
    if cache_salt:
        tenant = f"{tenant or ''}\x00{cache_salt}"
    # a conversation that names itself (x-session-id, or OpenAI's `user`) keeps its KV longest
    session = request.headers.get("x-session-id") or user
    stream = state.engine.generate(prompt_ids, params, request_id, tenant=tenant, session=session)
    return state.metrics.track(stream, started)


def usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": out.cached_tokens},
    }


def log_request(request_id: str, prompt_tokens: int, params: SamplingParams, stream: bool) -> None:
    log.debug("%s: %d prompt tokens, max_tokens=%d, stream=%s", request_id, prompt_tokens, params.max_tokens, stream)


async def sse_completion_events(
    *,
    head: dict[str, Any],
    first: RequestOutput,
    stream: EngineStream,
    include_usage: bool,
    text_choice: Callable[[str], dict[str, Any]],
    finish_choice: Callable[[str], dict[str, Any]],
    opening_choice: dict[str, Any] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body shared by both endpoints: chunks, one finish chunk, usage, [DONE].

    ``head`` holds id/object/created/model. Exactly one chunk carries a finish_reason.
    With ``include_usage`` every chunk has ``"usage": null`` and a last chunk with no
    choices carries the totals, as OpenAI does. An engine failure after the 200 has
    gone out can only be reported in-band: an error event, then [DONE].
    """
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse_event({**head, "choices": [choice], **extra})

    try:
        if opening_choice is not None:
            yield chunk(opening_choice)
        last = first
        async with aclosing(outputs_until_finish(first, stream)) as outputs:
            async for out in outputs:
                if out.text:
                    yield chunk(text_choice(out.text))
                last = out
        yield chunk(finish_choice(last.finish_reason or "stop"))
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": usage(last)})
    except Exception as exc:  # noqa: BLE001  (logged with its traceback under an error id)
        yield sse_event(log_internal_error(f"{head['id']}: engine failed mid-stream", exc).body())
    yield SSE_DONE
