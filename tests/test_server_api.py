"""qml_server's OpenAI-compatible API, over a fake engine (tests/fake_engine.py).

Starlette's TestClient in-process: raw HTTP and the official `openai` client through
it. Client disconnects and a real uvicorn server: tests/test_server_connections.py.
"""

from __future__ import annotations

import json
import logging
import re

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from qml_runtime.sampling_params import InvalidParameter
from qml_server import create_app
from qml_server.auth import ApiKeyMiddleware, tenant_id
from tests.fake_engine import BOS, REPLY, FakeEngine

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(fake):
    with TestClient(create_app(fake)) as c:
        yield c


def sse_payloads(body: str) -> list:
    """The data of each event; '[DONE]' stays a string, the rest is decoded JSON."""
    events = [e for e in body.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param
    return error


def assert_still_serving(client: TestClient) -> None:
    r = client.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:3]


# --- happy paths --------------------------------------------------------------------


def test_health_and_lifespan(fake):
    app = create_app(fake)
    with TestClient(app) as c:
        assert fake.started == 1
        r = c.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ready"}
    assert fake.stopped == 1 and app.state.lifecycle.state == "stopped"


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == ["fake-model"]
    card = body["data"][0]
    assert card["object"] == "model" and isinstance(card["created"], int) and card["max_model_len"] == 256
    assert card["info"]["architecture"] == "fake" and "model_path" not in card["info"]
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert_error(client.get("/v1/models/other"), 404, "model_not_found", "model")


def test_chat_non_streamed_shape(client, fake):
    r = client.post(CHAT, json={"model": "fake-model", "messages": HELLO})
    assert r.status_code == 200
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and len(body["id"]) > len("chatcmpl-")
    assert body["object"] == "chat.completion" and body["model"] == "fake-model"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": REPLY}, "logprobs": None, "finish_reason": "stop"}
    ]
    prompt_ids = fake.tokenizer.apply_chat_template(HELLO)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(REPLY),
        "total_tokens": len(prompt_ids) + len(REPLY),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    call = fake.calls[-1]
    assert call.prompt_ids == prompt_ids and call.request_id == body["id"]
    # No max_tokens: the whole remaining context is the budget.
    assert call.params.max_tokens == fake.context_length - len(prompt_ids)
    assert fake.finished == [body["id"]] and fake.aborted == []
    # Same conversation again: the (fake) prefix cache reports the shared prompt.
    again = client.post(CHAT, json={"messages": HELLO}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt_ids)


