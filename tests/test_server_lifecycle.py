"""The server's life: /health while loading, ready and draining; a graceful exit on SIGTERM.

In-process over the fake engine (tests/fake_engine.py): the app's states through
TestClient, and qml_server.lifecycle.GracefulServer (uvicorn) in a thread, signalled by
calling its handler (signals reach only the main thread). Then the real thing: `qml
serve` on the embedded model as a process, sent SIGTERM in the middle of a stream.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.testclient import TestClient

from qml_server import create_app
from qml_server.cli import build_parser
from qml_server.lifecycle import GracefulServer
from tests.fake_engine import REPLY, FakeEngine
from tests.test_server_api import assert_still_serving, sse_payloads

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hi"}]


class GatedStartEngine(FakeEngine):
    """A fake whose start() waits for ``go`` (standing for CUDA graph capture), then may fail."""

    def __init__(self, start_error: Exception | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.go = threading.Event()
        self.start_error = start_error

    def start(self) -> None:
        assert self.go.wait(timeout=30), "the test never let the engine start"
        if self.start_error is not None:
            raise self.start_error
        super().start()


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def assert_503(r: httpx.Response, code: str) -> None:
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["type"] == "server_error"
    assert int(r.headers["retry-after"]) > 0


# --- the states, in-process -----------------------------------------------------------


def test_loading_then_ready():
    engine = GatedStartEngine()
    app = create_app(engine, start_in_background=True)
    with TestClient(app) as c:
        # the lifespan has returned, the engine is still starting
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"} and int(r.headers["retry-after"]) > 0
        assert_503(c.post(CHAT, json={"messages": HELLO}), "model_loading")
        assert_503(c.post("/tokenize", json={"prompt": "Hi"}), "model_loading")
        assert_503(c.get("/v1/models"), "model_loading")
        assert c.get("/metrics").status_code == 200 and c.get("/openapi.json").status_code == 200
        assert engine.calls == []

        engine.go.set()
        assert wait_until(lambda: c.get("/health").status_code == 200), "never became ready"
        assert c.get("/health").json() == {"status": "ready"} and engine.started == 1
        assert_still_serving(c)
    assert engine.stopped == 1 and app.state.lifecycle.state == "stopped"


def test_engine_that_fails_to_start():
    engine = GatedStartEngine(start_error=RuntimeError("no GPU memory left"))
    app = create_app(engine, start_in_background=True)
    with TestClient(app) as c:
        engine.go.set()
        assert wait_until(lambda: app.state.lifecycle.state == "failed")
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "failed"}
        assert_503(c.post(CHAT, json={"messages": HELLO}), "engine_unavailable")
        assert "GPU" not in r.text
    assert app.state.lifecycle.state == "failed"  # not "stopped": the exit status depends on it


def test_draining_refuses_new_requests_but_not_probes():
    fake = FakeEngine()
    app = create_app(fake)
    with TestClient(app) as c:
        assert app.state.lifecycle.begin_drain()
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        refused = c.post(CHAT, json={"messages": HELLO})
        assert_503(refused, "server_shutting_down")
        assert refused.headers["connection"] == "close"
        assert c.get("/metrics").status_code == 200
        assert fake.calls == []
        assert not app.state.lifecycle.begin_drain()  # once


# --- GracefulServer: uvicorn with a drain -----------------------------------------------


@contextlib.contextmanager
def graceful_server(app, shutdown_timeout_s: float):
    """GracefulServer over ``app`` on a free port, in a thread; yields (server, thread, base URL)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    server = GracefulServer(config, app.state.lifecycle, shutdown_timeout_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started), "uvicorn did not start"
        yield server, thread, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_sigterm_drains_in_flight_stream_then_exits():
    fake = FakeEngine(token_delay=0.02)  # the whole reply takes about a second
    app = create_app(fake)
    with graceful_server(app, shutdown_timeout_s=30) as (server, thread, base), httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base}{CHAT}", json={"messages": HELLO, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")

            server.handle_exit(signal.SIGTERM, None)
            with httpx.Client(timeout=10) as other:  # a new connection: the socket is still open
                assert_503(other.post(f"{base}{CHAT}", json={"messages": HELLO}), "server_shutting_down")
                health = other.get(f"{base}/health")
                assert health.status_code == 503 and health.json() == {"status": "draining"}
            assert not server.should_exit  # still draining: one request in flight

            events = sse_payloads("\n".join([first, *lines]) + "\n")
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == REPLY and events[-2]["choices"][0]["finish_reason"] == "stop"

        thread.join(timeout=15)
        assert not thread.is_alive(), "the server did not exit after the drain"
    assert fake.finished == [events[0]["id"]] and fake.aborted == []
    assert fake.stopped == 1 and app.state.lifecycle.state == "stopped"
    assert not server._captured_signals  # nothing for uvicorn to re-raise: the process exits 0


