"""Driving one request through the engine, for both endpoints.

The engine hands back an async generator of ``RequestOutput`` deltas per choice (a
request with ``n > 1`` is n engine requests). Everything here owns those generators
from creation to ``aclose()``: closing one early is how the engine is told to abort
that request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request

from qml_runtime.sampling_params import RequestOutput, SamplingParams, TokenLogprob
from qml_server.errors import log_internal_error
from qml_server.replies import ReplyMemory
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
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them


async def first_outputs(request: Request, streams: list[EngineStream]) -> list[RequestOutput]:
    """Wait for each choice's first output before any response is sent.

    Waiting here (instead of inside the streamed body) means an error the engine
    raises at admission is still a real HTTP status rather than an error event
    after a 200. The wait is raced against a disconnect, since a prefill can be long.
    Choice 0 goes first: the others then find the prompt's pages in the prefix cache.
    """
    try:
        first = await cancel_on_disconnect(request.receive, _next(streams[0]))
        rest = await cancel_on_disconnect(request.receive, asyncio.gather(*map(_next, streams[1:])))
        return [first, *rest]
    except BaseException:
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await close_quietly(stream)
        raise


async def collect(request: Request, streams: list[EngineStream]) -> list[Finished]:
    """Run a non-streamed request's choices to the end, stopping early if the client leaves."""
    return await cancel_on_disconnect(request.receive, _gather_all(streams))


