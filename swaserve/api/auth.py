"""API-key authentication of the HTTP front (``--api-key``, else env ``SWASERVE_API_KEY``; as vLLM's
``--api-key`` / ``VLLM_API_KEY``).

``ApiKeyAuth`` is an ASGI middleware: every request but those to ``OPEN_PATHS`` (``/health``,
``/metrics``: probes and scrapers) needs ``Authorization: Bearer KEY``. Everything else is closed
by default (``/v1/*``, ``/tokenize``, ``/detokenize``, the router's ``/workers``, the OpenAPI docs,
unknown paths), so an endpoint added later is never open by mistake. A refusal is a 401 with
OpenAI's error body (``type`` ``invalid_request_error``, ``code`` ``invalid_api_key``) and
``WWW-Authenticate: Bearer``, sent before any of the body is read.

``AdminTokenAuth`` guards the router's admin paths (``ADMIN_PATHS``: ``/workers`` and below) with a
token of their own (``--admin-token``, env ``SWASERVE_ADMIN_TOKEN``): none is a 401 (``WWW-Authenticate:
Bearer``), another token (the API key too) a 403; ``ApiKeyAuth`` then leaves those paths to it, and the
admin token opens nothing else.

The check compares SHA-256 digests with ``hmac.compare_digest``: constant time, and the key's
length does not show either. Keys are never logged nor put in an error body; pass them to child
processes through the environment (``API_KEY_ENV``), never on a command line (``ps`` shows those)."""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from swaserve.api.responses import error_body

API_KEY_ENV = "SWASERVE_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics"})
ADMIN_PATHS = ("/workers",)  # each with everything below it

_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header "
    "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_WRONG = "Incorrect API key provided."
_NO_ADMIN = (
    "This path needs the admin token: send it in an Authorization header using Bearer auth "
    "(i.e. Authorization: Bearer ADMIN_TOKEN)."
)
_WRONG_ADMIN = "Incorrect admin token provided (the API key is not the admin token)."


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


def under(path: str, prefixes: tuple[str, ...]) -> bool:
    """``path`` is one of ``prefixes`` or below one (``/workers``, ``/workers/x``; not ``/workersx``)."""
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _path(scope: Scope) -> str:
    return str(scope["path"]).removeprefix(scope.get("root_path", "")) or "/"


class ApiKeyAuth:
    """ASGI middleware. Args: app; api_key (non-empty); open_paths: served without a key;
    guarded_elsewhere: path prefixes another guard checks (``AdminTokenAuth``), passed through."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str,
        open_paths: frozenset[str] = OPEN_PATHS,
        guarded_elsewhere: tuple[str, ...] = (),
    ) -> None:
        if not api_key or api_key != api_key.strip():  # the header's token is stripped
            raise ValueError("the API key must not be empty or start or end with whitespace")
        self.app, self.open_paths, self.guarded_elsewhere = app, open_paths, guarded_elsewhere
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
        path = _path(scope)
        ok = (
            True if path in self.open_paths or under(path, self.guarded_elsewhere) else self.authorized(scope)
        )
        if ok:
            await self.app(scope, receive, send)
            return
        body = error_body(
            _WRONG if ok is False else _MISSING, "invalid_request_error", None, "invalid_api_key"
        )
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class AdminTokenAuth:
    """ASGI middleware: requests to ``paths`` (prefixes) need ``Authorization: Bearer TOKEN``
    (module docstring: 401 without a token, 403 with another); other paths pass through.

    Args: app; token (non-empty); paths: the admin path prefixes.

    Raises:
        ValueError: an empty or padded token.
    """

    def __init__(self, app: ASGIApp, token: str, paths: tuple[str, ...] = ADMIN_PATHS) -> None:
        if not token or token != token.strip():
            raise ValueError("the admin token must not be empty or start or end with whitespace")
        self.app, self.paths = app, paths
        self._digest = _digest(token.encode("utf-8"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not under(_path(scope), self.paths):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        if token is not None and hmac.compare_digest(_digest(token), self._digest):
            await self.app(scope, receive, send)
            return
        if token is None:
            body = error_body(_NO_ADMIN, "invalid_request_error", None, "missing_admin_token")
            response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        else:
            body = error_body(_WRONG_ADMIN, "permission_error", None, "invalid_admin_token")
            response = JSONResponse(body, status_code=403)
        await response(scope, receive, send)
