"""Prompt text to token ids, one way for every route.

/v1/chat/completions and /tokenize with ``messages`` render through the model's chat
template; /v1/completions and /tokenize with ``prompt`` encode the text as is. Sharing
these is what makes /tokenize's count the ``prompt_tokens`` a generation would report.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from qml_server.errors import bad_request
from qml_server.replies import ReplyMemory
from qml_server.schemas import token_id_array
from qml_server.tools import ToolUse, prompt_messages


@dataclass
class ChatPrompt:
    """A rendered chat prompt: its ids, and its text when the tokenizer renders apart from encoding
    (what ``ReplyMemory`` keys on; None for a tokenizer that only offers ``apply_chat_template``). The ids
    of a rendered text are a uint32 ``array("I")``: the engine takes them without a check per id."""

    ids: list[int] | array
    text: str | None = None


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolUse | None, add_generation_prompt: bool,
                template_kwargs: dict[str, Any], replies: ReplyMemory | None = None,
                tenant: str = "") -> ChatPrompt:
    """The request's conversation through the chat template (with its tools: given to a template that
    writes them, else put in a system turn, ``qml_server.tools.prompt_messages``), then encoded; with
    ``replies``, a history that starts with a kept reply reuses the ids the model generated for it."""
    template = getattr(tokenizer, "chat_template", None)
    messages, extra = prompt_messages(messages, tools, bool(getattr(template, "writes_tools", False)))
    kwargs = {"add_generation_prompt": add_generation_prompt, **template_kwargs, **extra}
    try:
        if not (hasattr(tokenizer, "render_chat") and hasattr(tokenizer, "encode_chat")):
            return ChatPrompt(list(tokenizer.apply_chat_template(messages, **kwargs)))
        text = tokenizer.render_chat(messages, **kwargs)
    except ValueError as exc:
        # ChatTemplateError (a ValueError): the conversation does not fit the model's
        # template, e.g. roles out of the order it insists on. The client's to fix.
        raise bad_request(f"The chat template rejected the messages: {exc}", param="messages") from None
    kept = replies.longest_prefix(tenant, text) if replies is not None else None
    if kept is None:
        return ChatPrompt(array("I", tokenizer.encode_chat(text)), text)
    chars, ids = kept
    ids.extend(tokenizer.encode_chat(text[chars:], continuation=True))
    return ChatPrompt(ids, text)


def text_prompt_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int] | array:
    """The ids /v1/completions generates from: the text encoded, or the ids checked; as a uint32
    ``array("I")``, which the engine takes without checking each id's type again (~0.5 ms for 27k ids)."""
    if isinstance(prompt, str):
        ids = text_prompt_ids(tokenizer, prompt)
        if not ids:
            raise bad_request("The prompt is empty", param="prompt")
        return array("I", ids)
    return token_id_array(prompt, getattr(tokenizer, "vocab_size", None), "prompt")
