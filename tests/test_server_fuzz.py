"""Property-based fuzzing of the HTTP API, over the fake engine (tests/fake_engine.py).

Two generators:

* hypothesis, over raw request bodies: random JSON values, valid requests with fields
  deleted or replaced by values of the wrong type, huge and boundary numbers, unicode
  (astral characters, NUL, lone surrogate escapes), and bytes that are not JSON at all;
* schemathesis, from the server's own /openapi.json, in positive (schema-valid) and
  negative (schema-violating) modes.

The invariants: no 5xx, ever; every 4xx in the OpenAI error shape with a string code;
a schema-valid body is refused only for what no schema can say (the context length,
the chat template's rules), a schema-invalid one always is, so /openapi.json is an
accurate description of what the parser accepts; the engine holds no request once the
responses are in, and the server keeps serving. Each test prints how many inputs it tried.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from starlette.testclient import TestClient

from qml_server import create_app
from qml_server.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    DETOKENIZE_FIELDS,
    IGNORED_FIELDS,
    ROLES,
    TOKENIZE_FIELDS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
)
from tests.fake_engine import FakeEngine
from tests.test_server_api import assert_still_serving, sse_payloads

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
HELLO = [{"role": "user", "content": "Hi"}]
EXAMPLES = 300  # per generator and route; about 2 s each on one core

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # a fresh draw every run: CI explores new inputs instead of replaying old ones
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine(context_length=2048)  # room for the system turn that lists tools


@pytest.fixture(scope="module")
def client(fake):
    with TestClient(create_app(fake)) as c:
        yield c


@pytest.fixture(scope="module")
def request_schemas(client) -> dict[str, Draft202012Validator]:
    """Validators for each POST route's body, from the server's own /openapi.json."""
    doc = client.get("/openapi.json").json()
    validators = {}
    for path, item in doc["paths"].items():
        body = item.get("post", {}).get("requestBody")
        if body:
            ref = body["content"]["application/json"]["schema"]["$ref"]
            validators[path] = Draft202012Validator({"$ref": ref, "components": doc["components"]})
    assert set(validators) == {CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE}
    return validators


# --- strategies -----------------------------------------------------------------------

texts = (
    st.text(max_size=40)  # any code point but surrogates: astral, combining, NUL, RTL...
    | st.sampled_from(["", " ", "\x00", "Hi", "fake-model", "😀" * 3, "e\u0301", "\u202e", "[DONE]"])
)
# JSON can escape a lone UTF-16 surrogate (\ud800), which no str in UTF-8 can hold
lone_surrogates = st.sampled_from(["\ud800", "a\udfff", "\udbff\ud800"])
numbers = (
    st.integers(-300, 300)
    | st.integers()
    | st.sampled_from([0, 1, -1, 2, 255, 256, 257, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, 2.0000001, 1e-320, 1e308, -1e308, 5.0, 16.0])
)
scalars = st.none() | st.booleans() | numbers | texts
# Names the parser looks for, at any depth: keys of bodies, messages, parts, options.
KNOWN_NAMES = sorted(
    CHAT_FIELDS | COMPLETION_FIELDS | TOKENIZE_FIELDS | DETOKENIZE_FIELDS | IGNORED_FIELDS
    | set(UNSUPPORTED_CHAT) | set(UNSUPPORTED_COMPLETION)
    | {"role", "content", "type", "text", "name", "tool_calls", "include_usage", "include_obfuscation"}
    | {"json_schema", "schema", "strict", "function", "parameters", "description"}
)
field_names = st.sampled_from(KNOWN_NAMES) | texts
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(field_names, inner, max_size=4),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": st.sampled_from(ROLES) | json_values,
            "content": texts | st.lists(st.fixed_dictionaries({"type": st.just("text") | texts, "text": texts}),
                                        max_size=3) | json_values,
            "name": texts | json_values,
            "tool_calls": st.just([]) | json_values,
            "tool_call_id": texts,
        },
    ),
    max_size=4,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                   "properties": {"x": {"type": "integer"}}}}}
VALID = {
    CHAT: [{"model": "fake-model", "messages": HELLO, "max_tokens": 8},
           {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0},
           {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {
               "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
           {"messages": HELLO, "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "stream": True}],
    COMPLETIONS: [{"model": "fake-model", "prompt": "Hi", "max_tokens": 8},
                  {"prompt": [72, 105], "stream": True, "seed": 3, "stop": ["x"]}],
    TOKENIZE: [{"prompt": "Hi"}, {"messages": HELLO, "add_generation_prompt": False}],
    DETOKENIZE: [{"tokens": [256, 72, 105]}, {"model": "fake-model", "tokens": []}],
}


@st.composite
def mutated(draw: Callable, path: str) -> dict:
    """A valid body for ``path`` with up to five fields deleted, replaced or added."""
    body = copy.deepcopy(draw(st.sampled_from(VALID[path])))
    for _ in range(draw(st.integers(0, 5))):
        action = draw(st.sampled_from(["set", "set", "delete", "messages"]))
        if action == "set":
            body[draw(field_names)] = draw(json_values)
        elif action == "delete" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif action == "messages":
            body["messages"] = draw(messages)
    if draw(st.integers(0, 9)) == 5:  # about one body in ten (hypothesis favours the bounds)
        body[draw(field_names)] = draw(lone_surrogates)
    return body


def bodies(path: str) -> st.SearchStrategy:
    # mostly near-valid bodies, which get past the first checks and reach the deeper ones
    near_valid = mutated(path)
    return near_valid | near_valid | near_valid | st.dictionaries(field_names, json_values, max_size=6) | json_values


def encode(body: object, ascii_only: bool) -> bytes:
    # ensure_ascii also writes lone surrogates as \\udXXX escapes, which a str cannot encode
    return json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", errors="surrogatepass")


raw_bodies = (
    st.binary(max_size=80)
    | json_values.map(lambda v: encode(v, True)).flatmap(
        lambda raw: st.integers(0, len(raw)).map(lambda cut: raw[:cut]))  # truncated JSON
    | st.sampled_from([
        b"", b"{", b"null", b"[]", b'"x"', b"{}", b'{"messages": NaN}', b'{"prompt": Infinity}',
        b'{"max_tokens": 1e999}', b'{"prompt": "\\ud800"}', b'{"prompt": "a\\udfff"}', b'{"tokens": [-1e999]}',
        b"\xef\xbb\xbf{}", '{"prompt": "Hi"}'.encode("utf-16"), b'{"prompt": "\xff\xfe"}',
        b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b'{"max_tokens": ' + b"9" * 5000 + b"}",
    ])
)


# --- the checks -----------------------------------------------------------------------

# 400s a schema-valid body may still get: what depends on the prompt's length in tokens
# or on the model's chat template, and min_tokens over max_tokens (which may be the room
# the prompt leaves), none of which a schema can express.
SEMANTIC_REFUSALS = ("This model's maximum context length", "The chat template rejected",
                     "The prompt is empty", "The rendered prompt is empty", "min_tokens (",
                     # a JSON schema that does not compile, and tool names that must match each other
                     "Invalid JSON schema in", "The tools' schemas are too complex", "Duplicate function name",
                     "'tool_choice' names the function", "'tool_choice' 'required' needs",
                     "'response_format' cannot be combined")


def check_error_shape(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and isinstance(error["code"], str), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def check_response(r: httpx.Response, path: str, body: object, schema_valid: bool | None) -> None:
    """``schema_valid``: whether the body matched /openapi.json (None: not JSON, not checked)."""
    context = f"{path} {body!r:.600} -> {r.status_code} {r.text[:600]}"
    assert r.status_code < 500, context
    assert r.status_code in (200, 400, 404), context
    if r.status_code != 200:
        error = check_error_shape(r)
        assert schema_valid is not True or error["message"].startswith(SEMANTIC_REFUSALS), context
        return
    assert schema_valid is not False, "a body the schema refuses was accepted: " + context
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_payloads(r.text)
        assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), context
    else:
        assert "error" not in r.json(), context


def run_fuzz(client: TestClient, path: str, strategy: st.SearchStrategy, validator, capsys) -> int:
    tried = 0

    @FUZZ_SETTINGS
    @given(body=strategy, ascii_only=st.booleans())
    def fuzz(body: object, ascii_only: bool) -> None:
        nonlocal tried
        tried += 1
        has_surrogate = not encodable(body)
        raw = encode(body, ascii_only or has_surrogate)
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        # a lone surrogate cannot be a JSON string's value on our side of the parse: refused
        valid = None if has_surrogate else validator.is_valid(body)
        check_response(r, path, body, valid)
        if has_surrogate:
            assert r.status_code == 400

    fuzz()
    with capsys.disabled():
        print(f"\n  fuzzed {path} with {tried} hypothesis bodies")
    return tried


def encodable(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- the tests ------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE])
def test_fuzz_json_bodies(client, fake, request_schemas, capsys, path):
    tried = run_fuzz(client, path, bodies(path), request_schemas[path], capsys)
    assert tried >= EXAMPLES
    assert fake.running == {} and fake.waiting == []  # no request left behind in the engine
    assert_still_serving(client)


def test_fuzz_raw_bytes(client, fake, capsys):
    tried = 0

    @FUZZ_SETTINGS
    @given(raw=raw_bodies, path=st.sampled_from([CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE]))
    def fuzz(raw: bytes, path: str) -> None:
        nonlocal tried
        tried += 1
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        check_response(r, path, raw, None)

    fuzz()
    with capsys.disabled():
        print(f"\n  fuzzed the POST routes with {tried} raw bodies")
    assert tried >= EXAMPLES
    assert fake.running == {} and fake.waiting == []
    assert_still_serving(client)


def test_fuzz_models_routes_and_methods(client, capsys):
    tried = 0
    paths = st.sampled_from(["/v1/models", CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE, "/v1", "/v1/nothing", "/"])
    model_paths = texts.filter(lambda t: t and encodable(t)).map(lambda t: "/v1/models/" + quote(t, safe=""))

    @FUZZ_SETTINGS
    @given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"]), path=paths | model_paths,
           query=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
    @example(method="GET", path="/v1/models/.", query={})  # dot segments: what the client sends is "/v1/models/"
    @example(method="GET", path="/v1/models/..", query={})
    def fuzz(method: str, path: str, query: dict) -> None:
        nonlocal tried
        tried += 1
        r = client.request(method, path, params=query)
        context = f"{method} {path} {query} -> {r.status_code} {r.text[:300]}"
        assert r.status_code < 500, context
        if method == "HEAD":
            return  # no body to check
        # the path as sent: the client resolves dot segments ("/v1/models/." is "/v1/models/")
        sent = r.request.url.path
        if r.status_code >= 400:
            check_error_shape(r)
            assert r.status_code in (400, 404, 405), context
        elif sent.rstrip("/") == "/v1/models":
            assert [m["id"] for m in r.json()["data"]] == ["fake-model"], context
        elif sent.startswith("/v1/models/"):
            assert r.json()["id"] == "fake-model", context

    fuzz()
    with capsys.disabled():
        print(f"\n  fuzzed methods and paths with {tried} requests")
    assert tried >= EXAMPLES
    assert_still_serving(client)


# --- schemathesis, from /openapi.json ---------------------------------------------------

def test_schemathesis_from_openapi(capsys):
    schemathesis = pytest.importorskip("schemathesis")  # in the dev extras
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    # Not positive_data_acceptance: a schema-valid request may still be too long for the
    # context or refused by the chat template (test_fuzz_json_bodies checks those are the
    # only reasons).
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_headers_conformance, response_schema_conformance, negative_data_rejection]
    fake = FakeEngine()
    app = create_app(fake)
    with TestClient(app):  # runs the lifespan; schemathesis calls the app in-process
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        tried: dict[str, int] = {}
        for result in schema.get_all_operations():
            operation = result.ok()
            # negative mode needs something to break: a body (any string is a valid model name)
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(operation.body) else [])
            for mode in modes:
                tried[f"{operation.label} ({mode.value})"] = _schemathesis_run(operation, mode, checks)
    with capsys.disabled():
        print(f"\n  schemathesis: {sum(tried.values())} requests: "
              + ", ".join(f"{k} {n}" for k, n in tried.items()))
    assert all(n > 0 for n in tried.values()), tried
    assert fake.running == {} and fake.waiting == []


def _schemathesis_run(operation, mode, checks) -> int:
    tried = 0

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case) -> None:
        nonlocal tried
        tried += 1
        case.call_and_validate(checks=checks)

    call()
    return tried
