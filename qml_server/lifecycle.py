"""Where the server is in its life, what /health says about it, and a graceful exit.

States: ``loading`` (the engine is starting, e.g. capturing CUDA graphs) → ``ready`` →
``draining`` (SIGTERM received: requests in flight run to their end, new ones get 503
with Retry-After, so a load balancer moves them elsewhere) → ``stopped``. An engine that
fails to start leaves the server ``failed``, and the process exits with status 1.

/health answers 200 only when ready, 503 otherwise, with the state in the body; it,
/metrics and /openapi.json answer in every state. Every other route is refused with
503 + Retry-After unless the server is ready.

uvicorn's own SIGTERM handling closes the listening socket at once (a new request gets
a refused connection, not a 503), waits for the connections without a bound unless
told one, then re-raises the signal, so the process ends killed by SIGTERM rather than
with status 0. ``GracefulServer`` drains first, bounds the drain by the shutdown
timeout, and exits 0.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from qml_server.errors import ApiError, service_unavailable

log = logging.getLogger("qml.server")

LOADING, READY, DRAINING, STOPPED, FAILED = "loading", "ready", "draining", "stopped", "failed"

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
RETRY_AFTER_LOADING_S = 5
# Short: behind a load balancer the retry lands on another replica.
RETRY_AFTER_DRAINING_S = 2
# After the drain, how long uvicorn lets connections close before cancelling what is
# left (a request past the shutdown timeout: cancelling it aborts its engine request).
CANCEL_AFTER_DRAIN_S = 2.0

# Probes, scrapers and API tooling must reach a server in any state.
ALWAYS_OPEN = frozenset({"/health", "/metrics", "/openapi.json"})


class Lifecycle:
    """The server's state, and the count of requests in flight (for the drain).

    Starts ``ready``: an app whose lifespan does not start the engine is served by an
    engine its owner already started (tests, notebooks). The app's lifespan sets
    ``loading`` when it starts the engine in the background.
    """

    def __init__(self) -> None:
        self.state = READY
        self.in_flight = 0
        self.drain_started: float | None = None

    def loading(self) -> None:
        self.state = LOADING

    def ready(self) -> None:
        if self.state == LOADING:  # a drain begun while loading stays a drain
            self.state = READY

    def fail(self) -> None:
        self.state = FAILED

    def begin_drain(self) -> bool:
        """Refuse new requests from now on; False if the server was not serving or loading."""
        if self.state not in (LOADING, READY):
            return False
        self.state = DRAINING
        self.drain_started = time.monotonic()
        return True

    def drained(self, timeout_s: float) -> bool:
        """Draining, and either nothing is in flight or ``timeout_s`` has passed."""
        if self.state != DRAINING or self.drain_started is None:
            return False
        return self.in_flight == 0 or time.monotonic() - self.drain_started >= timeout_s

    def stop(self) -> None:
        if self.state != FAILED:
            self.state = STOPPED


def refusal(state: str) -> ApiError:
    if state == LOADING:
        return service_unavailable("The model is still loading; retry shortly.", "model_loading",
                                   RETRY_AFTER_LOADING_S)
    if state == FAILED:
        return service_unavailable("The engine failed to start; see the server log.", "engine_unavailable",
                                   RETRY_AFTER_DRAINING_S)
    err = service_unavailable("The server is shutting down; retry on another replica or after the restart.",
                              "server_shutting_down", RETRY_AFTER_DRAINING_S)
    err.headers["connection"] = "close"  # a keep-alive client should reconnect, likely elsewhere
    return err


class LifecycleMiddleware:
    """Refuses requests unless the server is ready, and counts those it lets through."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle):
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in ALWAYS_OPEN:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.state != READY:
            await refusal(self.lifecycle.state).response()(scope, receive, send)
            return
        # Counted until the response is fully sent: a stream is in flight until its [DONE].
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1


async def health(request: Request) -> Response:
    # Public and cheap: load balancers poll it.
    state = request.app.state.lifecycle.state
    if state == READY:
        return JSONResponse({"status": state})
    retry = RETRY_AFTER_LOADING_S if state == LOADING else RETRY_AFTER_DRAINING_S
    return JSONResponse({"status": state}, status_code=503, headers={"retry-after": str(retry)})


class GracefulServer(uvicorn.Server):
    """A uvicorn server whose first SIGTERM or SIGINT drains, and that exits with status 0.

    The drain ends when no request is in flight or after ``shutdown_timeout_s``; then
    uvicorn's usual shutdown runs (listening socket closed, connections closed, requests
    still running cancelled after ``CANCEL_AFTER_DRAIN_S``, lifespan shutdown, which
    stops the engine). A second signal skips the rest of the drain; a third (SIGINT, as
    in uvicorn) stops waiting for connections too.
    """

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, shutdown_timeout_s: float):
        if config.timeout_graceful_shutdown is None:
            config.timeout_graceful_shutdown = CANCEL_AFTER_DRAIN_S
        super().__init__(config)
        self.lifecycle = lifecycle
        self.shutdown_timeout_s = shutdown_timeout_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Deliberately not recorded in uvicorn's _captured_signals: it re-raises those after
        # its shutdown, which would end a cleanly drained process by the signal.
        name = signal.Signals(sig).name
        if self.lifecycle.begin_drain():
            log.info("%s: draining (%d requests in flight, up to %.0f s); new requests get 503",
                     name, self.lifecycle.in_flight, self.shutdown_timeout_s)
        elif not self.should_exit:
            log.info("%s again: shutting down without waiting for the drain", name)
            self.should_exit = True
        elif sig == signal.SIGINT:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit:
            if self.lifecycle.state == FAILED:
                self.should_exit = True
            elif self.lifecycle.drained(self.shutdown_timeout_s):
                if self.lifecycle.in_flight:
                    log.warning("shutdown timeout (%.0f s): cancelling %d requests still in flight",
                                self.shutdown_timeout_s, self.lifecycle.in_flight)
                else:
                    log.info("drained: no request in flight")
                self.should_exit = True
        return await super().on_tick(counter)


def serve(app: ASGIApp, lifecycle: Lifecycle, *, host: str, port: int, log_level: str,
          shutdown_timeout_s: float) -> int:
    """Run ``app`` under uvicorn until a signal drains it; the process's exit status."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
    GracefulServer(config, lifecycle, shutdown_timeout_s).run()
    return 1 if lifecycle.state == FAILED else 0
