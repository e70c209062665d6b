"""qml_server over a fake engine (tests/fake_engine.py), as a client's connection sees it.

Two harnesses: a hand-driven ASGI call where the test decides when the client disconnects,
and a real uvicorn server in a thread for the end-to-end checks (openai client over TCP, a
socket closed mid-stream and during prefill). The API's shapes and errors: test_server_api.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from starlette.testclient import TestClient

from qml_server import create_app
from tests.fake_engine import REPLY, FakeEngine
from tests.test_server_api import CHAT, HELLO, assert_still_serving, openai_client


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


# --- client disconnects stop generation -----------------------------------------------


def _asgi_call(app, body: dict, disconnect_after_body_messages: int | None, disconnect_after_s: float | None):
    """Call the app directly; the 'client' disconnects after N body messages or T seconds."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []

    async def run() -> None:
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            bodies = [m for m in sent if m["type"] == "http.response.body"]
            if disconnect_after_body_messages is not None and len(bodies) >= disconnect_after_body_messages:
                gone.set()

        if disconnect_after_s is not None:
            asyncio.get_running_loop().call_later(disconnect_after_s, gone.set)
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": CHAT,
            "raw_path": CHAT.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
        }
        await asyncio.wait_for(app(scope, receive, send), timeout=10)

    asyncio.run(run())
    return sent


def test_disconnect_mid_stream_aborts_the_engine_request():
    fake = FakeEngine(token_delay=0.01)
    sent = _asgi_call(create_app(fake), {"messages": HELLO, "stream": True}, 3, None)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) < len(REPLY)  # stopped early
    assert len(fake.aborted) == 1 and fake.finished == []


def test_disconnect_during_prefill_aborts_streamed_request():
    fake = FakeEngine(first_token_delay=30)
    sent = _asgi_call(create_app(fake), {"messages": HELLO, "stream": True}, None, 0.05)
    assert len(fake.aborted) == 1 and fake.finished == []
    assert sent[0]["status"] == 499  # nobody reads it; it only tells the access log


def test_disconnect_aborts_non_streamed_request():
    fake = FakeEngine(token_delay=0.01)
    _asgi_call(create_app(fake), {"messages": HELLO}, None, 0.05)
    assert len(fake.aborted) == 1 and fake.finished == []


def test_test_client_hanging_up_closes_the_engine_stream(fake):
    fake.token_delay = 0.01
    with TestClient(create_app(fake)) as c:
        with c.stream("POST", CHAT, json={"messages": HELLO, "stream": True}) as r:
            next(r.iter_lines())
        assert fake.aborted == [fake.calls[0].request_id]
        assert_still_serving(c)


# --- a real uvicorn server ------------------------------------------------------------


@contextlib.contextmanager
def serve_in_thread(app, lifespan: str = "on"):
    """Run uvicorn in a thread on a free port; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert _wait_until(lambda: server.started, timeout=10), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def live_server():
    fake = FakeEngine(token_delay=0.005)
    with serve_in_thread(create_app(fake)) as base:
        yield base, fake


def _wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_live_server_with_openai_client(live_server):
    base, fake = live_server
    with httpx.Client() as http:
        oa = openai_client(http, base_url=f"{base}/v1")
        whole = oa.chat.completions.create(model="fake-model", messages=HELLO)
        chunks = list(oa.chat.completions.create(model="fake-model", messages=HELLO, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content == REPLY
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
        assert [c.message.content for c in oa.chat.completions.create(model="fake-model", messages=HELLO,
                                                                       n=3).choices] == [REPLY] * 3
        with pytest.raises(openai.BadRequestError):
            oa.chat.completions.create(model="fake-model", messages=HELLO, n=17)
        assert oa.completions.create(model="fake-model", prompt="a", max_tokens=2).choices[0].text == REPLY[:2]
        assert fake.started == 1


def test_live_server_socket_closed_mid_stream(live_server):
    base, fake = live_server
    fake.token_delay = 0.05  # the full reply would take ~3 s
    with httpx.Client() as http, http.stream("POST", f"{base}{CHAT}", json={"messages": HELLO, "stream": True}) as r:
        assert next(r.iter_lines()).startswith("data: ")
    assert _wait_until(lambda: len(fake.aborted) == 1), "the engine request was not aborted"
    assert fake.finished == []


def test_live_server_socket_closed_during_prefill(live_server):
    base, fake = live_server
    fake.first_token_delay = 30
    with httpx.Client() as http, pytest.raises(httpx.ReadTimeout):
        http.post(f"{base}{CHAT}", json={"messages": HELLO, "stream": True}, timeout=0.3)
    assert _wait_until(lambda: len(fake.aborted) == 1), "a client gone during prefill must abort the request"


def test_real_engine_end_to_end(engine):
    """The embedded SmolLM2 behind a live server, through the official client (greedy).

    ``engine`` is the session fixture from conftest.py (skips when the model is not
    installed); lifespan is off because that fixture owns the engine's start/shutdown.
    """
    with serve_in_thread(create_app(engine), lifespan="off") as base, httpx.Client(timeout=60) as http:
        oa = openai_client(http, base_url=f"{base}/v1")
        ask = {
            "model": engine.model_id,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12,
            "temperature": 0,
        }
        whole = oa.chat.completions.create(**ask)
        chunks = list(oa.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content and text
        assert len([c for c in chunks if c.choices and c.choices[0].finish_reason]) == 1
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens > 0
        assert whole.usage.completion_tokens <= 12
        completion = oa.completions.create(
            model=engine.model_id, prompt="The capital of France is", max_tokens=4, temperature=0
        )
        assert completion.usage.completion_tokens <= 4 and completion.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError) as too_long:
            oa.chat.completions.create(**{**ask, "max_tokens": engine.context_length})
        assert too_long.value.code == "context_length_exceeded"
