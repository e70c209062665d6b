"""Tool calling for /v1/chat/completions: the request fields, the prompt, and the calls read back.

The wire format of a call is the Hermes one (Qwen, Hermes, and many fine-tunes are trained on
it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- Prompt: a chat template that writes ``tools`` itself (Qwen's does) gets them as its ``tools``
  variable. One that ignores them (SmolLM2's, Gemma's) gets them the way vLLM and llama.cpp
  do it for such models: a system prompt listing the functions and the format above
  (``TOOLS_PROMPT``); earlier calls in the history are written in that format and tool
  results as ``<tool_response>`` user turns.
- ``tool_choice: "required"`` or a named function: the output is constrained by grammar to
  one or more such calls, each call's arguments to its function's ``parameters`` schema, so
  even a tiny model answers with calls that parse.
- ``"auto"``: the output is parsed after the fact; Hermes blocks or a bare JSON object (or
  array) of ``{"name", "arguments" | "parameters"}`` naming a declared function are calls,
  anything else is content. ``"none"``: as if no tools were sent (they are not rendered).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from qml_runtime.constrained import GrammarError, json_schema_grammar, json_schema_with_style, lark_grammar
from qml_server.errors import bad_request, invalid_type, missing_field, unsupported
from qml_server.fields import JsonObject, opt_bool

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
OPEN, CLOSE = "<tool_call>", "</tool_call>"

TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
# OpenAI: a function without `parameters` takes none
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolUse:
    """What a request asks of tools (never for ``tool_choice: "none"`` or no tools)."""

    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {"name", ...}}, as sent
    choice: str = "auto"  # "auto", "required", or "function" (the one named in `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools)


# --- the request ------------------------------------------------------------------------


def parse_tool_use(body: JsonObject) -> ToolUse | None:
    tools = _parse_tools(body.get("tools"))
    parallel = opt_bool(body, "parallel_tool_calls")
    choice, name = _parse_tool_choice(body.get("tool_choice"), tools)
    if not tools or choice == "none":
        return None
    return ToolUse(tools, choice, name, True if parallel is None else parallel)


def _parse_tools(value: Any) -> tuple[dict[str, Any], ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid_type("tools", "an array of tool objects", value)
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid_type(where, "a tool object", tool)
        if tool.get("type") != "function":
            raise unsupported(f"{where}.type", f"must be 'function' (the only kind of tool supported), "
                                                f"got {tool.get('type')!r}")
        function = tool.get("function")
        if function is None:
            raise missing_field(f"{where}.function")
        if not isinstance(function, dict):
            raise invalid_type(f"{where}.function", "an object", function)
        name = function.get("name")
        if name is None:
            raise missing_field(f"{where}.function.name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad_request(f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                              param=f"{where}.function.name")
        if name in seen:
            raise bad_request(f"Duplicate function name {name!r} in tools", param=f"{where}.function.name")
        seen.add(name)
        for key, kind, expected in (("description", str, "a string"), ("parameters", dict, "an object"),
                                    ("strict", bool, "a boolean")):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise invalid_type(f"{where}.function.{key}", expected, function[key])
        if function.get("parameters") is not None:
            schema_grammar(function["parameters"], f"{where}.function.parameters")
    return tuple(value)


def _parse_tool_choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad_request(f"'tool_choice' must be one of {', '.join(CHOICES)} or a function object, "
                              f"got {value!r}", param="tool_choice")
        if value == "required" and not tools:
            raise bad_request("'tool_choice' 'required' needs 'tools'", param="tool_choice")
        return value, None
    if not isinstance(value, dict):
        raise invalid_type("tool_choice", "a string or an object", value)
    if value.get("type") != "function":
        raise unsupported("tool_choice.type", f"must be 'function', got {value.get('type')!r}")
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid_type("tool_choice.function", "an object with a string 'name'", function)
    name = function["name"]
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"'tool_choice' names the function {name!r}, which is not in 'tools'",
                          param="tool_choice.function.name")
    return "function", name


def schema_grammar(schema: dict[str, Any], param: str) -> str:
    """The grammar of a request's JSON schema (the field ``param``), or a 400 saying why it has none."""
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise bad_request(f"Invalid JSON schema in '{param}': {exc}", param=param) from None