def test_shutdown_timeout_cancels_what_is_still_running():
    fake = FakeEngine(first_token_delay=60)  # a prefill that will not end by itself
    app = create_app(fake)
    outcome: dict = {}

    def client(base: str) -> None:
        try:
            outcome["response"] = httpx.post(f"{base}{CHAT}", json={"messages": HELLO}, timeout=30)
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    with graceful_server(app, shutdown_timeout_s=0.2) as (server, thread, base):
        caller = threading.Thread(target=client, args=(base,))
        caller.start()
        assert wait_until(lambda: len(fake.calls) == 1)
        server.handle_exit(signal.SIGTERM, None)
        thread.join(timeout=15)
        assert not thread.is_alive(), "the server did not exit after the shutdown timeout"
        caller.join(timeout=15)
    assert fake.aborted == [fake.calls[0].request_id] and fake.finished == []
    assert "error" in outcome or outcome["response"].status_code >= 500  # cut off, never a made-up answer
    assert fake.stopped == 1


def test_second_signal_skips_the_drain():
    fake = FakeEngine(first_token_delay=60)
    app = create_app(fake)
    with graceful_server(app, shutdown_timeout_s=300) as (server, thread, base):
        caller = threading.Thread(target=lambda: _post_quietly(f"{base}{CHAT}"), daemon=True)
        caller.start()
        assert wait_until(lambda: len(fake.calls) == 1)
        server.handle_exit(signal.SIGTERM, None)
        assert app.state.lifecycle.state == "draining" and not server.should_exit
        server.handle_exit(signal.SIGTERM, None)
        assert server.should_exit
        thread.join(timeout=15)
        assert not thread.is_alive()
    assert fake.aborted == [fake.calls[0].request_id]


def _post_quietly(url: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(url, json={"messages": HELLO}, timeout=30)


def test_failed_start_ends_the_server():
    engine = GatedStartEngine(start_error=RuntimeError("no GPU memory left"))
    engine.go.set()
    app = create_app(engine, start_in_background=True)
    with graceful_server(app, shutdown_timeout_s=30) as (_, thread, _):
        thread.join(timeout=15)  # nobody signalled it: it ends by itself
        assert not thread.is_alive() and app.state.lifecycle.state == "failed"


def test_shutdown_timeout_flag_and_env_twin():
    assert build_parser(env={}).parse_args(["serve"]).shutdown_timeout == 30.0
    assert build_parser(env={"QML_SHUTDOWN_TIMEOUT": "5"}).parse_args(["serve"]).shutdown_timeout == 5.0
    args = build_parser(env={"QML_SHUTDOWN_TIMEOUT": "5"}).parse_args(["serve", "--shutdown-timeout", "0"])
    assert args.shutdown_timeout == 0.0
    with pytest.raises(SystemExit):
        build_parser(env={}).parse_args(["serve", "--shutdown-timeout", "-1"])


# --- `qml serve` as a process, on the embedded model ------------------------------------


def test_sigterm_on_a_real_server_mid_stream(smollm_path):
    from tests.test_server_e2e import start_server

    proc, base = start_server("--shutdown-timeout", "60")
    try:
        ask = {"messages": [{"role": "user", "content": "Count from one to one hundred."}], "max_tokens": 48,
               "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{base}{CHAT}", json=ask) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            try:
                late = httpx.post(f"{base}{CHAT}", json={"messages": HELLO, "max_tokens": 2}, timeout=10)
                assert_503(late, "server_shutting_down")
            except httpx.ConnectError:
                pass  # the stream already ended and the server is gone: refused is right too
            events = sse_payloads("\n".join([first, *lines]) + "\n")
        assert events[-1] == "[DONE]"
        finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
        assert finishes == ["length"]  # ignore_eos: it ran to max_tokens, not cut short
        assert sum(1 for e in events[:-1] if e["choices"][0]["delta"].get("content")) > 0
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    output = proc.stdout.read()
    assert "Traceback" not in output, output
