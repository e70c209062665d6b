"""End to end: `qml serve` as a real process on the embedded model, driven by the official openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """`qml serve` on the embedded model as a real process; returns it and its base URL once healthy."""
    port = free_port()
    env = {**os.environ, "QML_LOG_LEVEL": "warning"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "qml_server", "serve", "--port", str(port), "--device", "cpu",
         "--max-model-len", "2048", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"qml serve exited early:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)  # not listening, or 503 while the engine starts
    proc.kill()
    pytest.fail("qml serve did not become healthy in 180 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # SIGTERM: uvicorn runs the shutdown, the engine flushes its KV writes
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(smollm_path):
    proc, base = start_server()
    yield base
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_capital_of_france(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=CAPITAL, max_tokens=32, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_stream_equals_non_stream(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Describe the water cycle."}],
              max_tokens=48, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # seeded sampling is as reproducible as greedy, streamed or not
    seeded = dict(kw, temperature=0.8, seed=7)
    a = client.chat.completions.create(**seeded).choices[0].message.content
    b = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**seeded, stream=True)
                if c.choices)
    assert a == b


def test_usage_counts(client, model_id, engine):
    r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell me a story."}],
                                       max_tokens=5, temperature=0)
    prompt = len(engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}]))
    assert r.usage.prompt_tokens == prompt
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == prompt + 5
    # the same request again finds its prompt's full pages in the prefix cache (all but the last token)
    again = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Tell me a story."}],
                                           max_tokens=5, temperature=0)
    block = 16
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // block * block
    assert again.choices[0].message.content == r.choices[0].message.content


def test_completions_endpoint(client, model_id, engine):
    r = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("The capital of France is"))


def normal_request_works(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=CAPITAL, max_tokens=8, temperature=0)
    assert r.choices[0].message.content


@pytest.mark.parametrize("case", ["bad_json", "missing_messages", "bad_temperature", "unknown_model", "overflow"])
def test_errors_then_still_serving(server, client, model_id, case):
    url = f"{server}/v1/chat/completions"
    body = {"model": model_id, "messages": CAPITAL}
    if case == "bad_json":
        r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
        status, code = 400, None
    elif case == "missing_messages":
        r = httpx.post(url, json={"model": model_id})
        status, code = 400, None
    elif case == "bad_temperature":
        r = httpx.post(url, json=body | {"temperature": 9})
        status, code = 400, None
    elif case == "unknown_model":
        r = httpx.post(url, json=body | {"model": "no-such-model"})
        status, code = 404, "model_not_found"
    else:
        r = httpx.post(url, json=body | {"messages": [{"role": "user", "content": "word " * 2100}]})
        status, code = 400, "context_length_exceeded"
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if code:
        assert err["code"] == code
    normal_request_works(client, model_id)


def test_openai_client_raises_typed_errors(client, model_id):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CAPITAL)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=CAPITAL, max_tokens=4096)
    assert err.value.code == "context_length_exceeded"
    normal_request_works(client, model_id)


def test_cache_salt_keeps_requests_apart(client, model_id):
    kw = dict(model=model_id, messages=[{"role": "user", "content": "Summarise the plot of Hamlet."}],
              max_tokens=2, temperature=0)
    client.chat.completions.create(**kw, extra_body={"cache_salt": "a"})
    same = client.chat.completions.create(**kw, extra_body={"cache_salt": "a"})
    other = client.chat.completions.create(**kw, extra_body={"cache_salt": "b"})
    assert same.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # not even the template's header


def test_a_conversation_continues_after_a_server_restart(smollm_path, tmp_path):
    """Turn 2, sent to a restarted server, prefills only its new tokens: the history comes from disk."""
    first = [{"role": "user", "content": "Name three colours."}]
    proc, base = start_server("--kv-disk-dir", str(tmp_path))
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = c.models.list().data[0].id
        answer = c.chat.completions.create(model=model, messages=first, max_tokens=32, temperature=0)
    finally:
        stop_server(proc)
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "And three animals?"}]
    proc, base = start_server("--kv-disk-dir", str(tmp_path))
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=model, messages=second, max_tokens=8, temperature=0)
        cached = r.usage.prompt_tokens_details.cached_tokens
        # the first prompt's and the reply's pages (less the EOS and the last token's unwritten KV): the
        # reply's generated ids came back from the store's kept replies, and its KV from the disk tier
        assert cached >= (answer.usage.prompt_tokens + answer.usage.completion_tokens - 2) // 16 * 16
        metrics = httpx.get(f"{base}/metrics").text
        assert 'qml:kv_restored_blocks_total{model_name=' in metrics and 'tier="disk"' in metrics
    finally:
        stop_server(proc)


def test_kill_9_during_kv_writes_then_the_next_turn_is_served_correctly(smollm_path, tmp_path, engine):
    first = [{"role": "user", "content": "Write a long list of fruits."}]
    proc, base = start_server("--kv-disk-dir", str(tmp_path))
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = c.models.list().data[0].id
        answer = c.chat.completions.create(model=model, messages=first, max_tokens=200, temperature=0)
        # more finished requests queue more writes; kill while they are in flight
        for i in range(3):
            c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {20 + i}."}],
                                      max_tokens=64, temperature=0)
    finally:
        proc.kill()  # SIGKILL: no shutdown, no flush
        proc.wait(timeout=30)
    killed = proc.pid
    second = first + [{"role": "assistant", "content": answer.choices[0].message.content},
                      {"role": "user", "content": "Which of them is the sweetest?"}]
    ids = engine.tokenizer.apply_chat_template(second)
    from qml_runtime.sampling_params import SamplingParams

    engine.scheduler.prefix_caching = False
    try:
        expected = engine.generate_sync(ids, SamplingParams(max_tokens=16, temperature=0)).text
    finally:
        engine.scheduler.prefix_caching = True
    proc, base = start_server("--kv-disk-dir", str(tmp_path))
    try:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model=model, messages=second, max_tokens=16, temperature=0)
        assert r.choices[0].message.content == expected
        # temp files are named .<hash>.<pid>-<n>.tmp: the restart removed any the killed server left
        assert not [p for p in tmp_path.rglob("*.tmp") if f".{killed}-" in p.name]
    finally:
        stop_server(proc)