def test_chat_streamed_matches_non_streamed(client):
    whole = client.post(CHAT, json={"messages": HELLO, "max_tokens": 20}).json()
    r = client.post(
        CHAT, json={"messages": HELLO, "max_tokens": 20, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "fake-model" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"] == REPLY[:20]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["length"]
    # include_usage: every chunk says usage null, and a last chunk without choices has it.
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
    assert chunks[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_chat_stream_without_usage_has_no_usage_field(client):
    chunks = sse_payloads(client.post(CHAT, json={"messages": HELLO, "stream": True}).text)[:-1]
    assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}


def test_chat_request_fields_reach_the_engine(client, fake):
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "42", "tool_call_id": "t1"},
            {"role": "user", "content": "again", "name": "ann"},
        ],
        "max_tokens": 9,
        "max_completion_tokens": 4,  # the newer name wins
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.1,
        "seed": 7,
        "stop": "\n",
        "n": 1,
        "user": "u1",
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "logprobs": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    params = fake.calls[-1].params
    assert (
        params.max_tokens,
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.seed,
        params.stop,
    ) == (4, 0.5, 0.9, 0, 0.1, 7, ("\n",))
    rendered = fake.tokenizer.decode(fake.calls[-1].prompt_ids)
    assert "<user>one\ntwo\n" in rendered and "<assistant>\n" in rendered and "<tool>42\n" in rendered
    assert fake.tokenizer.last_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    "prompt",
    ["Say hi", ["Say hi"], [BOS, *b"Say hi"], [[BOS, *b"Say hi"]]],
    ids=["string", "one-string-list", "token-ids", "one-token-list"],
)
def test_completions(client, fake, prompt):
    r = client.post(COMPLETIONS, json={"model": "fake-model", "prompt": prompt, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": REPLY[:6], "logprobs": None, "finish_reason": "length"}]
    assert fake.calls[-1].prompt_ids == [BOS, *b"Say hi"]
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["total_tokens"] == 13


def test_completions_streamed(client):
    r = client.post(COMPLETIONS, json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    events = sse_payloads(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == REPLY
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]].count("stop") == 1
    assert chunks[-1]["usage"]["completion_tokens"] == len(REPLY)


# --- errors: status, OpenAI shape, string code, and the server keeps serving ----------

UNSUPPORTED, TYPE, VALUE, MISSING = (
    "unsupported_parameter",
    "invalid_type",
    "invalid_value",
    "missing_required_parameter",
)
IMAGE_PART = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]
TOOL = {"type": "function", "function": {"name": "f"}}
LATE_SYSTEM = [*HELLO, {"role": "system", "content": "late"}]

BAD_REQUESTS = [
    # (id, path, body, status, code, param)
    ("not-json", CHAT, b"{nope", 400, "invalid_json", None),
    ("nan", CHAT, b'{"messages": [], "temperature": NaN}', 400, "invalid_json", None),
    ("not-an-object", CHAT, [1, 2], 400, "invalid_json", None),
    ("deep-nesting", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json", None),
    ("no-messages", CHAT, {"model": "fake-model"}, 400, MISSING, "messages"),
    ("messages-not-list", CHAT, {"messages": "hi"}, 400, TYPE, "messages"),
    ("empty-messages", CHAT, {"messages": []}, 400, VALUE, "messages"),
    ("bad-role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, VALUE, "messages[0].role"),
    ("no-content", CHAT, {"messages": [{"role": "user"}]}, 400, MISSING, "messages[0].content"),
    ("image-part", CHAT, {"messages": IMAGE_PART}, 400, UNSUPPORTED, "messages[0].content[1].type"),
    ("temperature-type", CHAT, {"messages": HELLO, "temperature": "hot"}, 400, TYPE, "temperature"),
    ("temperature-range", CHAT, {"messages": HELLO, "temperature": 5}, 400, VALUE, "temperature"),
    ("max-tokens-bool", CHAT, {"messages": HELLO, "max_tokens": True}, 400, TYPE, "max_tokens"),
    ("max-tokens-zero", CHAT, {"messages": HELLO, "max_tokens": 0}, 400, VALUE, "max_tokens"),
    ("stop-type", CHAT, {"messages": HELLO, "stop": 3}, 400, TYPE, "stop"),
    ("n-zero", CHAT, {"messages": HELLO, "n": 0}, 400, VALUE, "n"),
    ("n-too-many", COMPLETIONS, {"prompt": "x", "n": 17}, 400, VALUE, "n"),
    ("n-bool", CHAT, {"messages": HELLO, "n": True}, 400, TYPE, "n"),
    ("presence-range", CHAT, {"messages": HELLO, "presence_penalty": 2.5}, 400, VALUE, "presence_penalty"),
    ("frequency-type", COMPLETIONS, {"prompt": "x", "frequency_penalty": "1"}, 400, TYPE, "frequency_penalty"),
    ("repetition-zero", CHAT, {"messages": HELLO, "repetition_penalty": 0}, 400, VALUE, "repetition_penalty"),
    ("logprobs-type", CHAT, {"messages": HELLO, "logprobs": 1}, 400, TYPE, "logprobs"),
    ("top-logprobs-alone", CHAT, {"messages": HELLO, "top_logprobs": 3}, 400, VALUE, "top_logprobs"),
    ("top-logprobs-range", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, VALUE,
     "top_logprobs"),
    ("logprobs-cmpl-range", COMPLETIONS, {"prompt": "x", "logprobs": 21}, 400, VALUE, "logprobs"),
    ("logprobs-cmpl-bool", COMPLETIONS, {"prompt": "x", "logprobs": True}, 400, TYPE, "logprobs"),
    ("logit-bias-type", CHAT, {"messages": HELLO, "logit_bias": [1]}, 400, TYPE, "logit_bias"),
    ("logit-bias-key", CHAT, {"messages": HELLO, "logit_bias": {"a": 1}}, 400, VALUE, "logit_bias"),
    ("logit-bias-range", COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, 400, VALUE, "logit_bias.5"),
    ("logit-bias-value-type", CHAT, {"messages": HELLO, "logit_bias": {"5": "x"}}, 400, TYPE, "logit_bias.5"),
    ("logit-bias-vocab", CHAT, {"messages": HELLO, "logit_bias": {"257": 1}}, 400, VALUE, "logit_bias"),
    ("min-tokens-negative", COMPLETIONS, {"prompt": "x", "min_tokens": -1}, 400, VALUE, "min_tokens"),
    ("min-tokens-over-max", CHAT, {"messages": HELLO, "max_tokens": 3, "min_tokens": 5}, 400, VALUE, "min_tokens"),
    ("functions", CHAT, {"messages": HELLO, "functions": [TOOL["function"]]}, 400, UNSUPPORTED, "functions"),
    ("tools-type", CHAT, {"messages": HELLO, "tools": TOOL}, 400, TYPE, "tools"),
    ("response-format-type", CHAT, {"messages": HELLO, "response_format": {"type": "xml"}}, 400, VALUE,
     "response_format.type"),
    ("stream-options-alone", CHAT, {"messages": HELLO, "stream_options": {}}, 400, VALUE, "stream_options"),
    ("template-refuses", CHAT, {"messages": LATE_SYSTEM}, 400, VALUE, "messages"),
    ("unknown-model", CHAT, {"model": "gpt-4o", "messages": HELLO}, 404, "model_not_found", "model"),
    ("context-max-tokens", CHAT, {"messages": HELLO, "max_tokens": 1000}, 400, "context_length_exceeded", "messages"),
    ("context-prompt", COMPLETIONS, {"prompt": "x" * 300}, 400, "context_length_exceeded", "prompt"),
    ("best-of", COMPLETIONS, {"prompt": "x", "best_of": 2}, 400, UNSUPPORTED, "best_of"),
    ("suffix", COMPLETIONS, {"prompt": "x", "suffix": "y"}, 400, UNSUPPORTED, "suffix"),
    ("echo", COMPLETIONS, {"prompt": "x", "echo": True}, 400, UNSUPPORTED, "echo"),
    ("two-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, UNSUPPORTED, "prompt"),
    ("prompt-type", COMPLETIONS, {"prompt": {"text": "a"}}, 400, TYPE, "prompt"),
    ("token-out-of-vocab", COMPLETIONS, {"prompt": [1, 99999]}, 400, VALUE, "prompt"),
    ("no-prompt", COMPLETIONS, {"max_tokens": 3}, 400, MISSING, "prompt"),
    ("lone-surrogate", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "invalid_json", None),
    ("template-kwargs-messages", CHAT, {"messages": HELLO, "chat_template_kwargs": {"messages": []}}, 400, VALUE,
     "chat_template_kwargs.messages"),
    ("seed-over-int64", CHAT, {"messages": HELLO, "seed": 2**64}, 400, VALUE, "seed"),
    ("top-k-over-int64", COMPLETIONS, {"prompt": "x", "top_k": 2**70}, 400, VALUE, "top_k"),
    ("stop-ids-over-int64", COMPLETIONS, {"prompt": "x", "stop_token_ids": [1, -(2**63) - 1]}, 400, VALUE,
     "stop_token_ids"),
    ("max-tokens-fraction", CHAT, {"messages": HELLO, "max_tokens": 2.5}, 400, TYPE, "max_tokens"),
    ("max-tokens-zero-overridden", CHAT, {"messages": HELLO, "max_tokens": 0, "max_completion_tokens": 5}, 400,
     VALUE, "max_tokens"),
    ("message-name-type", CHAT, {"messages": [{"role": "user", "content": "x", "name": 5}]}, 400, TYPE,
     "messages[0].name"),
    ("tool-calls-type", CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": {}}]}, 400, TYPE,
     "messages[0].tool_calls"),
    ("tok-neither", TOKENIZE, {"model": "fake-model"}, 400, MISSING, "prompt"),
    ("tok-both", TOKENIZE, {"prompt": "a", "messages": HELLO}, 400, VALUE, "prompt"),
    ("tok-prompt-type", TOKENIZE, {"prompt": [1, 2]}, 400, TYPE, "prompt"),
    ("tok-chat-only-field", TOKENIZE, {"prompt": "a", "add_generation_prompt": True}, 400, VALUE,
     "add_generation_prompt"),
    ("tok-special-with-messages", TOKENIZE, {"messages": HELLO, "add_special_tokens": False}, 400, VALUE,
     "add_special_tokens"),
    ("tok-bad-role", TOKENIZE, {"messages": [{"role": "robot", "content": "x"}]}, 400, VALUE, "messages[0].role"),
    ("tok-template-refuses", TOKENIZE, {"messages": LATE_SYSTEM}, 400, VALUE, "messages"),
    ("tok-unknown-model", TOKENIZE, {"model": "gpt-4o", "prompt": "a"}, 404, "model_not_found", "model"),
    ("detok-missing", DETOKENIZE, {}, 400, MISSING, "tokens"),
    ("detok-type", DETOKENIZE, {"tokens": "abc"}, 400, TYPE, "tokens"),
    ("detok-nested", DETOKENIZE, {"tokens": [[1]]}, 400, TYPE, "tokens"),
    ("detok-out-of-vocab", DETOKENIZE, {"tokens": [1, 257]}, 400, VALUE, "tokens"),
    ("detok-negative", DETOKENIZE, {"tokens": [-1]}, 400, VALUE, "tokens"),
    ("detok-unknown-model", DETOKENIZE, {"model": "gpt-4o", "tokens": [1]}, 404, "model_not_found", "model"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,status,code,param", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_requests(client, fake, path, body, status, code, param):
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    error = assert_error(r, status, code, param)
    assert error["type"] == "invalid_request_error"
    assert fake.calls == []  # refused before reaching the engine
    assert_still_serving(client)


def test_context_length_message_gives_the_numbers(client, fake):
    prompt_len = len(fake.tokenizer.apply_chat_template(HELLO))
    error = assert_error(
        client.post(CHAT, json={"messages": HELLO, "max_tokens": 1000}), 400, "context_length_exceeded"
    )
    assert "256" in error["message"] and str(prompt_len) in error["message"] and "1000" in error["message"]


def test_unknown_fields_are_ignored_with_a_warning(client, fake, caplog):
    with caplog.at_level("WARNING", logger="qml.server"):
        r = client.post(CHAT, json={"messages": HELLO, "max_tokens": 4, "foo": 1})
    assert r.status_code == 200 and len(fake.calls) == 1
    assert "'foo'" in caplog.text


def test_unknown_route_and_wrong_method(client):
    assert_error(client.post("/v1/nothing", json={}), 404, "not_found")
    r = client.get(CHAT)
    assert_error(r, 405, "method_not_allowed")
    assert "POST" in r.headers["allow"]
    assert_still_serving(client)


def test_integral_numbers_are_integers(client, fake):
    # JSON has one number type: 3.0 is the integer 3 (as JSON Schema counts it), 1.0 the neutral n
    r = client.post(CHAT, json={"messages": HELLO, "max_tokens": 3.0, "n": 1.0, "seed": 7.0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == REPLY[:3]
    assert fake.calls[-1].params.seed == 7 and isinstance(fake.calls[-1].params.max_tokens, int)
    r = client.post(COMPLETIONS, json={"prompt": [72.0, 105], "max_tokens": 2})
    assert r.status_code == 200 and fake.calls[-1].prompt_ids == [72, 105]
    assert_error(client.post(CHAT, json={"messages": HELLO, "n": True}), 400, TYPE, "n")


# Token-id prompts are checked in bulk when they are all in range and per id otherwise: whatever
# path a list takes, a bad one gets this exact error (the messages the per-id check always gave).
NOT_A_PROMPT = "'prompt' must be a string, a list of token ids, or a one-item list of either, got list"
BAD_PROMPT_IDS = [
    ("float", [72, 1.5], TYPE, NOT_A_PROMPT),
    ("bool", [72, True], TYPE, NOT_A_PROMPT),
    ("bool-alone", [False], TYPE, NOT_A_PROMPT),
    ("null", [72, None], TYPE, NOT_A_PROMPT),
    ("string-id", [72, "105"], TYPE, NOT_A_PROMPT),
    ("empty", [], TYPE, NOT_A_PROMPT),
    ("empty-nested", [[]], TYPE, NOT_A_PROMPT),
    ("nested-pair", [[72], [105]], UNSUPPORTED, "Only one prompt per request is supported"),
    ("negative", [72, -1], VALUE, "prompt[1] = -1 is not a valid token id [0, 257)"),
    ("past-vocab", [72, 105, 257], VALUE, "prompt[2] = 257 is not a valid token id [0, 257)"),
    ("first-bad-named", [72, 300, -5], VALUE, "prompt[1] = 300 is not a valid token id [0, 257)"),
    ("nested-negative", [[72, -3]], VALUE, "prompt[1] = -3 is not a valid token id [0, 257)"),
    ("over-int64", [72, 2**64], VALUE, f"prompt[1] = {2**64} is not a valid token id [0, 257)"),
    ("under-int64", [-(2**63) - 1], VALUE, f"prompt[0] = {-(2**63) - 1} is not a valid token id [0, 257)"),
    ("int64-max", [2**63 - 1], VALUE, f"prompt[0] = {2**63 - 1} is not a valid token id [0, 257)"),
    ("integral-float-past-vocab", [72, 300.0], VALUE, "prompt[1] = 300 is not a valid token id [0, 257)"),
]  # fmt: skip


@pytest.mark.parametrize("prompt,code,message", [c[1:] for c in BAD_PROMPT_IDS], ids=[c[0] for c in BAD_PROMPT_IDS])
def test_bad_prompt_ids_get_the_same_error(client, fake, prompt, code, message):
    for stream in (False, True):
        r = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1, "stream": stream})
        assert assert_error(r, 400, code, "prompt")["message"] == message
    assert fake.calls == []


def test_good_prompt_ids_reach_the_engine_as_sent(client, fake):
    ids = [BOS] + [i % 257 for i in range(200)] + [0, 256]
    for prompt, expected in ((ids, ids), ([ids], ids), ([72.0, 105], [72, 105]), ([[0, 256.0]], [0, 256])):
        r = client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
        assert fake.calls[-1].prompt_ids == expected
        assert all(type(t) is int for t in fake.calls[-1].prompt_ids)


def test_token_id_checks_directly():
    from qml_server.fields import token_ids
    from qml_server.schemas import check_token_ids

    ids = [3, 0, 7]
    assert token_ids(ids) == ids and token_ids([3.0, 4]) == [3, 4]
    assert token_ids([1, True]) is None and token_ids([1, 2.5]) is None and token_ids([]) is None
    assert check_token_ids(ids, 8, "p") is ids and check_token_ids([], 8, "p") == []
    assert check_token_ids([2**64, 5], None, "p") == [2**64, 5]  # without a vocabulary only negatives fail
    with pytest.raises(Exception, match=r"p\[1\] = -1 is not a valid token id \(non-negative\)"):
        check_token_ids([2**64, -1], None, "p")
    with pytest.raises(Exception, match=r"p\[2\] = 8 is not a valid token id \[0, 8\)"):
        check_token_ids([3, 0, 8], 8, "p")


def test_token_id_arrays_are_checked_as_the_lists_are():
    from array import array

    from qml_server.schemas import token_id_array

    got = token_id_array([3, 0, 7], 8, "p")
    assert isinstance(got, array) and got.typecode == "I" and got.tolist() == [3, 0, 7]
    assert token_id_array([], 8, "p").tolist() == []
    assert token_id_array([2**32 - 1], None, "p").tolist() == [2**32 - 1]
    with pytest.raises(Exception, match=r"p\[2\] = 8 is not a valid token id \[0, 8\)"):
        token_id_array([3, 0, 8], 8, "p")
    with pytest.raises(Exception, match=r"p\[1\] = -1 is not a valid token id"):
        token_id_array([5, -1], None, "p")
    with pytest.raises(Exception, match=r"token ids must be integers in \[0, 2\^32\)"):
        token_id_array([2**32], None, "p")  # no vocabulary to refuse it by, but no uint32 holds it


# --- /tokenize and /detokenize --------------------------------------------------------


def test_tokenize_counts_what_generation_counts(client, fake):
    for path, generate, tokenize in (
        (COMPLETIONS, {"prompt": "Hello there", "max_tokens": 1}, {"prompt": "Hello there"}),
        (CHAT, {"messages": HELLO, "max_tokens": 1}, {"messages": HELLO}),
    ):
        usage = client.post(path, json=generate).json()["usage"]
        r = client.post(TOKENIZE, json={"model": "fake-model", **tokenize})
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(body["tokens"]) == usage["prompt_tokens"]
        assert body["tokens"] == fake.calls[-1].prompt_ids and body["max_model_len"] == fake.context_length


def test_tokenize_options_and_detokenize_round_trip(client, fake):
    plain = client.post(TOKENIZE, json={"prompt": "héllo 😀", "add_special_tokens": False}).json()["tokens"]
    assert plain == fake.tokenizer.encode("héllo 😀", add_special_tokens=False)
    assert client.post(TOKENIZE, json={"prompt": "héllo 😀"}).json()["tokens"] == [BOS, *plain]
    assert client.post(DETOKENIZE, json={"tokens": plain}).json() == {"prompt": "héllo 😀"}
    assert client.post(DETOKENIZE, json={"model": "fake-model", "tokens": []}).json() == {"prompt": ""}
    with_prompt = client.post(TOKENIZE, json={"messages": HELLO}).json()["count"]
    without = client.post(TOKENIZE, json={"messages": HELLO, "add_generation_prompt": False}).json()["count"]
    assert with_prompt == without + len("<assistant>")
    kwargs = {"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}}
    assert client.post(TOKENIZE, json=kwargs).status_code == 200
    assert fake.tokenizer.last_template_kwargs == {"enable_thinking": False}
    assert fake.calls == []  # nothing here generates
    assert_error(client.get(TOKENIZE), 405, "method_not_allowed")


def test_token_routes_need_the_key_when_keys_are_set(fake):
    with TestClient(create_app(fake, api_keys=["sk-test"])) as c:
        for path, body in ((TOKENIZE, {"prompt": "a"}), (DETOKENIZE, {"tokens": [97]})):
            assert_error(c.post(path, json=body), 401, "invalid_api_key")
            assert c.post(path, json=body, headers={"authorization": "Bearer sk-test"}).status_code == 200
        assert c.get("/openapi.json").status_code == 200  # public, like /health and /metrics


def test_tokenize_on_the_real_tokenizer(engine):
    c = TestClient(create_app(engine))  # no lifespan: the fixture owns the engine's start/shutdown
    text = "The capital of France is Paris. ünïcödé 😀"
    body = c.post(TOKENIZE, json={"prompt": text, "add_special_tokens": False}).json()
    assert body["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    assert c.post(DETOKENIZE, json={"tokens": body["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": text}]
    chat = c.post(TOKENIZE, json={"messages": messages}).json()
    assert chat["tokens"] == engine.tokenizer.apply_chat_template(messages)
    assert chat["max_model_len"] == engine.context_length
    vocab = engine.tokenizer.vocab_size
    assert_error(c.post(DETOKENIZE, json={"tokens": [0, vocab]}), 400, VALUE, "tokens")


# --- /openapi.json --------------------------------------------------------------------


def test_openapi_describes_every_route_and_field(fake):
    from jsonschema import Draft202012Validator

    from qml_server.schemas import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS, UNSUPPORTED_CHAT

    app = create_app(fake, api_keys=["sk-test"])
    with TestClient(app) as c:
        doc = c.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1")
    served = {(route.path.replace("{model:path}", "{model}"), method.lower())
              for route in app.routes for method in route.methods if method != "HEAD"}
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert documented == served
    schemas = doc["components"]["schemas"]
    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert set(chat) == CHAT_FIELDS | IGNORED_FIELDS | set(UNSUPPORTED_CHAT)
    assert set(schemas["CompletionRequest"]["properties"]) >= COMPLETION_FIELDS
    assert doc["paths"]["/v1/chat/completions"]["post"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"].get("security") is None

    def valid(name: str, body: object) -> bool:
        return Draft202012Validator({"$ref": f"#/components/schemas/{name}", **doc}).is_valid(body)

    # the bodies this file sends successfully are valid; the ones refused for their fields are not
    assert valid("ChatCompletionRequest", {"messages": HELLO, "max_tokens": 9, "n": 1, "stop": ["a"], "seed": 1})
    assert valid("CompletionRequest", {"prompt": [[1, 2]], "stream": True, "stream_options": {"include_usage": True}})
    assert valid("TokenizeRequest", {"messages": HELLO, "add_generation_prompt": False})
    assert valid("DetokenizeRequest", {"tokens": []})
    field_errors = {"invalid_type", "missing_required_parameter", "unsupported_parameter", "invalid_json"}
    for case_id, path, body, _, code, _ in BAD_REQUESTS:
        name = {CHAT: "ChatCompletionRequest", COMPLETIONS: "CompletionRequest", TOKENIZE: "TokenizeRequest",
                DETOKENIZE: "DetokenizeRequest"}[path]
        if not isinstance(body, bytes) and (code in field_errors or code == "model_not_found"):
            assert not valid(name, body), case_id


# --- 500s: real faults only, with an error id in the body and the log -----------------


def test_internal_error_has_an_id_shared_with_the_log(caplog):
    fake = FakeEngine(fail_at_start=RuntimeError("CUDA is on fire"))
    with TestClient(create_app(fake)) as c, caplog.at_level(logging.ERROR, logger="qml.server"):
        error = assert_error(c.post(CHAT, json={"messages": HELLO}), 500, "internal_error")
        error_id = re.search(r"error id (err-[0-9a-f]+)", error["message"]).group(1)
        assert "fire" not in error["message"]
        records = [r for r in caplog.records if error_id in r.getMessage()]
        assert len(records) == 1 and "CUDA is on fire" in str(records[0].exc_info[1])
        fake.fail_at_start = None
        assert_still_serving(c)


def test_body_too_large(fake):
    with TestClient(create_app(fake, max_body_bytes=2000)) as c:
        big = {"messages": [{"role": "user", "content": "x" * 3000}]}
        assert_error(c.post(CHAT, json=big), 413, "request_too_large")
        # Chunked (no Content-Length): counted while it arrives.
        chunked = (part for part in [json.dumps(big).encode()[:1500], json.dumps(big).encode()[1500:]])
        assert_error(c.post(CHAT, content=chunked), 413, "request_too_large")
        assert fake.calls == []
        assert_still_serving(c)


@pytest.mark.parametrize("stream", [False, True])
def test_engine_error_at_start_is_500(stream):
    fake = FakeEngine(fail_at_start=RuntimeError("CUDA is on fire"))
    with TestClient(create_app(fake)) as c:
        r = c.post(CHAT, json={"messages": HELLO, "stream": stream})
        error = assert_error(r, 500, "internal_error")
        assert error["type"] == "server_error" and "fire" not in error["message"]
        fake.fail_at_start = None
        assert_still_serving(c)


def test_engine_invalid_parameter_is_400():
    fake = FakeEngine(fail_at_start=InvalidParameter("max_tokens", "the KV cache is too small for this request"))
    with TestClient(create_app(fake)) as c:
        for stream in (False, True):
            r = c.post(CHAT, json={"messages": HELLO, "stream": stream})
            assert assert_error(r, 400, "invalid_value", "max_tokens")["message"].startswith("the KV cache")


def test_engine_error_mid_stream_is_an_error_event_then_done():
    fake = FakeEngine(fail_after_tokens=3)
    with TestClient(create_app(fake)) as c:
        r = c.post(CHAT, json={"messages": HELLO, "stream": True})
        assert r.status_code == 200  # the 200 was already sent when the engine failed
        events = sse_payloads(r.text)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
        assert not any(e["choices"][0]["finish_reason"] for e in events[:-2])
        assert fake.aborted == [events[0]["id"]]
        fake.fail_after_tokens = None
        assert_still_serving(c)


# --- API keys -------------------------------------------------------------------------


def test_api_keys(fake, caplog):
    caplog.set_level(logging.DEBUG)
    with TestClient(create_app(fake, api_keys=["sk-old", "sk-new"])) as c:
        assert c.get("/health").status_code == 200  # public
        for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": "Basic sk-new"}):
            r = c.get("/v1/models", headers=headers)
            assert assert_error(r, 401, "invalid_api_key")["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
        assert_error(c.post(CHAT, json={"messages": HELLO}), 401, "invalid_api_key")
        assert fake.calls == []
        for key in ("sk-old", "sk-new"):  # both work: rotation
            r = c.post(CHAT, json={"messages": HELLO, "max_tokens": 2}, headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
        # each key is a tenant, and the engine is told which: it salts the KV cache with it
        assert [call.tenant for call in fake.calls] == [tenant_id("sk-old"), tenant_id("sk-new")]
    assert "sk-old" not in caplog.text and "sk-new" not in caplog.text and "sk-wrong" not in caplog.text


def test_no_api_keys_means_open(client):
    assert client.get("/v1/models").status_code == 200


def test_tenant_is_recorded_on_request_state():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["state"]["tenant"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    c = TestClient(ApiKeyMiddleware(app, keys=["sk-a", "sk-b"]))
    c.get("/v1/models", headers={"authorization": "Bearer sk-b"})
    c.get("/health")
    assert seen == [tenant_id("sk-b"), None]
    assert tenant_id("sk-b") != tenant_id("sk-a") and "sk-b" not in tenant_id("sk-b")


# --- the official openai client, in-process -------------------------------------------


def openai_client(http_client: httpx.Client, base_url: str = "http://testserver/v1", key: str = "none"):
    return openai.OpenAI(api_key=key, base_url=base_url, http_client=http_client, max_retries=0)


def test_openai_client_in_process(client):
    oa = openai_client(client)
    chat = oa.chat.completions.create(model="fake-model", messages=HELLO, max_tokens=8)
    assert chat.choices[0].message.content == REPLY[:8] and chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens_details.cached_tokens == 0 and chat.usage.completion_tokens == 8

    stream = oa.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY[:8]
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    text = oa.completions.create(model="fake-model", prompt="Hi", max_tokens=5, extra_body={"top_k": 20})
    assert text.choices[0].text == REPLY[:5]
    assert [m.id for m in oa.models.list()] == ["fake-model"]

    with pytest.raises(openai.BadRequestError) as bad:
        oa.chat.completions.create(model="fake-model", messages=HELLO, max_tokens=10_000)
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        oa.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert missing.value.code == "model_not_found"


def test_openai_client_auth(fake):
    with TestClient(create_app(fake, api_keys=["sk-test"])) as c:
        with pytest.raises(openai.AuthenticationError) as denied:
            openai_client(c, key="sk-nope").models.list()
        assert denied.value.code == "invalid_api_key"
        assert [m.id for m in openai_client(c, key="sk-test").models.list()] == ["fake-model"]


def test_openai_client_sees_mid_stream_error():
    with TestClient(create_app(FakeEngine(fail_after_tokens=2))) as c:
        stream = openai_client(c).chat.completions.create(model="fake-model", messages=HELLO, stream=True)
        with pytest.raises(openai.APIError, match="server had an error"):
            list(stream)


def test_session_id_and_user_reach_the_engine(client, fake):
    client.post(CHAT, json={"messages": HELLO, "max_tokens": 2}, headers={"x-session-id": "conv-42"})
    client.post(CHAT, json={"messages": HELLO, "max_tokens": 2, "user": "alice"})
    client.post(CHAT, json={"messages": HELLO, "max_tokens": 2})
    assert [c.session for c in fake.calls] == ["conv-42", "alice", None]


class _ExpectingEngine(FakeEngine):
    """Records when the server announces a request (``expect_request``) against when it generates."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.events: list[str] = []

    def expect_request(self) -> None:
        self.events.append("expect")

    async def generate(self, prompt_ids, params, request_id, *args, **kw):
        self.events.append("generate")
        async for out in super().generate(prompt_ids, params, request_id, *args, **kw):
            yield out


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_a_generation_request_is_announced_to_the_engine_before_its_prompt_is_prepared(path, body):
    fake = _ExpectingEngine()
    with TestClient(create_app(fake)) as c:
        r = c.post(path, json={"model": fake.model_id, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text
        assert fake.events == ["expect", "generate"]
        # a request refused before it reaches the engine is announced too (the hold then simply expires)
        assert c.post(path, json={"model": "no-such-model", **body}).status_code == 404
        assert fake.events == ["expect", "generate", "expect"]
