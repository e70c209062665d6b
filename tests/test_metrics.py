"""GET /metrics (Prometheus text, parsed back with prometheus_client's parser) and the
bounded queue (503 + Retry-After), over the fake engine (tests/fake_engine.py)."""

from __future__ import annotations

import asyncio
import sys
import time
import types

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from qml_server import create_app
from qml_server.admission import DEFAULT_MAX_QUEUED_REQUESTS
from qml_server.cli import build_parser, main
from qml_server.lifecycle import GracefulServer
from tests.fake_engine import KV_BYTES_PER_TOKEN, REPLY, FakeEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]
MODEL = "fake-model"

Samples = dict[tuple[str, frozenset], float]


def scrape(client: TestClient) -> Samples:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    return parse(r)


def parse(response: httpx.Response) -> Samples:
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample; every qml sample carries the model_name label."""
    return samples[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def has_family(samples: Samples, name: str) -> bool:
    return any(key[0] == name for key in samples)


# --- what /metrics shows ----------------------------------------------------------------


def test_metrics_is_public_when_keys_are_set():
    with TestClient(create_app(FakeEngine(), api_keys=["sk-one"])) as c:
        assert c.get("/v1/models").status_code == 401
        samples = scrape(c)  # no Authorization header
    assert value(samples, "qml:time_to_first_token_seconds_count") == 0
    assert value(samples, "qml:num_requests_running") == 0


def test_latencies_and_token_counters_follow_the_requests():
    fake = FakeEngine()
    with TestClient(create_app(fake)) as c:
        before = scrape(c)
        assert value(before, "qml:request_success_total", finished_reason="stop") == 0
        requests = [
            (CHAT, {"messages": HELLO, "max_tokens": 5}),
            (CHAT, {"messages": HELLO, "max_tokens": 7, "stream": True}),
            (CHAT, {"messages": [{"role": "user", "content": "Bye"}]}),  # the whole reply: "stop"
            (COMPLETIONS, {"prompt": "Once upon", "max_tokens": 4}),
            (COMPLETIONS, {"prompt": "Once upon", "max_tokens": 3, "stream": True}),
        ]
        for path, body in requests:
            assert c.post(path, json=body).status_code == 200
        after = scrape(c)

    prompts = [len(call.prompt_ids) for call in fake.calls]
    generated = [5, 7, len(REPLY), 4, 3]
    n = len(requests)
    assert value(after, "qml:time_to_first_token_seconds_count") == n
    assert value(after, "qml:e2e_request_latency_seconds_count") == n
    assert value(after, "qml:request_queue_time_seconds_count") == n  # from the engine's observer
    # one observation per token after the first
    assert value(after, "qml:inter_token_latency_seconds_count") == sum(generated) - n
    assert value(after, "qml:inter_token_latency_seconds_bucket", le="+Inf") == sum(generated) - n
    for name in ("qml:time_to_first_token_seconds", "qml:e2e_request_latency_seconds"):
        assert value(after, f"{name}_sum") > 0
        assert value(after, f"{name}_bucket", le="+Inf") == n
    assert value(after, "qml:prompt_tokens_total") == sum(prompts)
    assert value(after, "qml:generation_tokens_total") == sum(generated)
    assert value(after, "qml:request_success_total", finished_reason="length") == 4
    assert value(after, "qml:request_success_total", finished_reason="stop") == 1
    assert value(after, "qml:requests_rejected_total") == 0
    # engine side, read from stats() at the scrape
    assert value(after, "qml:prefix_cache_queries_total") == sum(prompts) == fake.prefix_queries
    assert value(after, "qml:prefix_cache_hits_total") == fake.prefix_hits > 0  # the repeated prompts
    assert value(after, "qml:num_requests_running") == 0 and value(after, "qml:num_requests_waiting") == 0
    assert value(after, "qml:kv_cache_usage_perc") == 0
    assert value(after, "qml:kv_tier_bytes", tier="gpu") == prompts[-1] * KV_BYTES_PER_TOKEN


def test_a_client_gone_mid_stream_is_not_a_success():
    fake = FakeEngine(token_delay=0.01)
    with TestClient(create_app(fake)) as c:
        with c.stream("POST", CHAT, json={"messages": HELLO, "stream": True}) as r:
            next(r.iter_lines())
        assert fake.aborted
        samples = scrape(c)
    assert value(samples, "qml:time_to_first_token_seconds_count") == 1
    assert value(samples, "qml:e2e_request_latency_seconds_count") == 0
    assert sum(v for (name, _), v in samples.items() if name == "qml:request_success_total") == 0
    assert 1 <= value(samples, "qml:generation_tokens_total") < len(REPLY)


def test_each_app_has_its_own_registry():
    first, second = FakeEngine(), FakeEngine()
    with TestClient(create_app(first)) as a, TestClient(create_app(second)) as b:
        a.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
        assert value(scrape(a), "qml:request_success_total", finished_reason="length") == 1
        assert value(scrape(b), "qml:request_success_total", finished_reason="length") == 0


class EngineWithoutStats(FakeEngine):
    stats = None  # what an engine from before the stats() contract looks like
    set_queue_time_observer = None


def test_engine_without_stats_still_has_server_metrics_and_no_bound():
    fake = EngineWithoutStats()
    with TestClient(create_app(fake, max_queued_requests=1)) as c:
        assert c.post(CHAT, json={"messages": HELLO, "max_tokens": 2}).status_code == 200
        samples = scrape(c)
    assert value(samples, "qml:time_to_first_token_seconds_count") == 1
    assert value(samples, "qml:request_queue_time_seconds_count") == 0
    assert not has_family(samples, "qml:num_requests_waiting")
    assert not has_family(samples, "qml:kv_tier_bytes")


def test_a_failing_stats_does_not_fail_the_scrape(caplog):
    fake = FakeEngine()
    fake.stats = lambda: 1 / 0
    with TestClient(create_app(fake)) as c:
        samples = scrape(c)
    assert has_family(samples, "qml:time_to_first_token_seconds_count")
    assert not has_family(samples, "qml:num_requests_running")
    assert "engine.stats() failed" in caplog.text


# --- overload: the bounded queue ------------------------------------------------------------


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def assert_queue_full(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("server_error", "queue_full", None)
    assert "overloaded" in error["message"]


def test_full_queue_is_503_with_retry_after_then_serves_again():
    # One request runs and is held before its first token; two wait; that is the bound.
    fake = FakeEngine(max_running=1, hold=True)
    app = create_app(fake, max_queued_requests=2)
    ask = {"messages": HELLO, "max_tokens": 3}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://qml") as c:
            admitted = [asyncio.create_task(c.post(CHAT, json=ask)) for _ in range(3)]
            await _until(lambda: (len(fake.running), len(fake.waiting)) == (1, 2))

            assert_queue_full(await c.post(CHAT, json=ask))
            assert_queue_full(await c.post(CHAT, json={**ask, "stream": True}))  # a status, not an SSE error
            assert_queue_full(await c.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 3}))
            oa = openai.AsyncOpenAI(base_url="http://qml/v1", api_key="unused", http_client=c, max_retries=0)
            with pytest.raises(openai.InternalServerError) as refused:
                await oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
            assert refused.value.status_code == 503 and refused.value.code == "queue_full"
            assert len(fake.calls) == 3  # the refused ones never reached the engine
            assert (await c.get("/health")).status_code == 200  # the server keeps serving

            during = parse(await c.get("/metrics"))
            assert value(during, "qml:requests_rejected_total") == 4
            assert value(during, "qml:num_requests_running") == 1
            assert value(during, "qml:num_requests_waiting") == 2
            assert 0 < value(during, "qml:kv_cache_usage_perc") <= 1

            fake.release()
            for response in await asyncio.gather(*admitted):
                assert response.status_code == 200
                assert response.json()["choices"][0]["message"]["content"] == REPLY[:3]
            # drained: admitted again
            r = await c.post(CHAT, json=ask)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:3]

            after = parse(await c.get("/metrics"))
            assert value(after, "qml:requests_rejected_total") == 4
            assert value(after, "qml:num_requests_waiting") == 0
            assert value(after, "qml:request_success_total", finished_reason="length") == 4
            assert value(after, "qml:request_queue_time_seconds_count") == 4

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_unbounded_queue_never_refuses():
    fake = FakeEngine(max_running=1, hold=True)
    app = create_app(fake, max_queued_requests=None)

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://qml") as c:
            tasks = [asyncio.create_task(c.post(CHAT, json={"messages": HELLO, "max_tokens": 2})) for _ in range(5)]
            await _until(lambda: len(fake.waiting) == 4)
            fake.release()
            assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 5

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


def test_max_queued_requests_must_be_positive():
    with pytest.raises(ValueError):
        create_app(FakeEngine(), max_queued_requests=0)


# --- the flag -------------------------------------------------------------------------------


def test_cli_max_queued_requests_flag_env_twin_and_app(monkeypatch):
    assert build_parser(env={}).parse_args(["serve"]).max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS
    env = {"QML_MAX_QUEUED_REQUESTS": "8"}
    assert build_parser(env=env).parse_args(["serve"]).max_queued_requests == 8
    assert build_parser(env=env).parse_args(["serve", "--max-queued-requests", "3"]).max_queued_requests == 3
    with pytest.raises(SystemExit):
        build_parser(env={}).parse_args(["serve", "--max-queued-requests", "0"])

    loader = types.ModuleType("qml_runtime.loader")
    loader.ModelNotFound = FileNotFoundError
    loader.load_engine = lambda *a, **kw: FakeEngine()
    monkeypatch.setitem(sys.modules, "qml_runtime.loader", loader)
    ran = {}
    monkeypatch.setattr(GracefulServer, "run", lambda server: ran.update(app=server.config.app))
    assert main(["serve", "--max-queued-requests", "5"], env={}) == 0
    assert ran["app"].state.admission.max_queued == 5


# --- the real engine's side of the contract ---------------------------------------------------

STATS_KEYS = {"num_requests_running", "num_requests_waiting", "kv_cache_usage", "prefix_cache_queries",
              "prefix_cache_hits", "kv_tier_bytes"}


def test_real_engine_stats_contract(request):
    from qml_runtime.engine import Engine

    if not callable(getattr(Engine, "stats", None)):
        pytest.skip("qml_runtime.engine.Engine has no stats() yet")
    engine = request.getfixturevalue("engine")  # conftest.py's embedded SmolLM2 on CPU, loaded only now
    stats = engine.stats()
    assert STATS_KEYS <= set(stats)
    assert all(isinstance(stats[k], int) and stats[k] >= 0 for k in STATS_KEYS - {"kv_cache_usage", "kv_tier_bytes"})
    assert 0.0 <= stats["kv_cache_usage"] <= 1.0
    assert "gpu" in stats["kv_tier_bytes"] and set(stats["kv_tier_bytes"]) <= {"gpu", "host", "disk"}

    c = TestClient(create_app(engine))  # no lifespan: the fixture owns the engine's start/shutdown
    ask = {"messages": HELLO, "max_tokens": 3, "temperature": 0}
    assert c.post(CHAT, json=ask).status_code == 200
    r = c.get("/metrics")
    model = engine.model_id
    samples = {(s.name, s.labels.get("model_name")): s.value
               for family in text_string_to_metric_families(r.text) for s in family.samples}
    assert samples[("qml:time_to_first_token_seconds_count", model)] == 1
    assert samples[("qml:prefix_cache_queries_total", model)] >= samples[("qml:prompt_tokens_total", model)] > 0
    assert samples[("qml:num_requests_running", model)] == 0
    if callable(getattr(engine, "set_queue_time_observer", None)):
        assert samples[("qml:request_queue_time_seconds_count", model)] == 1
