"""response_format (json_object, json_schema) and tools / tool_choice / parallel_tool_calls.

Three layers: the tool-call parser and the streaming splitter on made-up text; the grammar
(qml_runtime.constrained) on the real tokenizer and in the engine on the real model (SmolLM2,
CPU), where a 135M model must still produce output that parses and validates; and the HTTP
route, through the official openai client against a live server (streamed and not), plus the
fake engine where a reply has to be a given text (a Hermes tool call under tool_choice auto).
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
import torch
from starlette.testclient import TestClient

from qml_runtime.constrained import GrammarError, Grammars, TokenMasks, json_schema_grammar, lark_grammar
from qml_runtime.sampling_params import InvalidParameter, SamplingParams
from qml_server import create_app
from qml_server.tools import TOOLS_PROMPT, ToolCallStream, ToolUse, parse_tool_calls, prompt_messages
from tests.fake_engine import FakeEngine
from tests.test_server_api import assert_error, openai_client, sse_payloads
from tests.test_server_connections import serve_in_thread

CHAT = "/v1/chat/completions"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK_PERSON = [{"role": "user", "content": "Give me a JSON object with a name and an age."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                         "required": ["tz"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = frozenset({"get_weather", "get_time"})
HERMES = ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
          '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
          '</tool_call>')


def arguments(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


# --- the tool-call parser and the streaming splitter ----------------------------------


def test_parser_reads_hermes_blocks_and_the_text_before_them():
    content, calls = parse_tool_calls(HERMES, NAMES)
    assert content == "Let me look that up."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert arguments(calls[0]) == {"city": "Paris", "unit": "celsius"} and arguments(calls[1]) == {"tz": "Europe/Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    # a last block cut before its closing tag still counts, if its JSON is whole
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}', NAMES)
    assert arguments(calls[0]) == {"tz": "UTC"}


@pytest.mark.parametrize("text, expected", [
    ('{"name": "get_time", "arguments": {"tz": "UTC"}}', [("get_time", {"tz": "UTC"})]),
    ('  {"name": "get_time", "parameters": {"tz": "UTC"}}\n', [("get_time", {"tz": "UTC"})]),  # Llama 3.1 style
    ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]',
     [("get_time", {}), ("get_weather", {"city": "Oslo"})]),  # arguments already a JSON string
    ('```json\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n```', [("get_time", {"tz": "UTC"})]),
])
def test_parser_reads_bare_json_calls(text, expected):
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None
    assert [(c["function"]["name"], arguments(c)) for c in calls] == expected


@pytest.mark.parametrize("text", [
    "The weather in Paris is mild.",
    '{"name": "launch_rockets", "arguments": {}}',  # not a declared function
    '{"city": "Paris"}',  # JSON, but not a call
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": \n</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>{"name": "nope"}</tool_call>',
    '{"name": "get_time", "arguments": [1, 2]}',
    "",
])
def test_parser_leaves_anything_else_as_content(text):
    assert parse_tool_calls(text, NAMES) is None


def feed_in_pieces(splitter: ToolCallStream, text: str, size: int) -> str:
    return "".join(splitter.feed(text[i:i + size]) for i in range(0, len(text), size))


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_stream_splitter_sends_content_and_holds_calls(size):
    auto = ToolUse((WEATHER, CLOCK))
    splitter = ToolCallStream(auto)
    sent = feed_in_pieces(splitter, HERMES, size)
    assert sent == "Let me look that up.\n"
    rest, calls = splitter.finish()
    assert rest == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]

    plain = "Use a <toolbox>, or <tool_call without the bracket. {not JSON}"
    splitter = ToolCallStream(auto)
    sent = feed_in_pieces(splitter, plain, size)
    rest, calls = splitter.finish()
    assert sent + rest == plain and calls == []
    assert len(sent) >= len(plain) - len("<tool_call") - size  # held back at most a partial tag

    splitter = ToolCallStream(auto)  # a call after blank lines: no content at all, as in the whole answer's parse
    assert feed_in_pieces(splitter, "\n\n" + HERMES[HERMES.index("<tool_call>"):], size) == ""
    assert len(splitter.finish()[1]) == 2

    bare = '\n{"name": "get_time", "arguments": {"tz": "UTC"}}'  # may be a call: held whole
    splitter = ToolCallStream(auto)
    assert feed_in_pieces(splitter, bare, size) == ""
    assert [arguments(c) for c in splitter.finish()[1]] == [{"tz": "UTC"}]

    splitter = ToolCallStream(ToolUse((WEATHER,), "required"))  # forced: nothing goes out before the end
    assert feed_in_pieces(splitter, "no call at all", size) == ""
    assert splitter.finish() == ("no call at all", [])


def test_prompt_for_templates_with_and_without_tools():
    use = ToolUse((WEATHER,))
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
               {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    messages, extra = prompt_messages(history, use, template_writes_tools=True)
    assert messages == history and extra == {"tools": [WEATHER]}
    messages, extra = prompt_messages(history, use, template_writes_tools=False)
    assert extra == {} and messages[0]["role"] == "system"
    assert messages[0]["content"] == TOOLS_PROMPT.format(tools=json.dumps(WEATHER))
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n12 C\n</tool_response>"}
    with_system = [{"role": "system", "content": "Be brief."}, *history[:1]]
    messages, _ = prompt_messages(with_system, use, template_writes_tools=False)
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\nYou may call")
    assert prompt_messages(history, None, template_writes_tools=False) == (history, {})


# --- the grammar, on the real tokenizer -------------------------------------------------


@pytest.fixture(scope="module")
def grammars(engine):
    return Grammars(engine.tokenizer, engine.model_config.vocab_size)


def consumes(grammars: Grammars, grammar: str, text: str, tokenizer) -> bool:
    matcher = grammars.matcher(grammar)
    try:
        for token in tokenizer.encode(text, add_special_tokens=False):
            matcher.accept(token)
    except GrammarError:
        return False
    return matcher.done


def test_tool_call_grammar_allows_declared_calls_only(grammars, engine):
    from qml_server.tools import tool_call_grammar

    tok = engine.tokenizer
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    required = tool_call_grammar(ToolUse((WEATHER, CLOCK), "required", parallel=False))
    assert consumes(grammars, required, call, tok) and consumes(grammars, required, other, tok)
    assert not consumes(grammars, required, call.replace("celsius", "kelvin"), tok)  # enum in the schema
    assert not consumes(grammars, required, call.replace("get_weather", "get_wether"), tok)
    assert not consumes(grammars, required, call + "\n" + other, tok)  # parallel_tool_calls: false
    parallel = tool_call_grammar(ToolUse((WEATHER, CLOCK), "required"))
    matcher = grammars.matcher(parallel)
    for token in tok.encode(call + "\n" + other, add_special_tokens=False):
        matcher.accept(token)
    named = tool_call_grammar(ToolUse((WEATHER, CLOCK), "function", "get_time"))
    assert consumes(grammars, named, other, tok) and not consumes(grammars, named, call, tok)


def test_masks_leave_exactly_the_grammars_tokens(grammars, engine):
    tok = engine.tokenizer
    V = engine.model_config.vocab_size
    yes_no = grammars.matcher(lark_grammar('start: "yes" | "no"'))
    logits = torch.randn(3, V)
    before = logits.clone()
    TokenMasks().apply(logits, [1], [yes_no])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])  # rows without a grammar are untouched
    allowed = torch.isfinite(logits[1]).nonzero()[:, 0].tolist()
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in map(lambda i: tok.decode([i]), allowed))
    for word in ("yes", "no", "y", "n"):
        first = tok.encode(word, add_special_tokens=False)[0]
        assert first in allowed
    assert torch.equal(logits[1, allowed], before[1, allowed])


@pytest.mark.parametrize("schema", [{"type": "foo"}, {"type": "string", "pattern": "(("},
                                    {"type": "array", "minItems": 3, "maxItems": 1},
                                    {"properties": {"a": {"$ref": "#/$defs/missing"}}}])
def test_schemas_that_do_not_compile_are_refused(schema):
    with pytest.raises(GrammarError):
        json_schema_grammar(schema)


# --- the engine --------------------------------------------------------------------------


def test_engine_output_follows_the_schema_and_ends_with_it(engine):
    ids = engine.tokenizer.apply_chat_template(ASK_PERSON)
    grammar = json_schema_grammar(PERSON)
    for params, n in ((SamplingParams(max_tokens=40, temperature=0, grammar=grammar), 1),
                      (SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=grammar), 3)):
        outs = engine.generate_sync(ids, params, n=n)
        for out in outs if n > 1 else [outs]:
            # each choice has its own matcher: a shared one would refuse the second choice's tokens
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), PERSON)
            assert out.token_ids[-1] not in engine.tokenizer.eos_token_ids  # ended by the grammar, not by EOS
    plain = engine.generate_sync(ids, SamplingParams(max_tokens=8, temperature=0))
    assert not plain.text.startswith("{")  # the model would not have written JSON on its own
    with pytest.raises(InvalidParameter):
        engine.generate_sync(ids, SamplingParams(max_tokens=4, grammar='{"grammars": "not a grammar"}'))


# --- the HTTP route: live server, official client -------------------------------------


@pytest.fixture(scope="module")
def live(engine):
    with serve_in_thread(create_app(engine), lifespan="off") as base, httpx.Client(timeout=120) as http:
        yield openai_client(http, base_url=f"{base}/v1")


def stream_text_and_calls(chunks) -> tuple[str, list[dict], list[str]]:
    """Content, tool calls reassembled by index as clients do, and the finish reasons of a streamed choice."""
    text, calls, reasons = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        if choice.finish_reason:
            reasons.append(choice.finish_reason)
    return text, [calls[i] for i in sorted(calls)], reasons


def test_json_object_and_json_schema(live, engine):
    for response_format, schema in (({"type": "json_object"}, {"type": "object"}),
                                    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                             "strict": True}}, PERSON)):
        chat = live.chat.completions.create(model=engine.model_id, messages=ASK_PERSON, max_tokens=40,
                                            temperature=0, response_format=response_format)
        choice = chat.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
        chunks = list(live.chat.completions.create(model=engine.model_id, messages=ASK_PERSON, max_tokens=40,
                                                   temperature=0, response_format=response_format, stream=True))
        text, calls, reasons = stream_text_and_calls(chunks)
        assert text == choice.message.content and calls == [] and reasons == ["stop"]
    sampled = live.chat.completions.create(model=engine.model_id, messages=ASK_PERSON, max_tokens=40, n=2, seed=5,
                                           temperature=1.0, response_format=response_format)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls(live, engine, tool_choice):
    kwargs = dict(model=engine.model_id, messages=ASK_WEATHER, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                  parallel_tool_calls=False, max_tokens=60, temperature=0)
    chat = live.chat.completions.create(**kwargs)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    if isinstance(tool_choice, dict):
        assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), declared[calls[0].function.name])

    text, streamed, reasons = stream_text_and_calls(live.chat.completions.create(**kwargs, stream=True))
    assert text == "" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in streamed] == [(calls[0].function.name, calls[0].function.arguments)]
    assert streamed[0]["id"].startswith("call_")


def test_tool_choice_none_and_auto_answer_in_text(live, engine):
    for tool_choice in ("none", "auto"):
        chat = live.chat.completions.create(model=engine.model_id, messages=[{"role": "user", "content": "Hi!"}],
                                            tools=[WEATHER], tool_choice=tool_choice, max_tokens=8, temperature=0)
        choice = chat.choices[0]
        assert not choice.message.tool_calls and choice.message.content
        assert choice.finish_reason in ("stop", "length")


# --- the HTTP route over the fake engine: what a reply that is a call becomes ------------


def fake_client(reply: str) -> tuple[TestClient, FakeEngine]:
    fake = FakeEngine(reply=reply, context_length=4096)
    return TestClient(create_app(fake)), fake


def test_auto_tool_calls_in_the_models_text():
    client, fake = fake_client(HERMES)
    body = {"messages": ASK_WEATHER, "tools": [WEATHER, CLOCK]}
    data = client.post(CHAT, json=body).json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look that up."
    assert [(c["function"]["name"], arguments(c)) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"tz": "Europe/Paris"})]
    assert fake.calls[-1].params.grammar is None  # auto: nothing constrained
    prompt = fake.tokenizer.decode(fake.calls[-1].prompt_ids)
    assert "<tools>\n" + json.dumps(WEATHER) in prompt  # the fake's template does not write tools itself

    events = sse_payloads(client.post(CHAT, json=body | {"stream": True}).text)[:-1]
    deltas = [e["choices"][0] for e in events]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look that up.\n"
    parts = [p for d in deltas for p in d["delta"].get("tool_calls", [])]
    assert [p["index"] for p in parts] == [0, 0, 1, 1]
    assert [p["function"]["name"] for p in parts if "id" in p] == ["get_weather", "get_time"]
    assert json.loads("".join(p["function"]["arguments"] for p in parts if p["index"] == 1)) == {"tz": "Europe/Paris"}
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]

    none = client.post(CHAT, json=body | {"tool_choice": "none"}).json()["choices"][0]
    assert none["message"] == {"role": "assistant", "content": HERMES} and none["finish_reason"] == "stop"
    assert "<tools>" not in fake.tokenizer.decode(fake.calls[-1].prompt_ids)  # none: not rendered either


def test_forced_choice_sends_the_grammar_and_a_template_with_tools_gets_them(engine):
    client, fake = fake_client("not a call")
    r = client.post(CHAT, json={"messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "not a call" and choice["finish_reason"] == "stop"  # nothing to parse
    assert "get_weather" in fake.calls[-1].params.grammar

    class ToolTemplate:
        writes_tools = True

    fake.tokenizer.chat_template = ToolTemplate()
    client.post(CHAT, json={"messages": ASK_WEATHER, "tools": [WEATHER]})
    assert fake.tokenizer.last_template_kwargs == {"tools": [WEATHER]}
    assert "<tools>" not in fake.tokenizer.decode(fake.calls[-1].prompt_ids)


VALUE, TYPE, MISSING, UNSUPPORTED = "invalid_value", "invalid_type", "missing_required_parameter", \
    "unsupported_parameter"
BAD_SCHEMA = {"type": "object", "properties": {"age": {"type": "integer", "minimum": "zero"}}}
NAMED = {"type": "function", "function": {"name": "get_time"}}
BAD = [
    ("schema-invalid", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
     VALUE, "response_format.json_schema.schema"),
    ("schema-unsatisfiable", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "array", "minItems": 2, "maxItems": 1}}}}, VALUE, "response_format.json_schema.schema"),
    ("schema-not-object", {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}}, TYPE,
     "response_format.json_schema.schema"),
    ("schema-missing", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, MISSING,
     "response_format.json_schema.schema"),
    ("json-schema-missing", {"response_format": {"type": "json_schema"}}, MISSING, "response_format.json_schema"),
    ("format-type-missing", {"response_format": {}}, MISSING, "response_format.type"),
    ("format-not-object", {"response_format": "json"}, TYPE, "response_format"),
    ("strict-type", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     TYPE, "response_format.json_schema.strict"),
    ("tools-not-list", {"tools": WEATHER}, TYPE, "tools"),
    ("tool-not-object", {"tools": ["get_weather"]}, TYPE, "tools[0]"),
    ("tool-kind", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, UNSUPPORTED, "tools[0].type"),
    ("tool-no-function", {"tools": [{"type": "function"}]}, MISSING, "tools[0].function"),
    ("tool-name", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, VALUE,
     "tools[0].function.name"),
    ("tool-duplicate", {"tools": [WEATHER, WEATHER]}, VALUE, "tools[1].function.name"),
    ("tool-parameters-type", {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, TYPE,
     "tools[0].function.parameters"),
    ("tool-parameters-invalid", {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
     VALUE, "tools[0].function.parameters"),
    ("choice-unknown-function", {"tools": [WEATHER], "tool_choice": NAMED}, VALUE, "tool_choice.function.name"),
    ("choice-word", {"tools": [WEATHER], "tool_choice": "always"}, VALUE, "tool_choice"),
    ("choice-required-no-tools", {"tool_choice": "required"}, VALUE, "tool_choice"),
    ("choice-named-no-tools", {"tool_choice": NAMED}, VALUE, "tool_choice.function.name"),
    ("choice-kind", {"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, UNSUPPORTED, "tool_choice.type"),
    ("parallel-type", {"tools": [WEATHER], "parallel_tool_calls": "no"}, TYPE, "parallel_tool_calls"),
    ("format-and-forced-call", {"tools": [WEATHER], "tool_choice": "required",
                                "response_format": {"type": "json_object"}}, VALUE, "response_format"),
]


@pytest.mark.parametrize("body, code, param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_structured_requests_are_400s(body, code, param):
    client, fake = fake_client("x")
    error = assert_error(client.post(CHAT, json={"messages": ASK_WEATHER, **body}), 400, code, param)
    assert error["type"] == "invalid_request_error" and fake.calls == []


def test_completions_take_response_format():
    client, fake = fake_client("{}")
    r = client.post("/v1/completions", json={"prompt": "JSON:", "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and fake.calls[-1].params.grammar is not None
    assert_error(client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_schema"}}),
                 400, MISSING, "response_format.json_schema")


def test_the_tokenizer_view_is_built_at_server_start_not_at_the_first_request(engine):
    """``Grammars.prepare`` builds llguidance's view of the tokenizer; a server runs it on a thread as
    it starts, so the first constrained request does not build it on the event loop."""
    fresh = Grammars(engine.tokenizer, engine.model_config.vocab_size)
    assert fresh._ll_tokenizer is None
    fresh.prepare()
    assert fresh._ll_tokenizer is not None
    fresh.matcher(json_schema_grammar({"type": "object"}))  # and it serves matchers

    fake = FakeEngine()
    prepared = []
    fake.grammars = type("G", (), {"prepare": lambda self: prepared.append(True)})()
    with TestClient(create_app(fake)):
        for _ in range(100):
            if prepared:
                break
            time.sleep(0.01)
    assert prepared == [True]


def test_prepare_with_a_tokenizer_llguidance_cannot_read_is_not_an_error():
    class NoBackend:
        vocab_size, eos_token_ids = 10, {0}

    grammars = Grammars(NoBackend(), 10)
    grammars.prepare()  # logs, does not raise
    with pytest.raises(Exception):
        grammars.matcher(json_schema_grammar({"type": "object"}))


def test_tokenize_counts_the_tools_as_chat_renders_them():
    """/tokenize with ``tools`` gives the ids chat generates from with the same tools, which differ
    from the count without them; tools only go with ``messages``."""
    fake = FakeEngine(context_length=4096)  # the tools system turn is long
    weather = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    with TestClient(create_app(fake)) as c:
        c.post("/v1/chat/completions", json={"messages": messages, "tools": weather, "max_tokens": 1})
        generated = fake.calls[-1].prompt_ids
        with_tools = c.post("/tokenize", json={"messages": messages, "tools": weather}).json()
        without = c.post("/tokenize", json={"messages": messages}).json()
        none = c.post("/tokenize", json={"messages": messages, "tools": weather, "tool_choice": "none"}).json()
        assert with_tools["tokens"] == generated and with_tools["count"] == len(generated)
        assert without["count"] < with_tools["count"] and none["tokens"] == without["tokens"]
        assert_error(c.post("/tokenize", json={"prompt": "hi", "tools": weather}), 400, "invalid_value", "tools")
        assert_error(c.post("/tokenize", json={"messages": messages, "tools": [{"type": "nope"}]}), 400,
                     "unsupported_parameter", "tools[0].type")
