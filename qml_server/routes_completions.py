"""POST /v1/completions (the legacy text endpoint: one prompt in, text out)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_server.errors import api_endpoint
from qml_server.fields import read_json_object
from qml_server.generation import (
    collect,
    first_output,
    log_request,
    sse_completion_events,
    start_generation,
    usage,
)
from qml_server.prompts import completion_prompt_ids
from qml_server.schemas import check_model, parse_completion_request, resolve_max_tokens
from qml_server.sse import EventStreamResponse


@api_endpoint
async def completions(request: Request) -> Response:
    started = time.monotonic()
    engine = request.app.state.engine
    req = parse_completion_request(await read_json_object(request))
    check_model(req.model, engine.model_id)
    prompt_ids = await run_in_threadpool(completion_prompt_ids, engine.tokenizer, req.prompt)
    max_tokens = resolve_max_tokens(req.sampling.max_tokens, len(prompt_ids), engine.context_length, "prompt")
    params = req.sampling.to_params(max_tokens)

    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": request_id, "object": "text_completion", "created": created, "model": engine.model_id}
    log_request(request_id, len(prompt_ids), params, req.stream)
    stream = start_generation(request, prompt_ids, params, request_id, started, req.cache_salt, req.user)

    if req.stream:
        first = await first_output(request, stream)
        events = sse_completion_events(
            head=head,
            first=first,
            stream=stream,
            include_usage=req.include_usage,
            text_choice=lambda text: _choice(text),
            finish_choice=lambda reason: _choice("", reason),
        )
        return EventStreamResponse(events)

    done = await collect(request, stream)
    return JSONResponse({**head, "choices": [_choice(done.text, done.finish_reason)], "usage": usage(done.last)})


def _choice(text: str, finish_reason: str | None = None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
