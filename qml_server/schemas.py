"""The request bodies we accept, validated into plain dataclasses.

Policy on fields: a field we implement is type-checked; a field we know but do not
implement is accepted only at its neutral value (``echo: false``, ``best_of: 1``,
``functions: []``...) and otherwise rejected with 400, so a client never silently gets
something other than what it asked for. A field nobody defines is logged and
ignored, as vLLM and llama.cpp do (clients and SDKs add fields of their own); a
few known fields that cannot change the output (``user``, ``metadata``, ``store``,
...) are ignored silently.
"""

from __future__ import annotations

import logging
import math
import re
from array import array
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from qml_runtime.constrained import ANY_JSON_OBJECT
from qml_runtime.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from qml_server.errors import bad_request, context_length_exceeded, invalid_type, missing_field, model_not_found
from qml_server.fields import (
    JsonObject,
    int_list,
    opt_bool,
    opt_float,
    opt_int,
    opt_object,
    opt_str,
    required,
    str_list,
    token_ids,
)
from qml_server.tools import ToolUse, parse_tool_use, schema_grammar, tool_call_grammar

log = logging.getLogger("qml.server")

# Fields that cannot change what is generated; kept so clients that always send them work.
# (`user` is also read: it names the conversation, see generation.start_generation.)
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)


@dataclass(frozen=True)
class Neutral:
    """The values (besides null) at which a known but unimplemented field changes nothing."""

    values: tuple[Any, ...]

    def __call__(self, value: Any) -> bool:
        return value is None or any(_same_json(value, n) for n in self.values)


def _same_json(a: Any, b: Any) -> bool:
    # Numbers compare as JSON numbers (1.0 is 1), but `True == 1` must not pass for n,
    # nor `0.0 == False`: other values compare with their type.
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and bool not in (type(a), type(b)):
        return a == b
    return type(a) is type(b) and a == b


def _is(*neutral: Any) -> Neutral:
    return Neutral(neutral)


# Known, not implemented: field -> (the values it is accepted at, what to tell the client otherwise).
_NOT_YET = "is not supported yet"
UNSUPPORTED_CHAT: dict[str, tuple[Neutral, str]] = {
    "functions": (_is([]), _NOT_YET + " (the deprecated form: send 'tools')"),
    "function_call": (_is("none"), _NOT_YET + " (the deprecated form: send 'tool_choice')"),
    "modalities": (_is(["text"]), _NOT_YET + " (text only)"),
    "audio": (_is(), _NOT_YET + " (text only)"),
    "prediction": (_is(), _NOT_YET),
    "reasoning_effort": (_is(), _NOT_YET),
    "web_search_options": (_is(), _NOT_YET),
}
UNSUPPORTED_COMPLETION: dict[str, tuple[Neutral, str]] = {
    "best_of": (_is(1), "must be 1: only one candidate per request is supported"),
    "echo": (_is(False), _NOT_YET),
    "suffix": (_is(""), _NOT_YET),
}

MAX_CHOICES = 16  # n: each choice is a sequence of its own in the engine's batch
# cache_salt (as in vLLM): requests with different salts never share cached KV pages
_GENERAL = {"model", "stream", "stream_options", "cache_salt", "n", "logprobs"}
_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
             "response_format"}
# The fields each body implements (type-checked, used); qml_server.openapi documents each one.
CHAT_FIELDS = frozenset(
    _GENERAL | _SAMPLING | {"messages", "max_completion_tokens", "chat_template_kwargs", "top_logprobs", "tools",
                            "tool_choice", "parallel_tool_calls"}
)
COMPLETION_FIELDS = frozenset(_GENERAL | _SAMPLING | {"prompt"})
TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "add_special_tokens", "messages", "add_generation_prompt", "chat_template_kwargs",
     "tools", "tool_choice", "parallel_tool_calls"}
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})

ROLES = ("system", "developer", "user", "assistant", "tool")
# Message keys a chat template may use besides role/content, with the JSON type each must
# have; passed through to the template, which would otherwise meet types it never expected.
MESSAGE_EXTRAS = {"name": str, "tool_call_id": str, "tool_calls": list, "reasoning_content": str}
# Variables the renderer sets itself; a chat_template_kwargs key may not collide with them.
RESERVED_TEMPLATE_KWARGS = ("messages",)


@dataclass(frozen=True)
class Sampling:
    """The generation controls shared by both endpoints (max_tokens still unresolved)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per token; None: no logprobs at all
    n: int = 1
    grammar: str | None = None  # the output's grammar (response_format, or a forced tool call)

    def to_params(self, max_tokens: int) -> SamplingParams:
        # SamplingParams checks ranges itself and raises InvalidParameter(param, message),
        # which the endpoint wrapper turns into a 400 naming the field.
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            grammar=self.grammar,
        )


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    tools: ToolUse | None = None  # None: no tools, or tool_choice "none"


@dataclass(frozen=True)
class TokenizeRequest:
    """Either ``prompt`` (as /v1/completions tokenizes it) or ``messages`` (as chat does)."""

    model: str | None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: ToolUse | None = None  # rendered as chat renders them: the count includes them


@dataclass(frozen=True)
class DetokenizeRequest:
    model: str | None
    tokens: list[int]


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None


def parse_chat_request(body: JsonObject) -> ChatRequest:
    _check_field_names(body, CHAT_FIELDS, UNSUPPORTED_CHAT)
    sampling = _parse_sampling(body)
    # max_completion_tokens is the newer name; when both are sent it is the one meant.
    newer = _opt_max_tokens(body, "max_completion_tokens")
    if newer is not None:
        sampling = replace(sampling, max_tokens=newer)
    # chat: `logprobs: true` turns them on, `top_logprobs: k` adds the k best alternatives
    top = _opt_range(body, "top_logprobs", 0, MAX_LOGPROBS)
    if opt_bool(body, "logprobs"):
        sampling = replace(sampling, logprobs=top or 0)
    elif top is not None:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tools = parse_tool_use(body)
    if tools is not None and tools.forced:
        if sampling.grammar is not None:
            raise bad_request("'response_format' cannot be combined with a 'tool_choice' that forces a call: both "
                              "would constrain the whole output", param="response_format")
        sampling = replace(sampling, grammar=tool_call_grammar(tools))
    stream, include_usage = _parse_stream(body)
    return ChatRequest(
        model=opt_str(body, "model"),
        messages=_parse_messages(required(body, "messages")),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=opt_str(body, "user"),
        chat_template_kwargs=_template_kwargs(body),
        cache_salt=opt_str(body, "cache_salt"),
        tools=tools,
    )


def parse_completion_request(body: JsonObject) -> CompletionRequest:
    _check_field_names(body, COMPLETION_FIELDS, UNSUPPORTED_COMPLETION)
    stream, include_usage = _parse_stream(body)
    # completions: `logprobs: k` (the legacy form) gives the sampled token's and the k best
    sampling = replace(_parse_sampling(body), logprobs=_opt_range(body, "logprobs", 0, MAX_LOGPROBS))
    return CompletionRequest(
        model=opt_str(body, "model"),
        prompt=_parse_prompt(required(body, "prompt")),
        sampling=sampling,
        stream=stream,
        include_usage=include_usage,
        user=opt_str(body, "user"),
        cache_salt=opt_str(body, "cache_salt"),
    )


_CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice", "parallel_tool_calls")


def parse_tokenize_request(body: JsonObject) -> TokenizeRequest:
    _check_field_names(body, TOKENIZE_FIELDS, {})
    model = opt_str(body, "model")
    if body.get("messages") is None:
        for name in _CHAT_ONLY:
            if body.get(name) is not None:
                raise bad_request(f"'{name}' is only allowed with 'messages'", param=name)
        if body.get("prompt") is None:
            raise bad_request(
                "Send either 'prompt' (text) or 'messages' (a conversation)",
                param="prompt",
                code="missing_required_parameter",
            )
        add_special_tokens = opt_bool(body, "add_special_tokens")
        return TokenizeRequest(
            model=model,
            prompt=opt_str(body, "prompt"),
            add_special_tokens=True if add_special_tokens is None else add_special_tokens,
        )
    for name in ("prompt", "add_special_tokens"):
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not allowed with 'messages'; send one or the other", param=name)
    add_generation_prompt = opt_bool(body, "add_generation_prompt")
    return TokenizeRequest(
        model=model,
        messages=_parse_messages(body["messages"]),
        add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
        chat_template_kwargs=_template_kwargs(body),
        tools=parse_tool_use(body),
    )


def parse_detokenize_request(body: JsonObject, vocab_size: int | None) -> DetokenizeRequest:
    _check_field_names(body, DETOKENIZE_FIELDS, {})
    value = required(body, "tokens")
    tokens = [] if value == [] else token_ids(value)
    if tokens is None:
        raise invalid_type("tokens", "a list of integers", value)
    return DetokenizeRequest(model=opt_str(body, "model"), tokens=check_token_ids(tokens, vocab_size, "tokens"))


def check_token_ids(ids: list[int], vocab_size: int | None, param: str) -> list[int]:
    """``ids`` if every one is a token of the vocabulary, else a 400 naming the first that is not.

    Ids go straight to an embedding lookup or the tokenizer's Rust side; out of range,
    they must be refused here rather than fail there.
    """
    if _valid_token_values(ids, vocab_size) is not None:
        return ids
    _name_bad_token_id(ids, vocab_size, param)
    return ids


def token_id_array(ids: list[int], vocab_size: int | None, param: str) -> array:
    """``check_token_ids``, the ids returned as a uint32 ``array("I")`` (what the engine takes a prompt as,
    with no check of each id's type: ~0.5 ms of 27k ids), made from the checked int64 values (~0.03 ms)."""
    values = _valid_token_values(ids, vocab_size)
    # (in range of a vocabulary of at most 2^32 ids, an id fits in 32 bits; else it is checked for that here)
    if values is None or ((vocab_size is None or vocab_size > 2**32) and values.size and values.max() >= 2**32):
        _name_bad_token_id(ids, vocab_size, param)
        raise bad_request(f"{param}: token ids must be integers in [0, 2^32)", param=param)
    out = array("I")
    out.frombytes(values.astype(np.uint32).tobytes())
    return out


def _valid_token_values(ids: list[int], vocab_size: int | None):
    """The ids as int64 values if every one is in [0, vocab_size), else None."""
    try:
        # The ids in one C-level pass (int64) and their range by numpy: a loop over them took 0.6 ms
        # for 26,900 ids (CPU), this 0.3 ms. Only when one is bad does the loop run, to name the first.
        values = np.frombuffer(array("q", ids), dtype=np.int64)
        if values.size == 0 or (values.min() >= 0 and (vocab_size is None or values.max() < vocab_size)):
            return values
    except (OverflowError, TypeError):
        pass  # beyond int64 (or not an int at all): the loop decides
    return None


def _name_bad_token_id(ids: list[int], vocab_size: int | None, param: str) -> None:
    """A 400 naming the first id that is not a token of the vocabulary."""
    for i, token in enumerate(ids):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            limit = f" [0, {vocab_size})" if vocab_size is not None else " (non-negative)"
            raise bad_request(f"{param}[{i}] = {token} is not a valid token id{limit}", param=param)


def check_model(requested: str | None, served: str) -> None:
    # A missing model means "whatever is served", as single-model servers usually allow.
    if requested is not None and requested != served:
        raise model_not_found(requested)


def resolve_max_tokens(requested: int | None, prompt_tokens: int, context_length: int, param: str) -> int:
    """The completion budget: what was asked, or all the room the context has left."""
    if requested is None:
        if prompt_tokens >= context_length:
            raise context_length_exceeded(prompt_tokens, None, context_length, param)
        return context_length - prompt_tokens
    if prompt_tokens + requested > context_length:
        raise context_length_exceeded(prompt_tokens, requested, context_length, param)
    return requested


def _check_field_names(
    body: JsonObject, known: frozenset[str], unsupported: dict[str, tuple[Neutral, str]]
) -> None:
    for name, value in body.items():
        if name in known or name in IGNORED_FIELDS:
            continue
        if name in unsupported:
            accepts, why = unsupported[name]
            if not accepts(value):
                raise bad_request(f"'{name}' {why}", param=name, code="unsupported_parameter")
            continue
        # vLLM and llama.cpp accept fields they do not know (clients add their own); say so in the log
        log.warning("ignoring unrecognized request field %r", name)


def _parse_sampling(body: JsonObject) -> Sampling:
    top_k = opt_int(body, "top_k")
    defaults = Sampling()
    return Sampling(
        max_tokens=_opt_max_tokens(body, "max_tokens"),
        temperature=_or(opt_float(body, "temperature"), defaults.temperature),
        top_p=_or(opt_float(body, "top_p"), defaults.top_p),
        # -1 is how vLLM clients spell "top-k off"; our SamplingParams spells it 0.
        top_k=0 if top_k in (None, -1) else top_k,
        min_p=_or(opt_float(body, "min_p"), defaults.min_p),
        seed=opt_int(body, "seed"),
        stop=str_list(body.get("stop"), "stop"),
        stop_token_ids=int_list(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=bool(opt_bool(body, "ignore_eos")),
        presence_penalty=_float_range(body, "presence_penalty", -2.0, 2.0, defaults.presence_penalty),
        frequency_penalty=_float_range(body, "frequency_penalty", -2.0, 2.0, defaults.frequency_penalty),
        repetition_penalty=_repetition_penalty(body),
        logit_bias=_logit_bias(body),
        min_tokens=_or(_opt_range(body, "min_tokens", 0, None), 0),
        n=_or(_opt_range(body, "n", 1, MAX_CHOICES), 1),
        grammar=_response_format_grammar(body),
    )


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _response_format_grammar(body: JsonObject) -> str | None:
    """The grammar ``response_format`` asks for (None for plain text). ``strict`` is accepted and
    changes nothing: the schema is always enforced."""
    value = opt_object(body, "response_format")
    if value is None:
        return None
    kind = value.get("type")
    if kind is None:
        raise missing_field("response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(ANY_JSON_OBJECT, "response_format")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got {kind!r}",
                          param="response_format.type")
    spec = value.get("json_schema")
    if spec is None:
        raise missing_field("response_format.json_schema")
    if not isinstance(spec, dict):
        raise invalid_type("response_format.json_schema", "an object", spec)
    for key, wanted, expected in (("name", str, "a string"), ("description", str, "a string"),
                                  ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], wanted):
            raise invalid_type(f"response_format.json_schema.{key}", expected, spec[key])
    schema = spec.get("schema")
    if schema is None:
        raise missing_field("response_format.json_schema.schema")
    if not isinstance(schema, dict):
        raise invalid_type("response_format.json_schema.schema", "an object (a JSON Schema)", schema)
    return schema_grammar(schema, "response_format.json_schema.schema")


def _opt_range(body: JsonObject, name: str, low: int, high: int | None) -> int | None:
    value = opt_int(body, name)
    if value is not None and (value < low or (high is not None and value > high)):
        bound = f"in [{low}, {high}]" if high is not None else f"at least {low}"
        raise bad_request(f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _float_range(body: JsonObject, name: str, low: float, high: float, default: float) -> float:
    value = opt_float(body, name)
    if value is not None and not low <= value <= high:
        raise bad_request(f"'{name}' must be in [{low:g}, {high:g}], got {value:g}", param=name)
    return _or(value, default)


def _repetition_penalty(body: JsonObject) -> float:
    value = opt_float(body, "repetition_penalty")
    if value is not None and not 0.0 < value <= 10.0:
        raise bad_request(f"'repetition_penalty' must be in (0, 10] (1 is off), got {value:g}",
                          param="repetition_penalty")
    return _or(value, 1.0)


_TOKEN_KEY = re.compile(r"0|[1-9][0-9]*")


def _logit_bias(body: JsonObject) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` -> ((id, bias), ...). Ids are checked against the vocabulary later
    (``check_token_ids``), where the engine's vocabulary is known."""
    value = opt_object(body, "logit_bias") or {}
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}",
                          param="logit_bias")
    entries = []
    for key, bias in value.items():
        where = f"logit_bias.{key}"
        if not _TOKEN_KEY.fullmatch(key):
            raise bad_request(f"'logit_bias' keys must be token ids written as decimal strings, got {key!r}",
                              param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise invalid_type(where, "a number", bias)
        number = float(bias)
        if not -100.0 <= number <= 100.0:
            raise bad_request(f"'{where}' must be in [-100, 100], got {number:g}", param=where)
        entries.append((int(key), number))
    return tuple(entries)


def _opt_max_tokens(body: JsonObject, name: str) -> int | None:
    # Checked here, not only when the budget is resolved: a bad max_tokens is refused
    # even when max_completion_tokens overrides it.
    value = opt_int(body, name)
    if value is not None and value < 1:
        raise bad_request(f"'{name}' must be at least 1, got {value}", param=name)
    return value


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _parse_stream(body: JsonObject) -> tuple[bool, bool]:
    stream = bool(opt_bool(body, "stream"))
    options = opt_object(body, "stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for key in options:
        # include_obfuscation only pads chunks against side channels on OpenAI's side.
        if key not in ("include_usage", "include_obfuscation"):
            raise bad_request(
                f"Unrecognized stream option: {key}", param=f"stream_options.{key}", code="unknown_parameter"
            )
    include_usage = opt_bool(options, "include_usage")
    return stream, bool(include_usage)


def _template_kwargs(body: JsonObject) -> dict[str, Any]:
    kwargs = opt_object(body, "chat_template_kwargs") or {}
    for name in RESERVED_TEMPLATE_KWARGS:
        if name in kwargs:
            raise bad_request(
                f"'chat_template_kwargs' may not set '{name}'", param=f"chat_template_kwargs.{name}"
            )
    return kwargs


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid_type("messages", "an array of message objects", value)
    if not value:
        raise bad_request("'messages' must contain at least one message", param="messages")
    return [_parse_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _parse_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise invalid_type(where, "an object", message)
    role = message.get("role")
    if role is None:
        raise missing_field(f"{where}.role")
    if role not in ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role")
    content = message.get("content")
    # An assistant turn that only called tools has null content.
    if content is None and role != "assistant":
        raise missing_field(f"{where}.content")
    parsed: dict[str, Any] = {"role": role, "content": _content_text(content, f"{where}.content")}
    for key, kind in MESSAGE_EXTRAS.items():
        value = message.get(key)
        if value is None:
            continue
        if not isinstance(value, kind):
            raise invalid_type(f"{where}.{key}", "a string" if kind is str else "an array", value)
        parsed[key] = value
    return parsed


def _content_text(content: Any, where: str) -> str:
    """Content as one string: a string as is, or the text parts joined by newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_type(where, "a string or an array of content parts", content)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise invalid_type(f"{where}[{i}]", "a content part object", part)
        kind = part.get("type")
        if kind != "text":
            raise bad_request(
                f"Content part type {kind!r} is not supported; only 'text' parts are",
                param=f"{where}[{i}].type",
                code="unsupported_parameter",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid_type(f"{where}[{i}].text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _parse_prompt(value: Any) -> str | list[int]:
    """One prompt: a string, a list of token ids, or either wrapped in a one-item list."""
    if isinstance(value, str):
        return value
    ids = token_ids(value)
    if ids is not None:
        return ids
    if isinstance(value, list) and len(value) == 1:
        if isinstance(value[0], str):
            return value[0]
        ids = token_ids(value[0])
        if ids is not None:
            return ids
    if isinstance(value, list) and len(value) > 1 and all(isinstance(v, (str, list)) for v in value):
        raise bad_request("Only one prompt per request is supported", param="prompt", code="unsupported_parameter")
    raise invalid_type("prompt", "a string, a list of token ids, or a one-item list of either", value)
