"""The Starlette application around one engine."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Route

from qml_runtime.kv.disk_store import REPLIES_DIR_NAME
from qml_server.admission import DEFAULT_MAX_QUEUED_REQUESTS, Admission
from qml_server.auth import ApiKeyMiddleware
from qml_server.errors import ApiError, handle_api_error, handle_http_exception, handle_unexpected
from qml_server.lifecycle import Lifecycle, LifecycleMiddleware, health
from qml_server.limits import DEFAULT_MAX_BODY_BYTES, BodySizeLimitMiddleware
from qml_server.metrics import ServerMetrics, metrics_endpoint
from qml_server.openapi import openapi_endpoint
from qml_server.replies import ReplyMemory
from qml_server.replies_store import ReplyStore
from qml_server.routes_chat import chat_completions
from qml_server.routes_completions import completions
from qml_server.routes_models import list_models, retrieve_model
from qml_server.routes_tokens import detokenize, tokenize

log = logging.getLogger("qml.server")


def create_app(
    engine: Any,
    api_keys: Iterable[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS,
    start_in_background: bool = False,
    keep_replies: bool = True,
) -> Starlette:
    """Build the OpenAI-compatible app serving ``engine``.

    ``engine`` is duck-typed (qml_runtime.engine.Engine or a test fake): model_id,
    context_length, tokenizer, generate(), info(), start(), shutdown(); optionally
    stats() and set_queue_time_observer() (qml_server.metrics), without which /metrics
    lacks the engine's gauges and ``max_queued_requests`` is not enforced. The engine
    is started and shut down by the app's lifespan; with ``start_in_background`` the
    lifespan returns at once and the server reports ``loading`` (503 on /health and every
    API route) until ``engine.start()``, run on a worker thread, has returned, which lets
    `qml serve` answer probes while it captures CUDA graphs. With ``api_keys`` non-empty,
    /v1/*, /tokenize and /detokenize require one of them as a bearer token.
    ``max_queued_requests`` bounds the requests waiting in the engine (None: unbounded);
    past it, 503 + Retry-After. ``keep_replies``: a chat reply's generated ids are kept and reused when
    the client sends the reply back as history (``qml_server.replies``). ``app.state.lifecycle``
    (qml_server.lifecycle) is what /health reports and what a graceful shutdown drains.
    """
    keys = tuple(k for k in api_keys if k)
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")

    engine_stats = getattr(engine, "stats", None)
    if not callable(engine_stats):
        engine_stats = None
        log.info("the engine has no stats(): /metrics has no engine gauges and the queue is unbounded")
    metrics = ServerMetrics(engine.model_id, engine_stats)
    admission = Admission(engine_stats, max_queued_requests, metrics)
    set_observer = getattr(engine, "set_queue_time_observer", None)
    if callable(set_observer):
        # one observer per engine: the last app built over it gets the queue times
        set_observer(metrics.observe_queue_time)

    lifecycle = Lifecycle()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", retrieve_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    # Listed outermost first: a server that is not ready refuses before anything else,
    # and a bad key is refused before any body is read.
    middleware = [
        Middleware(LifecycleMiddleware, lifecycle=lifecycle),
        Middleware(ApiKeyMiddleware, keys=keys),
        Middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes),
    ]
    exception_handlers = {
        ApiError: handle_api_error,
        HTTPException: handle_http_exception,
        Exception: handle_unexpected,
    }

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        starting = None
        if start_in_background:
            lifecycle.loading()
            starting = asyncio.ensure_future(_start_in_background(engine, lifecycle))
        else:
            await _maybe_await(engine.start())
            log.info("engine started: %s", _describe(engine))
        grammars = getattr(engine, "grammars", None)
        if grammars is not None:  # the structured-output tokenizer view, off the event loop
            threading.Thread(target=grammars.prepare, name="qml-grammars", daemon=True).start()
        try:
            yield
        finally:
            lifecycle.begin_drain()
            if starting is not None:
                with anyio.CancelScope(shield=True):  # a thread cannot be cancelled: let start() end
                    await starting
            log.info("shutting down the engine")
            await _maybe_await(engine.shutdown())
            replies = app.state.replies
            if replies is not None and replies.store is not None:  # the last kept replies reach the disk
                await anyio.to_thread.run_sync(replies.store.flush)
            lifecycle.stop()

    app = Starlette(routes=routes, middleware=middleware, exception_handlers=exception_handlers, lifespan=lifespan)
    app.state.engine = engine
    app.state.started_at = int(time.time())
    app.state.auth_enabled = bool(keys)
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.lifecycle = lifecycle
    app.state.openapi = None  # built on the first GET /openapi.json
    app.state.replies = _reply_memory(engine) if keep_replies else None
    if app.state.replies is not None:
        metrics.watch_replies(app.state.replies)
    return app


def _reply_memory(engine: Any) -> ReplyMemory:
    """Kept replies, on disk beside the KV disk tier when the engine has one (they outlive a restart as
    the KV does), else in memory only."""
    disk = getattr(getattr(engine, "tiers", None), "disk", None)
    if disk is None:
        return ReplyMemory()
    return ReplyMemory(store=ReplyStore(disk.dir / REPLIES_DIR_NAME))


async def _start_in_background(engine: Any, lifecycle: Lifecycle) -> None:
    try:
        await _maybe_await(await anyio.to_thread.run_sync(engine.start))
    except Exception:
        log.exception("the engine failed to start; the server will exit")
        lifecycle.fail()
        return
    log.info("engine started: %s", _describe(engine))
    lifecycle.ready()


async def _maybe_await(result: Any) -> None:
    # start()/shutdown() may be plain or async; the server does not need to care which.
    if inspect.isawaitable(result):
        await result


def _describe(engine: Any) -> str:
    info = engine.info() if hasattr(engine, "info") else {}
    device = info.get("device", "?") if isinstance(info, dict) else "?"
    return f"model={engine.model_id} device={device} context_length={engine.context_length}"
