"""A cap on request body size, answered with 413 in the OpenAI error shape.

Starlette's own body-limit middleware answers in plain text, which the ``openai``
client cannot parse into an error message, hence this small one.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qml_server.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(
            413,
            f"The request body is larger than this server's limit of {limit} bytes.",
            code="request_too_large",
        )


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            # Refuse before reading a byte of it.
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return

        received = 0

        async def counting_receive() -> Message:
            # A chunked body has no Content-Length, so count as it arrives. Raising
            # here surfaces inside the route's body read; the BodyTooLarge handler
            # (an ApiError) renders the 413.
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
