"""POST /v1/chat/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_server.errors import api_endpoint, bad_request
from qml_server.fields import read_json_object
from qml_server.generation import (
    collect,
    first_output,
    log_request,
    sse_completion_events,
    start_generation,
    usage,
)
from qml_server.prompts import chat_prompt_ids
from qml_server.schemas import ChatRequest, check_model, parse_chat_request, resolve_max_tokens
from qml_server.sse import EventStreamResponse


@api_endpoint
async def chat_completions(request: Request) -> Response:
    started = time.monotonic()
    engine = request.app.state.engine
    req = parse_chat_request(await read_json_object(request))
    check_model(req.model, engine.model_id)
    # Templates and tokenizers are CPU work that can take a while on long histories;
    # keep it off the event loop so other streams keep flowing.
    prompt_ids = await run_in_threadpool(_render_prompt, engine.tokenizer, req)
    max_tokens = resolve_max_tokens(req.sampling.max_tokens, len(prompt_ids), engine.context_length, "messages")
    params = req.sampling.to_params(max_tokens)

    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    log_request(request_id, len(prompt_ids), params, req.stream)
    stream = start_generation(request, prompt_ids, params, request_id, started, req.cache_salt, req.user)

    if req.stream:
        first = await first_output(request, stream)
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": engine.model_id}
        events = sse_completion_events(
            head=head,
            first=first,
            stream=stream,
            include_usage=req.include_usage,
            # OpenAI opens every chat stream with the role and an empty content.
            opening_choice=_delta({"role": "assistant", "content": ""}),
            text_choice=lambda text: _delta({"content": text}),
            finish_choice=lambda reason: _delta({}, reason),
        )
        return EventStreamResponse(events)

    done = await collect(request, stream)
    return JSONResponse(
        {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": engine.model_id,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": done.text},
                    "logprobs": None,
                    "finish_reason": done.finish_reason,
                }
            ],
            "usage": usage(done.last),
        }
    )


def _render_prompt(tokenizer: Any, req: ChatRequest) -> list[int]:
    ids = chat_prompt_ids(tokenizer, req.messages, True, req.chat_template_kwargs)
    if not ids:
        raise bad_request("The rendered prompt is empty", param="messages")
    return ids


def _delta(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
