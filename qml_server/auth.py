"""Optional API keys on /v1/*, /tokenize and /detokenize, and the tenant identity they give a request.

Keys are kept only as SHA-256 digests and compared with ``secrets.compare_digest``
against every configured key (no early exit), so neither the comparison time nor
the log reveals a key. ``/health``, ``/metrics`` and ``/openapi.json`` stay public for
probes, scrapers and tooling.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from qml_server.errors import ApiError


def tenant_id(key: str) -> str:
    """A stable, non-secret name for the holder of ``key``.

    Later work salts the KV prefix cache by tenant, so it must not change across
    restarts (hence derived from the key, not from its position in the list).
    """
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def keys_from_env(value: str | None) -> tuple[str, ...]:
    """QML_API_KEY holds one key or several, comma-separated (for rotation)."""
    if not value:
        return ()
    return tuple(k.strip() for k in value.split(",") if k.strip())


class ApiKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` on the API routes when any key is configured.

    Sets ``scope["state"]["tenant"]`` (read as ``request.state.tenant``): the tenant id
    of the key that authenticated, or None when the server runs without keys.
    """

    def __init__(self, app: ASGIApp, keys: Iterable[str] = ()):
        self.app = app
        self._tenants = {hashlib.sha256(k.encode()).digest(): tenant_id(k) for k in keys if k}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = None
        if self._tenants and _protected(scope):
            tenant = self._authenticate(Headers(scope=scope).get("authorization"))
            if tenant is None:
                await _unauthorized().response()(scope, receive, send)
                return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _authenticate(self, header: str | None) -> str | None:
        if not header:
            return None
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented.strip():
            return None
        digest = hashlib.sha256(presented.strip().encode()).digest()
        found = None
        for known, tenant in self._tenants.items():
            if secrets.compare_digest(known, digest):
                found = tenant
        return found


# Outside /v1 but work done for a client all the same (tokenizing a long text costs CPU).
_PROTECTED_ROUTES = frozenset({"/tokenize", "/detokenize"})


def _protected(scope: Scope) -> bool:
    path: str = scope["path"]
    # OPTIONS stays open so a browser's CORS preflight (which never carries
    # credentials) is not refused before the real request.
    in_api = path == "/v1" or path.startswith("/v1/") or path in _PROTECTED_ROUTES
    return in_api and scope["method"] != "OPTIONS"


def _unauthorized() -> ApiError:
    return ApiError(
        401,
        "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )
