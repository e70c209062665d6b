"""Prompt text to token ids, one way for every route.

/v1/chat/completions and /tokenize with ``messages`` render through the model's chat
template; /v1/completions and /tokenize with ``prompt`` encode the text as is. Sharing
these is what makes /tokenize's count the ``prompt_tokens`` a generation would report.
"""

from __future__ import annotations

from typing import Any

from qml_server.errors import bad_request
from qml_server.schemas import check_token_ids
from qml_server.tools import ToolUse, prompt_messages


def chat_prompt_ids(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, template_kwargs: dict[str, Any]
) -> list[int]:
    kwargs = {"add_generation_prompt": add_generation_prompt, **template_kwargs}
    try:
        return list(tokenizer.apply_chat_template(messages, **kwargs))
    except ValueError as exc:
        # ChatTemplateError (a ValueError): the conversation does not fit the model's
        # template, e.g. roles out of the order it insists on. The client's to fix.
        raise bad_request(f"The chat template rejected the messages: {exc}", param="messages") from None


def chat_prompt_ids_with_tools(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolUse | None,
                               add_generation_prompt: bool, template_kwargs: dict[str, Any]) -> list[int]:
    """``chat_prompt_ids`` with the request's tools: given to a template that writes them, else put in a
    system turn (``qml_server.tools.prompt_messages``)."""
    template = getattr(tokenizer, "chat_template", None)
    messages, extra = prompt_messages(messages, tools, bool(getattr(template, "writes_tools", False)))
    return chat_prompt_ids(tokenizer, messages, add_generation_prompt, {**template_kwargs, **extra})


def text_prompt_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def completion_prompt_ids(tokenizer: Any, prompt: str | list[int]) -> list[int]:
    """The ids /v1/completions generates from: the text encoded, or the ids checked."""
    if isinstance(prompt, str):
        ids = text_prompt_ids(tokenizer, prompt)
        if not ids:
            raise bad_request("The prompt is empty", param="prompt")
        return ids
    return check_token_ids(prompt, getattr(tokenizer, "vocab_size", None), "prompt")