def tool_call_grammar(use: ToolUse) -> str:
    """The grammar of what a forced tool choice may answer: Hermes blocks, one (a named function, or
    ``parallel_tool_calls: false``) or more, each with a declared name and arguments that match its
    ``parameters``. Lark with each schema embedded by ``%json``, so each keeps its own ``$ref`` root."""
    tools = [t for t in use.tools if use.name in (None, t["function"]["name"])]
    calls = []
    lines = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = json.dumps(f'{OPEN}\n{{"name": {json.dumps(function["name"])}, "arguments": ')
        schema = json_schema_with_style(function.get("parameters") or NO_PARAMETERS)
        lines.append(f'call_{i}: {head} args_{i} "}}\\n{CLOSE}"')
        lines.append(f"args_{i}: %json {json.dumps(schema)}")
        calls.append(f"call_{i}")
    repeat = ' ("\\n" call)*' if use.parallel and use.name is None else ""
    lark = "\n".join([f"start: call{repeat}", f"call: {' | '.join(calls)}", *lines])
    try:
        return lark_grammar(lark)
    except GrammarError as exc:  # the schemas were checked one by one: together they hit a limit
        raise bad_request(f"The tools' schemas are too complex to constrain the output: {exc}",
                          param="tools") from None


# --- the prompt -------------------------------------------------------------------------


def prompt_messages(messages: list[dict[str, Any]], use: ToolUse | None,
                    template_writes_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render for ``use`` (see the module docstring)."""
    if use is None:
        return messages, {}
    if template_writes_tools:
        return messages, {"tools": list(use.tools)}
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in use.tools)
    system = TOOLS_PROMPT.format(tools=listing)
    out = [_plain_turn(m) for m in messages]
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}" if out[0]["content"] else system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _plain_turn(message: dict[str, Any]) -> dict[str, Any]:
    """A turn of a tool conversation as text, for a template that knows nothing of tools."""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    blocks = [message["content"]] if message["content"] else []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass  # written as the string it is
            body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
            blocks.append(f"{OPEN}\n{body}\n{CLOSE}")
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": "\n".join(blocks)}


# --- the output -------------------------------------------------------------------------

_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def parse_tool_calls(text: str, names: frozenset[str]) -> tuple[str | None, list[dict[str, Any]]] | None:
    """(content before the calls or None, the calls in OpenAI's shape) if ``text`` holds tool calls of
    declared functions, else None (the text is plain content). All or nothing: one block that does not
    parse, or names an undeclared function, makes the whole text content."""
    start = text.find(OPEN)
    if start >= 0:
        bodies = [m.group(1).strip() for m in _BLOCK.finditer(text, start)]
        content = text[:start].strip() or None
    else:
        stripped = text.strip()
        fenced = _FENCE.match(stripped)
        bodies = [fenced.group(1) if fenced else stripped]
        content = None
        if not bodies[0].startswith(("{", "[")):
            return None
    calls = []
    for body in bodies:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        for call in value if isinstance(value, list) else [value]:
            parsed = _call(call, names)
            if parsed is None:
                return None
            calls.append(parsed)
    return (content, calls) if calls else None


def _call(value: Any, names: frozenset[str]) -> dict[str, Any] | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


class ToolCallStream:
    """Splits one streamed choice into content to send now and tool calls found at the end.

    Content streams as it comes, except what may be the start of a call: a ``<tool_call>`` (and
    what follows it), a partial tag at the end of the text so far, or, when the first non-blank
    character is ``{``, ``[`` or a code fence, the whole answer (it may be a bare JSON call). A
    forced choice holds everything. ``finish`` parses what was held: calls, or content after all.
    """

    def __init__(self, use: ToolUse):
        self.use = use
        self.sent = ""  # content already sent
        self.held = ""
        self.holding_all = use.forced

    def feed(self, text: str) -> str:
        self.held += text
        if self.holding_all:
            return ""
        if not self.sent:
            lead = self.held.lstrip()
            if len(lead) < 3 and "```".startswith(lead):  # blank so far, or what may open a code fence
                return ""
            if lead.startswith(("{", "[", "```")):
                self.holding_all = True
                return ""
        cut = self.held.find(OPEN)
        if cut < 0:
            cut = len(self.held) - _partial_tag(self.held)
        if not self.sent and not self.held[:cut].strip():
            cut = 0  # blank lines before a call are not content (the whole answer's parse drops them too)
        out, self.held = self.held[:cut], self.held[cut:]
        if self.held.lstrip().startswith(OPEN):
            self.holding_all = True
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to send, the tool calls); the calls are [] when the output had none."""
        parsed = parse_tool_calls(self.sent + self.held, self.use.names)
        if parsed is None:
            return self.held, []
        return "", parsed[1]


def _partial_tag(text: str) -> int:
    """The length of the longest end of ``text`` that ``<tool_call>`` starts with."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
