"""POST /v1/chat/completions."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_runtime import turn_trace
from qml_server.errors import api_endpoint, bad_request
from qml_server.fields import read_json_object
from qml_server.generation import (
    announce_request,
    collect,
    first_outputs,
    log_request,
    request_tenant,
    sse_completion_events,
    start_generation,
    usage,
)
from qml_server.logprobs import TokenText, chat_logprobs
from qml_server.prompts import ChatPrompt, chat_prompt
from qml_server.replies import ReplyMemory
from qml_server.schemas import ChatRequest, check_model, check_token_ids, parse_chat_request, resolve_max_tokens
from qml_server.sse import EventStreamResponse
from qml_server.tools import ToolCallStream, parse_tool_calls


INLINE_RENDER = os.environ.get("QML_INLINE_RENDER", "1") != "0"  # (0: always in the thread pool)


@api_endpoint
async def chat_completions(request: Request) -> Response:
    started = time.monotonic()
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    turn_trace.stamp(request_id, "handler")
    announce_request(request)
    engine = request.app.state.engine
    req = parse_chat_request(await read_json_object(request))
    check_model(req.model, engine.model_id)
    check_token_ids([t for t, _ in req.sampling.logit_bias], getattr(engine.tokenizer, "vocab_size", None),
                    "logit_bias")
    # Templates and tokenizers are CPU work that can take a while on long histories: off the event loop,
    # so that other streams keep flowing, unless there are none (an idle engine): there and back through
    # the thread pool took 0.5 ms of a served turn on an H100's host (benchmarks/results/served-path-2026-12-05.md)
    replies = getattr(request.app.state, "replies", None)
    tenant = request_tenant(request, req.cache_salt) or ""
    if getattr(engine, "idle", False) and INLINE_RENDER:
        prompt = _render_prompt(engine.tokenizer, req, replies, tenant)
    else:
        prompt = await run_in_threadpool(_render_prompt, engine.tokenizer, req, replies, tenant)
    prompt_ids = prompt.ids
    turn_trace.stamp(request_id, "prompt")
    max_tokens = resolve_max_tokens(req.sampling.max_tokens, len(prompt_ids), engine.context_length, "messages")
    params = req.sampling.to_params(max_tokens)

    created = int(time.time())
    log_request(request_id, len(prompt_ids), params, req.stream)
    streams = start_generation(request, prompt_ids, params, request_id, started, req.cache_salt, req.user,
                               req.sampling.n, prompt.text, streamed=req.stream)
    texts = TokenText(engine.tokenizer)

    if req.stream:
        firsts = await first_outputs(request, streams)
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": engine.model_id}
        # per choice: the text that may be a tool call is held back until the choice ends
        splitters = [ToolCallStream(req.tools) for _ in streams] if req.tools is not None else None

        def delta_choice(index: int, out: Any) -> dict[str, Any] | None:
            text = out.text if splitters is None else splitters[index].feed(out.text)
            if not text and not out.logprobs:
                return None
            return _delta(index, {"content": text}, logprobs=chat_logprobs(texts, out.logprobs))

        def finish_choice(index: int, reason: str) -> list[dict[str, Any]]:
            if splitters is None:
                return [_delta(index, {}, reason)]
            rest, calls = splitters[index].finish()
            chunks = [_delta(index, {"content": rest})] if rest else []
            for k, call in enumerate(calls):  # as OpenAI streams a call: id and name, then the arguments
                function = call["function"]
                chunks.append(_delta(index, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                             "function": {"name": function["name"],
                                                                          "arguments": ""}}]}))
                chunks.append(_delta(index, {"tool_calls": [{"index": k,
                                                             "function": {"arguments": function["arguments"]}}]}))
            return [*chunks, _delta(index, {}, "tool_calls" if calls else reason)]

        events = sse_completion_events(
            head=head,
            firsts=firsts,
            streams=streams,
            include_usage=req.include_usage,
            # OpenAI opens every chat stream with the role and an empty content.
            opening_choice=lambda index: _delta(index, {"role": "assistant", "content": ""}),
            delta_choice=delta_choice,
            finish_choice=finish_choice,
        )
        return EventStreamResponse(events, trace_id=request_id)

    done = await collect(request, streams)
    turn_trace.done(request_id)
    choices = []
    for i, d in enumerate(done):
        message, reason = _message(req, d.text, d.finish_reason)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(texts, d.logprobs),
                        "finish_reason": reason})
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": engine.model_id,
                         "choices": choices, "usage": usage([d.last for d in done])})


def _message(req: ChatRequest, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """A whole choice's message and finish_reason: its tool calls, when the request has tools and the text holds
    some (OpenAI then says "tool_calls" and content is null unless text came before the calls)."""
    parsed = parse_tool_calls(text, req.tools.names) if req.tools is not None else None
    if parsed is None:
        return {"role": "assistant", "content": text}, finish_reason
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def _render_prompt(tokenizer: Any, req: ChatRequest, replies: ReplyMemory | None, tenant: str) -> ChatPrompt:
    prompt = chat_prompt(tokenizer, req.messages, req.tools, True, req.chat_template_kwargs, replies, tenant)
    if not prompt.ids:
        raise bad_request("The rendered prompt is empty", param="messages")
    return prompt


def _delta(index: int, delta: dict[str, Any], finish_reason: str | None = None,
           logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
