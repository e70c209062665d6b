"""A streamed response starts once the request's first step runs (``Engine.submit``'s ``announce``), not once
its first token is back: the engine's empty first output, and what the server makes of it."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from qml_runtime.presets import load_preset_engine
from qml_runtime.sampling_params import SamplingParams
from qml_server.app import create_app


@pytest.fixture(scope="module")
def engine():
    return load_preset_engine("preset:tiny-llama", True, device="cpu", kv_cache_gib=0.02)


def outputs(engine, announce: bool) -> list:
    async def run():
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return [out async for out in engine.generate(list(range(40, 60)), params, announce=announce)]

    engine.start()
    return asyncio.run(run())


def test_the_engine_announces_a_request_with_one_empty_output_before_its_tokens(engine):
    plain, announced = outputs(engine, False), outputs(engine, True)
    assert all(o.token_ids for o in plain)
    first, rest = announced[0], announced[1:]
    assert first.token_ids == [] and first.text == "" and first.finish_reason is None
    assert first.prompt_tokens == 20 and first.completion_tokens == 0
    assert [o.token_ids for o in rest] == [o.token_ids for o in plain]  # the same greedy tokens after it
    assert rest[-1].finished and rest[-1].completion_tokens == 4
    assert all(o.token_ids for o in rest)  # announced once: no other empty output


def test_a_step_that_fails_after_the_response_started_ends_the_stream_with_an_error_event(engine):
    app = create_app(engine)
    body = {"model": engine.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    real = engine.runner.step

    def failing(batch, eager=False, while_running=None):
        if while_running is not None:
            while_running()  # the step is "queued": the request is announced, then the step fails
        raise RuntimeError("the device fell over")

    with TestClient(app) as client:
        engine.runner.step = failing
        try:
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            # the role's chunk went out with the headers; then the failure, in-band, and the end
            assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert "error" in json.loads(events[1]) and events[-1] == "[DONE]"
            r = client.post("/v1/chat/completions", json=body)  # not streamed: an error status as before
            assert r.status_code == 500 and "error" in r.json()
        finally:
            engine.runner.step = real
        r = client.post("/v1/chat/completions", json={**body, "stream": False})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
