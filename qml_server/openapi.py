"""GET /openapi.json: an OpenAPI 3.1 description of every route, built from schemas.py.

The request bodies are assembled from the field tables in qml_server.schemas
(CHAT_FIELDS, UNSUPPORTED_CHAT, IGNORED_FIELDS, ...): each implemented field takes its
JSON Schema from ``FIELD_SCHEMAS`` below (a field without one fails the build, so the
two cannot drift apart silently), each known-but-unimplemented field is limited to its
neutral values, and ignored fields accept anything. The constraints are the ones the
parser and SamplingParams enforce, so a body valid here passes field validation; what
no schema can say (a prompt too long for the context, a conversation the model's chat
template refuses) still gets a 400. Property-based fuzzers (schemathesis) generate
requests from this document.

The document is built per app: the served model's name, its vocabulary size (the
bound on token ids) and whether API keys are required are in it.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_runtime.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from qml_server.fields import INT64_MAX, INT64_MIN
from qml_server.lifecycle import DRAINING, FAILED, LOADING, READY, STOPPED
from qml_server.schemas import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS,
    MAX_CHOICES,
    MESSAGE_EXTRAS,
    RESERVED_TEMPLATE_KWARGS,
    ROLES,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
)

Schema = dict[str, Any]

NULL: Schema = {"type": "null"}
STRING: Schema = {"type": "string"}
BOOLEAN: Schema = {"type": "boolean"}
INT64: Schema = {"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}
POSITIVE_INT64: Schema = {"type": "integer", "minimum": 1, "maximum": INT64_MAX}
COUNT: Schema = {"type": "integer", "minimum": 0}
FINISH_REASON: Schema = {"enum": ["stop", "length", "abort", "tool_calls"]}


def optional(schema: Schema) -> Schema:
    # Every optional field may be null: the parser reads null as "not sent".
    return {"anyOf": [schema, NULL]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


_STOP_STRING: Schema = {"type": "string", "minLength": 1}
_TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": STRING},
}
_EXTRA_TYPES = {str: STRING, list: {"type": "array"}}
_JSON_SCHEMA: Schema = {"type": "object", "description": "a JSON Schema; one llguidance cannot compile is a 400"}
_RESPONSE_FORMAT: Schema = {
    "oneOf": [
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {
                "type": {"const": "json_schema"},
                "json_schema": {
                    "type": "object",
                    "required": ["schema"],
                    "properties": {"name": optional(STRING), "description": optional(STRING),
                                   "schema": _JSON_SCHEMA, "strict": optional(BOOLEAN)},
                },
            },
        },
    ],
    "description": "json_object / json_schema: the output is constrained by grammar to JSON (matching the schema)",
}
_FUNCTION_NAME: Schema = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_TOOL: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _FUNCTION_NAME, "description": optional(STRING),
                           "parameters": optional(_JSON_SCHEMA), "strict": optional(BOOLEAN)},
        },
    },
}
_TOOL_CALL: Schema = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": STRING,
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"],
                     "properties": {"name": STRING, "arguments": {"type": "string", "description": "a JSON object"}}},
    },
}

# The JSON Schema of each implemented field, as the parser (schemas.py, fields.py) and
# SamplingParams check it. Keys must cover CHAT_FIELDS | COMPLETION_FIELDS.
FIELD_SCHEMAS: dict[str, Schema] = {
    "stream": BOOLEAN,
    "stream_options": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"include_usage": optional(BOOLEAN), "include_obfuscation": {}},
        "description": "only with stream: true",
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2,
                         "description": "OpenAI's: subtracted once from each token already generated"},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2,
                          "description": "OpenAI's: subtracted per occurrence of each token already generated"},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10,
                           "description": "vLLM's: >1 discourages tokens of the prompt and output; 1 is off"},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": INT64_MAX,
                   "description": "EOS and stop_token_ids are masked until this many tokens are out (<= max_tokens)"},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES, "description": "choices to generate"},
    "logprobs": {"type": "boolean", "description": "the generated tokens' log-probabilities"},
    "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                     "description": "alternatives per token; needs logprobs: true"},
    "cache_salt": {"type": "string", "description": "requests with different salts never share cached KV"},
    "max_tokens": POSITIVE_INT64,
    "max_completion_tokens": {**POSITIVE_INT64, "description": "wins over max_tokens"},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": INT64_MAX, "description": "0 or -1: off"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": INT64,
    "stop": {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING, "maxItems": 16}]},
    "stop_token_ids": {"type": "array", "items": INT64},
    "ignore_eos": BOOLEAN,
    "user": {"type": "string", "description": "names the conversation: its KV is kept longest"},
    "messages": {"type": "array", "items": ref("ChatMessage"), "minItems": 1},
    "response_format": _RESPONSE_FORMAT,
    "tools": {"type": "array", "items": _TOOL, "description": "function names must differ"},
    "tool_choice": {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {"type": "object", "required": ["type", "function"],
             "properties": {"type": {"const": "function"},
                            "function": {"type": "object", "required": ["name"], "properties": {"name": STRING}}}},
        ],
        "description": "required, or a function (one of tools): the output is constrained to tool calls",
    },
    "parallel_tool_calls": {"type": "boolean", "description": "false: at most one call (with tool_choice required)"},
    "chat_template_kwargs": {
        "type": "object",
        "propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}},
        "description": "variables for the model's chat template",
    },
}


def build_openapi(*, model_id: str, vocab_size: int | None, auth: bool) -> Schema:
    token_id: Schema = {"type": "integer", "minimum": 0}
    if vocab_size is not None:
        token_id["maximum"] = vocab_size - 1
    token_ids: Schema = {"type": "array", "items": token_id, "minItems": 1}
    model: Schema = {"enum": [model_id], "description": "the served model (the default); any other name is 404"}
    logit_bias: Schema = {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "propertyNames": {"pattern": token_id_pattern(vocab_size)},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "token id (a decimal string) -> bias added to its logit",
    }
    fields = {**FIELD_SCHEMAS, "model": model, "logit_bias": logit_bias}
    completion_logprobs: Schema = {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "the sampled token's logprob and this many alternatives"}
    prompt: Schema = {
        "anyOf": [
            STRING,
            token_ids,
            {"type": "array", "items": STRING, "minItems": 1, "maxItems": 1},
            {"type": "array", "items": token_ids, "minItems": 1, "maxItems": 1},
        ],
        "description": "one prompt: text, token ids, or a one-item list of either",
    }
    schemas: dict[str, Schema] = {
        "ChatCompletionRequest": _request_body(CHAT_FIELDS, UNSUPPORTED_CHAT, fields, required=["messages"],
                                               conditions=[_TOP_LOGPROBS_NEEDS_LOGPROBS]),
        "CompletionRequest": _request_body(
            COMPLETION_FIELDS, UNSUPPORTED_COMPLETION, {**fields, "prompt": prompt, "logprobs": completion_logprobs},
            required=["prompt"],
        ),
        "ChatMessage": _chat_message(),
        "TokenizeRequest": {
            "oneOf": [
                {
                    "type": "object",
                    "title": "text, as /v1/completions encodes it",
                    "required": ["prompt"],
                    "properties": {
                        "model": optional(model),
                        "prompt": STRING,
                        "add_special_tokens": optional(BOOLEAN),
                        "messages": NULL,
                        "add_generation_prompt": NULL,
                        "chat_template_kwargs": NULL,
                        "tools": NULL,
                        "tool_choice": NULL,
                        "parallel_tool_calls": NULL,
                    },
                },
                {
                    "type": "object",
                    "title": "a conversation, as /v1/chat/completions renders it",
                    "required": ["messages"],
                    "properties": {
                        "model": optional(model),
                        "messages": FIELD_SCHEMAS["messages"],
                        "add_generation_prompt": optional(BOOLEAN),
                        "chat_template_kwargs": optional(FIELD_SCHEMAS["chat_template_kwargs"]),
                        "tools": optional(FIELD_SCHEMAS["tools"]),
                        "tool_choice": optional(FIELD_SCHEMAS["tool_choice"]),
                        "parallel_tool_calls": optional(FIELD_SCHEMAS["parallel_tool_calls"]),
                        "prompt": NULL,
                        "add_special_tokens": NULL,
                    },
                },
            ]
        },
        "DetokenizeRequest": {
            "type": "object",
            "required": ["tokens"],
            "properties": {"model": optional(model), "tokens": {"type": "array", "items": token_id}},
        },
        "Error": _error(),
        "Usage": _usage(),
        "ChatCompletion": _completion("chat.completion", {
            "type": "object",
            "required": ["index", "message", "finish_reason"],
            "properties": {
                "index": COUNT,
                "message": {
                    "type": "object",
                    "required": ["role", "content"],
                    # content is null when the message only calls tools
                    "properties": {"role": {"const": "assistant"}, "content": optional(STRING),
                                   "tool_calls": {"type": "array", "items": _TOOL_CALL, "minItems": 1}},
                },
                "logprobs": optional({"type": "object", "required": ["content"]}),
                "finish_reason": FINISH_REASON,
            },
        }),
        "Completion": _completion("text_completion", {
            "type": "object",
            "required": ["index", "text", "finish_reason"],
            "properties": {"index": COUNT, "text": STRING, "finish_reason": FINISH_REASON, "logprobs": optional({
                "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"]})},
        }),
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by", "max_model_len"],
            "properties": {
                "id": STRING,
                "object": {"const": "model"},
                "created": {"type": "integer"},
                "owned_by": STRING,
                "max_model_len": {"type": "integer", "minimum": 1},
                "info": {"type": "object"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
        },
        "TokenizeResponse": {
            "type": "object",
            "required": ["count", "max_model_len", "tokens"],
            "properties": {"count": COUNT, "max_model_len": {"type": "integer"}, "tokens": {"type": "array",
                                                                                               "items": token_id}},
        },
        "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": STRING}},
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"enum": [LOADING, READY, DRAINING, STOPPED, FAILED]}},
        },
    }
    security = [{"bearer": []}] if auth else []
    paths = {
        "/v1/chat/completions": {"post": _generation_operation(
            "createChatCompletion", "Chat: one reply to a conversation, whole or streamed (SSE)",
            "ChatCompletionRequest", "ChatCompletion", security)},
        "/v1/completions": {"post": _generation_operation(
            "createCompletion", "Text completion of one prompt, whole or streamed (SSE)",
            "CompletionRequest", "Completion", security)},
        "/tokenize": {"post": _operation(
            "tokenize", "Token ids of a prompt, counted as the generation routes count it", security,
            body="TokenizeRequest", ok=_json_response("the prompt's tokens", "TokenizeResponse"),
            errors=(400, 404, 413))},
        "/detokenize": {"post": _operation(
            "detokenize", "Text of token ids", security, body="DetokenizeRequest",
            ok=_json_response("the text", "DetokenizeResponse"), errors=(400, 404, 413))},
        "/v1/models": {"get": _operation(
            "listModels", "The served model", security, ok=_json_response("a list of one model", "ModelList"))},
        "/v1/models/{model}": {"get": {
            **_operation("retrieveModel", "One model's card", security,
                         ok=_json_response("the model's card", "Model"), errors=(404,)),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": STRING}],
        }},
        "/health": {"get": {
            "operationId": "health",
            "summary": "200 when ready; 503 while loading, draining or after a failed start",
            "responses": {
                "200": _json_response("ready", "Health"),
                "503": {**_json_response("not ready", "Health"), "headers": _RETRY_AFTER},
            },
        }},
        "/metrics": {"get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics (text format)",
            "responses": {"200": {"description": "metrics", "content": {"text/plain": {"schema": STRING}}}},
        }},
        "/openapi.json": {"get": {
            "operationId": "openapi",
            "summary": "This document",
            "responses": {"200": {"description": "OpenAPI 3.1",
                                  "content": {"application/json": {"schema": {"type": "object"}}}}},
        }},
    }
    components: Schema = {"schemas": schemas}
    if auth:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "qml", "version": "1", "description": f"OpenAI-compatible API serving {model_id}"},
        "paths": paths,
        "components": components,
    }


async def openapi_endpoint(request: Request) -> Response:
    # Public, like /health: it describes the API, it holds nothing secret.
    state = request.app.state
    if getattr(state, "openapi", None) is None:
        engine = state.engine
        state.openapi = build_openapi(model_id=engine.model_id,
                                      vocab_size=getattr(engine.tokenizer, "vocab_size", None),
                                      auth=state.auth_enabled)
    return JSONResponse(state.openapi)


# stream_options needs stream: true
_STREAM_OPTIONS_NEED_STREAM: Schema = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}
_TOP_LOGPROBS_NEEDS_LOGPROBS: Schema = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


def token_id_pattern(vocab_size: int | None) -> str:
    """A regular expression for the decimal token ids in [0, vocab_size) (any, without a vocabulary)."""
    if vocab_size is None:
        return "^(0|[1-9][0-9]*)$"
    top = str(vocab_size - 1)
    D = len(top)
    alternatives = ["0"] + [f"[1-9][0-9]{{{n - 1}}}" for n in range(1, D)]
    # D-digit numbers up to top: at each position a smaller digit, then anything
    for i in range(D):
        low, digit = (1 if i == 0 else 0), int(top[i])
        if digit > low:
            alternatives.append(f"{top[:i]}[{low}-{digit - 1}]" + ("[0-9]" * (D - i - 1)))
    if top != "0":
        alternatives.append(top)
    return "^(" + "|".join(alternatives) + ")$"


def _request_body(implemented: frozenset[str], unsupported: dict, field_schemas: dict[str, Schema],
                  required: list[str], conditions: tuple | list = ()) -> Schema:
    properties: dict[str, Schema] = {}
    for name in sorted(implemented):
        schema = field_schemas[name]  # a KeyError here: a field schemas.py reads but this module does not describe
        properties[name] = schema if name in required else optional(schema)
    for name, (neutral, why) in sorted(unsupported.items()):
        values: list[Any] = []
        for v in neutral.values:
            if v not in values:
                values.append(v)
        properties[name] = {"anyOf": [{"enum": values}, NULL] if values else [NULL], "description": f"{name} {why}"}
    for name in sorted(IGNORED_FIELDS - implemented):
        # ignored for generation; `user` is still read (it names the conversation)
        properties[name] = optional(field_schemas[name]) if name in field_schemas else {}
    return {
        "type": "object",
        "required": required,
        "properties": properties,
        # unknown fields are logged and ignored, as vLLM and llama.cpp do
        "additionalProperties": True,
        "allOf": [_STREAM_OPTIONS_NEED_STREAM, *conditions],
    }


def _chat_message() -> Schema:
    content = {"anyOf": [STRING, {"type": "array", "items": _TEXT_PART}]}
    extras = {name: optional(_EXTRA_TYPES[kind]) for name, kind in MESSAGE_EXTRAS.items()}
    return {
        "type": "object",
        "required": ["role"],
        "properties": {"role": {"enum": list(ROLES)}, "content": optional(content), **extras},
        # content may be null only in an assistant turn (one that only called tools)
        "if": {"properties": {"role": {"const": "assistant"}}},
        "else": {"required": ["content"], "properties": {"content": content}},
    }


def _error() -> Schema:
    return {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string", "minLength": 1},
                    "type": STRING,
                    "param": optional(STRING),
                    "code": optional(STRING),
                },
            }
        },
    }


def _usage() -> Schema:
    return {
        "type": "object",
        "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
        "properties": {
            "prompt_tokens": COUNT,
            "completion_tokens": COUNT,
            "total_tokens": COUNT,
            "prompt_tokens_details": {
                "type": "object", "required": ["cached_tokens"], "properties": {"cached_tokens": COUNT}
            },
        },
    }


def _completion(kind: str, choice: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": STRING,
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": STRING,
            "choices": {"type": "array", "items": choice, "minItems": 1, "maxItems": MAX_CHOICES},
            "usage": ref("Usage"),
        },
    }


# Before OpenAPI 3.2 (itemSchema), an event stream's schema describes one event.
_SSE_EVENT: Schema = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON chunk (or error), or [DONE] last"}},
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": STRING}}
_ERROR_WHEN = {
    400: "bad input, or a prompt too long for the context (code context_length_exceeded)",
    401: "missing or wrong API key",
    404: "unknown model",
    413: "request body over the server's limit",
    500: "an internal fault; the message carries an error id to find in the server log",
    503: "queue full, model loading or server shutting down",
}


def _json_response(description: str, schema: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": ref(schema)}}}


def _operation(operation_id: str, summary: str, security: list, *, ok: Schema, body: str | None = None,
               errors: tuple[int, ...] = ()) -> Schema:
    statuses = sorted({*errors, 500, 503} | ({401} if security else set()))
    responses: dict[str, Schema] = {"200": ok}
    for status in statuses:
        responses[str(status)] = _json_response(_ERROR_WHEN[status], "Error")
        if status == 503:
            responses["503"]["headers"] = _RETRY_AFTER
    operation: Schema = {"operationId": operation_id, "summary": summary, "responses": responses,
                         "security": security}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
    return operation


def _generation_operation(operation_id: str, summary: str, body: str, response: str, security: list) -> Schema:
    ok = _json_response("the whole completion (stream: false)", response)
    ok["description"] = "the completion: JSON, or with stream: true server-sent events ending in data: [DONE]"
    ok["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    return _operation(operation_id, summary, security, ok=ok, body=body, errors=(400, 404, 413))
