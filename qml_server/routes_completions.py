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
    announce_request,
    collect,
    first_outputs,
    log_request,
    sse_completion_events,
    start_generation,
    usage,
)
from qml_server.logprobs import CompletionLogprobs, TokenText
from qml_server.prompts import completion_prompt_ids
from qml_server.schemas import check_model, check_token_ids, parse_completion_request, resolve_max_tokens
from qml_server.sse import EventStreamResponse


@api_endpoint
async def completions(request: Request) -> Response:
    started = time.monotonic()
    announce_request(request)
    engine = request.app.state.engine
    req = parse_completion_request(await read_json_object(request))
    check_model(req.model, engine.model_id)
    check_token_ids([t for t, _ in req.sampling.logit_bias], getattr(engine.tokenizer, "vocab_size", None),
                    "logit_bias")
    if isinstance(req.prompt, str):  # encoding a long text is CPU work: off the event loop
        prompt_ids = await run_in_threadpool(completion_prompt_ids, engine.tokenizer, req.prompt)
    else:  # ids are only checked (0.3 ms for 26,900 on CPU): cheaper here than the thread hop (~0.09 ms)
        prompt_ids = completion_prompt_ids(engine.tokenizer, req.prompt)
    max_tokens = resolve_max_tokens(req.sampling.max_tokens, len(prompt_ids), engine.context_length, "prompt")
    params = req.sampling.to_params(max_tokens)

    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    head = {"id": request_id, "object": "text_completion", "created": created, "model": engine.model_id}
    log_request(request_id, len(prompt_ids), params, req.stream)
    streams = start_generation(request, prompt_ids, params, request_id, started, req.cache_salt, req.user,
                               req.sampling.n, streamed=req.stream)
    texts = TokenText(engine.tokenizer)
    formats = [CompletionLogprobs(texts) for _ in streams]  # per choice: the text offsets run on

    if req.stream:
        firsts = await first_outputs(request, streams)

        def delta_choice(index: int, out: Any) -> dict[str, Any] | None:
            if not out.text and not out.logprobs:
                return None
            return _choice(index, out.text, logprobs=formats[index](out.logprobs))

        events = sse_completion_events(
            head=head,
            firsts=firsts,
            streams=streams,
            include_usage=req.include_usage,
            delta_choice=delta_choice,
            finish_choice=lambda index, reason: [_choice(index, "", reason)],
        )
        return EventStreamResponse(events)

    done = await collect(request, streams)
    choices = [_choice(i, d.text, d.finish_reason, formats[i](d.logprobs)) for i, d in enumerate(done)]
    return JSONResponse({**head, "choices": choices, "usage": usage([d.last for d in done])})


def _choice(index: int, text: str, finish_reason: str | None = None,
            logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