async def _gather_all(streams: list[EngineStream]) -> list[Finished]:
    tasks = [asyncio.ensure_future(_gather(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # one choice failed, or we are cancelled: the others stop too
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


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
    logprobs: list[TokenLogprob] | None = None
    try:
        while True:
            out = await _next(stream)
            parts.append(out.text)
            if out.logprobs is not None:
                logprobs = (logprobs or []) + out.logprobs
            if out.finish_reason is not None:
                return Finished("".join(parts), out.finish_reason, out, logprobs)
    finally:
        await close_quietly(stream)


async def merged(sources: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from several streams as they come; closes them all however it ends."""
    if len(sources) == 1:
        async for out in sources[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(_anext(source)): i for i, source in enumerate(sources)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()
                if out is None:
                    continue
                yield i, out
                pending[asyncio.ensure_future(_anext(sources[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*pending, return_exceptions=True)
            for source in sources:
                await close_quietly(source)


async def _anext(source: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await source.__anext__()
    except StopAsyncIteration:
        return None


def announce_request(request: Request) -> None:
    """A generation request has reached its handler: an idle engine holds its background work (KV pages handed
    to the tiers and copied down) until the request is submitted, as parsing, rendering and tokenizing a long
    conversation share the host with it (``Engine.expect_request``; engines without it are left alone)."""
    expect = getattr(request.app.state.engine, "expect_request", None)
    if expect is not None:
        expect()


def request_tenant(request: Request, cache_salt: str | None = None) -> str | None:
    """Whose KV (and kept replies) a request may reuse: the authenticated key's tenant, narrowed by the
    request's own cache_salt (within its tenant, never across). None: the one tenant of a keyless server."""
    tenant = getattr(request.state, "tenant", None)
    if cache_salt:
        tenant = f"{tenant or ''}\x00{cache_salt}"
    return tenant


def start_generation(
    request: Request, prompt_ids: Sequence[int], params: SamplingParams, request_id: str, started: float,
    cache_salt: str | None = None, user: str | None = None, n: int = 1, prompt_text: str | None = None,
    streamed: bool = False,
) -> list[EngineStream]:
    """Admit the request (503 when the engine's queue is full) and open its engine streams, one per
    choice: choice i samples with ``params.for_choice(i)`` (its own seed stream) and follows choice 0,
    whose prompt pages it shares through the prefix cache.

    The streams are measured for /metrics from ``started``, the ``time.monotonic()`` at
    which the request reached the handler (the request's latencies from choice 0). Nothing
    reaches the engine until a stream is first advanced. With ``prompt_text`` (a rendered chat
    prompt) each finished choice's reply is kept in the app's ``ReplyMemory``, if it has one.

    ``streamed``: a streamed response, which starts (its headers, a chat stream's role) once the engine has
    the request's first step on the device, beside the prefill, where the engine can say so (the empty
    output of ``Engine.submit``'s ``announce``); otherwise with the first token.
    """
    state = request.app.state
    state.admission.check()
    # the tenant salts the KV cache: tenants never reuse each other's pages
    tenant = request_tenant(request, cache_salt)
    # a conversation that names itself (x-session-id, or OpenAI's `user`) keeps its KV longest
    session = request.headers.get("x-session-id") or user
    replies = getattr(state, "replies", None) if prompt_text is not None else None
    announce = {"announce": True} if streamed and getattr(state.engine, "announces", False) else {}
    streams = []
    for i in range(n):
        choice_id = request_id if n == 1 else f"{request_id}-{i}"
        follow = None if i == 0 else f"{request_id}-0"
        stream = state.engine.generate(prompt_ids, params.for_choice(i), choice_id, tenant=tenant, session=session,
                                       follow=follow, **announce)
        if replies is not None:
            stream = _keeping_reply(stream, replies, state.engine.tokenizer, tenant or "", prompt_text, prompt_ids)
        streams.append(state.metrics.track(stream, started, primary=i == 0))
    return streams


async def _keeping_reply(stream: EngineStream, replies: ReplyMemory, tokenizer: Any, tenant: str, prompt_text: str,
                         prompt_ids: Sequence[int]) -> EngineStream:
    """``stream`` passed through; a reply that finishes (not aborted) is kept with its prompt: its text with
    the ids that decode to exactly that text."""
    parts: list[str] = []
    ids: list[int] = []
    async with aclosing(stream):
        async for out in stream:
            parts.append(out.text)
            ids.extend(out.token_ids)
            if out.finish_reason in ("stop", "length") and ids:
                text = "".join(parts)
                kept = _ids_of_text(tokenizer, ids, text)
                if kept:
                    # (a chat prompt's uint32 array: copied as bytes, the reply's ids appended)
                    full = prompt_ids[:] if isinstance(prompt_ids, array) else list(prompt_ids)
                    full.extend(kept)
                    replies.remember(tenant, prompt_text + text, full)
            yield out


def _ids_of_text(tokenizer: Any, ids: list[int], text: str, most_dropped: int = 4) -> list[int] | None:
    """The shortest head of ``ids`` (at most a few ids short) that decodes to exactly ``text``: without a
    trailing EOS (counted among the ids, but it writes no text, and the template writes its own end of
    turn after the reply), or the bytes of a character cut off by the reply's end, which the text leaves
    out, or the tokens of a stop string. None when no head does (a stop string that began inside a token)."""
    for k in range(max(0, len(ids) - most_dropped), len(ids) + 1):
        # as the engine's detokenizer writes replies: special tokens (a stray BOS) leave no text
        if tokenizer.decode(ids[:k], skip_special_tokens=True) == text:
            return ids[:k]
    return None


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """The request's usage from each choice's last output: the prompt once, every choice's tokens."""
    prompt = outs[0].prompt_tokens
    completion = sum(out.completion_tokens for out in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].cached_tokens},
    }


def log_request(request_id: str, prompt_tokens: int, params: SamplingParams, stream: bool) -> None:
    log.debug("%s: %d prompt tokens, max_tokens=%d, stream=%s", request_id, prompt_tokens, params.max_tokens, stream)


async def sse_completion_events(
    *,
    head: dict[str, Any],
    firsts: list[RequestOutput],
    streams: list[EngineStream],
    include_usage: bool,
    delta_choice: Callable[[int, RequestOutput], dict[str, Any] | None],
    finish_choice: Callable[[int, str], list[dict[str, Any]]],
    opening_choice: Callable[[int], dict[str, Any]] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body shared by both endpoints: chunks, one finish chunk per choice, usage, [DONE].

    ``head`` holds id/object/created/model. ``delta_choice(i, out)`` is choice i's part of a
    chunk for an output (None: nothing to send); ``finish_choice(i, reason)`` its parts of the
    last chunks (the chat route sends held-back tool calls there), the last part carrying the
    finish_reason. Exactly one chunk per choice carries a finish_reason. With ``include_usage``
    every chunk has ``"usage": null`` and a last chunk with no choices carries the totals, as
    OpenAI does. An engine failure after the 200 has gone out can only be reported in-band: an
    error event, then [DONE].
    """
    extra = {"usage": None} if include_usage else {}

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse_event({**head, "choices": [choice], **extra})

    try:
        if opening_choice is not None:
            for i in range(len(streams)):
                yield chunk(opening_choice(i))
        last = list(firsts)
        sources = [outputs_until_finish(first, stream) for first, stream in zip(firsts, streams)]
        async with aclosing(merged(sources)) as outputs:
            async for i, out in outputs:
                choice = delta_choice(i, out)
                if choice is not None:
                    yield chunk(choice)
                last[i] = out
                if out.finish_reason is not None:
                    for choice in finish_choice(i, out.finish_reason):
                        yield chunk(choice)
        if include_usage:
            yield sse_event({**head, "choices": [], "usage": usage(last)})
    except Exception as exc:  # noqa: BLE001  (logged with its traceback under an error id)
        yield sse_event(log_internal_error(f"{head['id']}: engine failed mid-stream", exc).body())
    finally:
        # a choice's wrapper that never started cannot close its stream: close them all here
        with anyio.CancelScope(shield=True):
            for stream in streams:
                await close_quietly(stream)
    yield SSE_DONE
