"""POST /tokenize and POST /detokenize (vLLM's shapes).

/tokenize counts a prompt exactly as the generation routes will: ``prompt`` as
/v1/completions encodes it, ``messages`` (with ``tools``, if any) through the chat template as
/v1/chat/completions renders it. Clients use it to size prompts against
``max_model_len`` before sending them.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from qml_server.errors import api_endpoint
from qml_server.fields import read_json_object
from qml_server.generation import request_tenant
from qml_server.prompts import chat_prompt, text_prompt_ids
from qml_server.replies import ReplyMemory
from qml_server.schemas import TokenizeRequest, check_model, parse_detokenize_request, parse_tokenize_request


@api_endpoint
async def tokenize(request: Request) -> Response:
    engine = request.app.state.engine
    req = parse_tokenize_request(await read_json_object(request))
    check_model(req.model, engine.model_id)
    # A long text or history is CPU work: off the event loop, as in the chat route.
    ids = await run_in_threadpool(_token_ids, engine.tokenizer, req, getattr(request.app.state, "replies", None),
                                  request_tenant(request) or "")
    return JSONResponse({"count": len(ids), "max_model_len": engine.context_length, "tokens": ids})


@api_endpoint
async def detokenize(request: Request) -> Response:
    engine = request.app.state.engine
    tokenizer = engine.tokenizer
    req = parse_detokenize_request(await read_json_object(request), getattr(tokenizer, "vocab_size", None))
    check_model(req.model, engine.model_id)
    text = await run_in_threadpool(tokenizer.decode, req.tokens)
    return JSONResponse({"prompt": text})


def _token_ids(tokenizer, req: TokenizeRequest, replies: ReplyMemory | None, tenant: str) -> list[int]:
    if req.messages is not None:  # with the kept replies of the tenant, as the chat route encodes them
        return list(chat_prompt(tokenizer, req.messages, req.tools, req.add_generation_prompt,
                                req.chat_template_kwargs, replies, tenant).ids)
    assert req.prompt is not None
    return text_prompt_ids(tokenizer, req.prompt, req.add_special_tokens)
