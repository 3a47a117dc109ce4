"""API-key authentication of the HTTP front (``--api-key``, else env ``SWASERVE_API_KEY``; as vLLM's
``--api-key`` / ``VLLM_API_KEY``).

``ApiKeyAuth`` is an ASGI middleware: every request but those to ``OPEN_PATHS`` (``/health``,
``/metrics``: probes and scrapers) needs ``Authorization: Bearer KEY``. Everything else is closed
by default (``/v1/*``, ``/tokenize``, ``/detokenize``, the router's ``/workers``, the OpenAPI docs,
unknown paths), so an endpoint added later is never open by mistake. A refusal is a 401 with
OpenAI's error body (``type`` ``invalid_request_error``, ``code`` ``invalid_api_key``) and
``WWW-Authenticate: Bearer``, sent before any of the body is read.

The check compares SHA-256 digests with ``hmac.compare_digest``: constant time, and the key's
length does not show either. The key is never logged; pass it to child processes through the
environment (``API_KEY_ENV``), never on a command line (``ps`` shows those)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from swaserve.api.responses import error_body

API_KEY_ENV = "SWASERVE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's first ``Authorization: Bearer TOKEN`` header (scheme
    case-insensitive, RFC 7235), or None without one."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyAuth:
    """ASGI middleware. Args: app; api_key (non-empty); open_paths: served without a key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        if not api_key or api_key != api_key.strip():  # the header's token is stripped
            raise ValueError("the API key must not be empty or start or end with whitespace")
        self.app, self.open_paths = app, open_paths
        self._key_digest = _digest(api_key.encode("utf-8"))

    def authorized(self, scope: Scope) -> bool | None:
        """True for the right key, False for a wrong one, None for none."""
        token = bearer_token(scope)
        if token is None:
            return None
        return hmac.compare_digest(_digest(token), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        ok = True if path in self.open_paths else self.authorized(scope)
        if ok:
            await self.app(scope, receive, send)
            return
        body = error_body(
            _WRONG if ok is False else _MISSING, "invalid_request_error", None, "invalid_api_key"
        )
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
