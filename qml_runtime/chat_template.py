"""Chat templates: the Jinja programs that model files ship to turn messages into a prompt.

A template comes from a GGUF (``tokenizer.chat_template``) or a Hugging Face folder and is
untrusted code, so it runs in Jinja's immutable sandbox. The environment reproduces the one
Hugging Face renders with, because the templates are written (and tested by their authors)
against it: ``trim_blocks`` and ``lstrip_blocks``, ``{% break %}``/``{% continue %}``,
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text, a
``{% generation %}`` block, and the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, ``bos_token`` and ``eos_token``.

Errors a caller can cause (a conversation the template rejects through ``raise_exception``,
or one it cannot render) surface as ``ChatTemplateError``, a ``ValueError``, so a server can
answer them with HTTP 400.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "ChatTemplateSyntaxError"]

# Older names for a message's reasoning text; templates read `reasoning_content` (and gpt-oss
# reads `thinking`), so every name is filled in from whichever one the client sent.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The template refused or failed to render a conversation (the caller's input is at fault)."""


class ChatTemplateSyntaxError(ChatTemplateError):
    """The template itself is not valid Jinja; raised when the template is built."""


class _TemplateRaised(jinja2.TemplateError):
    """Carries a ``raise_exception(...)`` message out of the render, apart from Jinja's own errors."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text for training masks.

    Inference needs only the text, so the block renders its body unchanged; without the tag the
    templates that use it would not even parse.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _GuardedNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, which are the road to interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no named self, as in Jinja: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _GuardedNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set the attribute {name!r}")


class _DictFactory:
    """Stands in for the ``dict`` builtin: templates can build dicts, but get no handle on the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        return dict.fromkeys(keys, value)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own filter escapes <, >, & and ' for HTML, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain(value: Any) -> Any:
    """A copy built only of JSON-like types, so the template sees no methods of rich objects.

    Pydantic models and dataclasses (what client libraries hand over) become dicts; anything
    else unknown becomes an inert ``<TypeName>`` string.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_message(message: Any) -> dict:
    message = _plain(message)
    if not isinstance(message, dict):
        raise ChatTemplateError(f"each message must be an object with a role, got {message!r}")
    # OpenAI clients send `"content": null` beside tool calls; templates test for a missing key,
    # and would otherwise print the word "None".
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, failing at the first unsafe attribute instead of at its use.

    The stock sandbox hands back an undefined value that prints as "" and only raises when
    used further; a template reaching for ``__class__`` or ``list.append`` is broken or
    hostile either way, so it should fail where it does it.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"a chat template may not access {attribute!r} of a {type(obj).__name__} object"
        )


def _build_environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _GuardedNamespace
    env.globals["dict"] = _DictFactory()
    return env


_ENVIRONMENT = _build_environment()


class ChatTemplate:
    """A compiled chat template.

    ``source`` is the Jinja text; ``bos_token``/``eos_token`` are the strings the template may
    write as ``{{ bos_token }}`` (left undefined, i.e. empty, when the model has none).
    """

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _ENVIRONMENT.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateSyntaxError(f"chat template syntax error at line {exc.lineno}: {exc.message}") from exc

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` (``tools``, ``documents``,
        ``enable_thinking``, ...) become template variables and override the special tokens."""
        variables: dict[str, Any] = {}
        # Only tokens the model has: a None would render as the text "None".
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        variables.update(_plain(extra))
        # Templates test `tools is not none`, so these are always defined, as Hugging Face does.
        variables.setdefault("tools", None)
        variables.setdefault("documents", None)
        variables["messages"] = [_normalize_message(m) for m in messages]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**variables)
        except _TemplateRaised as exc:
            raise ChatTemplateError(exc.message or "the chat template rejected the conversation") from exc
        except jinja2.exceptions.SecurityError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as exc:
            # Rendering fails on conversations the template was not written for (a missing key, a
            # content list where a string was expected, ...): the request's fault, not the server's.
            raise ChatTemplateError(f"the chat template could not render this conversation: {exc}") from exc

    @functools.cached_property
    def writes_tools(self) -> bool:
        """Whether the template writes the ``tools`` it is given into the prompt (many ignore them).

        Found by rendering once with a made-up tool and looking for its name, as llama.cpp probes
        a template's capabilities: reading the source for "tools" would be fooled by templates that
        only mention the word.
        """
        probe = {"type": "function", "function": {"name": "qml_probe_function", "description": "",
                                                  "parameters": {"type": "object", "properties": {}}}}
        try:
            text = self.render([{"role": "user", "content": "hi"}], tools=[probe])
        except (ChatTemplateError, jinja2.exceptions.SecurityError):
            return False
        return "qml_probe_function" in text

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars, bos_token={self.bos_token!r}, eos_token={self.eos_token!r})"
