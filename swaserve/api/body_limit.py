"""A request-body size limit for the HTTP front (``--max-request-bytes``): a body past it is a 413
with an OpenAI error body, refused from its ``Content-Length`` before any of it is read, or as
soon as the bytes received pass the limit (chunked uploads), so no one request can make the
server parse or hold an unbounded body."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swaserve.api.responses import error_body

DEFAULT_MAX_REQUEST_BYTES = 32 << 20


def _message(limit: int, got: str) -> str:
    return f"Request body too large: {got} bytes, more than the limit of {limit} (--max-request-bytes)"


class BodyLimit:
    """ASGI middleware. Args: app; limit (bytes, > 0)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            body = error_body(_message(self.limit, length.decode()), "invalid_request_error", None, None)
            await JSONResponse(body, status_code=413)(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg: Any = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:  # the route is reading the body: FastAPI passes this through
                    raise HTTPException(413, _message(self.limit, f"at least {seen}"))
            return msg  # type: ignore[no-any-return]

        await self.app(scope, limited, send)
