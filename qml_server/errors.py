"""Errors in the OpenAI shape, and the handlers that render them.

Every failure the server reports has the body
``{"error": {"message", "type", "param", "code"}}`` with a *string* ``code``, because
client libraries match on those strings (``context_length_exceeded``,
``model_not_found``, ...) and the official ``openai`` client maps the HTTP status to
its exception classes.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from qml_runtime.sampling_params import InvalidParameter

log = logging.getLogger("qml.server")

# Status reported when the client went away before we could answer. Nobody reads
# it; it only makes the access log say what happened (the nginx convention).
CLIENT_CLOSED_REQUEST = 499


class ApiError(Exception):
    """A failure to report to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client closed the connection; there is nobody left to answer."""


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# -- the errors the routes raise, named so each call site reads as what went wrong --


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def invalid_type(param: str, expected: str, value: Any) -> ApiError:
    got = "null" if value is None else type(value).__name__
    return bad_request(f"'{param}' must be {expected}, got {got}", param=param, code="invalid_type")


def missing_field(param: str) -> ApiError:
    return bad_request(f"'{param}' is a required property", param=param, code="missing_required_parameter")


def unsupported(param: str, why: str) -> ApiError:
    return bad_request(f"'{param}' {why}", param=param, code="unsupported_parameter")


def model_not_found(model: str) -> ApiError:
    return ApiError(
        404,
        f"The model '{model}' does not exist. Use GET /v1/models to list the served model.",
        param="model",
        code="model_not_found",
    )


def context_length_exceeded(prompt_tokens: int, max_tokens: int | None, context_length: int, param: str) -> ApiError:
    if max_tokens is None:
        detail = f"the prompt alone is {prompt_tokens} tokens, which leaves no room for a completion"
    else:
        detail = (
            f"you requested {prompt_tokens + max_tokens} tokens "
            f"({prompt_tokens} in the prompt, {max_tokens} for the completion)"
        )
    return bad_request(
        f"This model's maximum context length is {context_length} tokens; {detail}. "
        "Shorten the prompt or lower max_tokens.",
        param=param,
        code="context_length_exceeded",
    )


def queue_full(limit: int, retry_after_s: int) -> ApiError:
    # 503 + Retry-After: the official client retries it after that delay (SGLang and vLLM
    # answer a full queue the same way; TGI's 429 would read as a per-key rate limit).
    return ApiError(
        503,
        f"The server is overloaded: {limit} requests are already waiting. Retry in {retry_after_s} s.",
        type="server_error",
        code="queue_full",
        headers={"retry-after": str(retry_after_s)},
    )


def service_unavailable(message: str, code: str, retry_after_s: int) -> ApiError:
    """503 + Retry-After for a server that cannot take requests now (loading, draining)."""
    return ApiError(503, message, type="server_error", code=code, headers={"retry-after": str(retry_after_s)})


def new_error_id() -> str:
    return f"err-{uuid.uuid4().hex[:16]}"


def internal_error(error_id: str) -> ApiError:
    # The id is the only link between what the client sees and the traceback in the log;
    # the message says nothing else, so no internals leak.
    return ApiError(
        500,
        f"The server had an error while processing your request (error id {error_id}); "
        "the server log has the details under that id.",
        type="server_error",
        code="internal_error",
    )


def log_internal_error(what: str, exc: BaseException) -> ApiError:
    """Log ``exc`` with its traceback under a fresh error id; the 500 to answer with."""
    error_id = new_error_id()
    log.error("%s: error id %s", what, error_id, exc_info=exc)
    return internal_error(error_id)


# -- Starlette exception handlers --


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def handle_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 (unknown route) and 405 (wrong method), in our shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"Unknown route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    err = ApiError(exc.status_code, message, code=code, headers=exc.headers)
    return err.response()


async def handle_unexpected(request: Request, exc: Exception) -> Response:
    # Last resort for bugs outside the routes (the routes convert their own).
    return log_internal_error(f"unhandled error on {request.method} {request.url.path}", exc).response()


Endpoint = Callable[[Request], Awaitable[Response]]


def api_endpoint(endpoint: Endpoint) -> Endpoint:
    """Turn whatever an endpoint raises into an OpenAI error response.

    ``InvalidParameter`` (from SamplingParams or the engine) is the client's fault: 400
    naming the field. Anything unexpected is logged with its traceback and answered
    with a 500 that does not leak internals. The server keeps serving either way.
    """

    @functools.wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except ApiError as exc:
            return exc.response()
        except InvalidParameter as exc:
            return bad_request(str(exc), param=exc.param).response()
        except (ClientDisconnect, ClientDisconnected):
            log.info("client disconnected from %s before the answer was ready", request.url.path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception as exc:  # noqa: BLE001  (logged with its traceback under an error id)
            return log_internal_error(f"error while handling {request.method} {request.url.path}", exc).response()

    return wrapper
