"""The router's worker-management endpoints (``swaserve up``'s router; ``swaserve serve`` has none):
``GET /workers`` (state, reason, load, model and process identity of each), ``POST /workers`` (add,
checked), ``DELETE /workers`` (drain and drop its index entries), over a ``WorkerAdmin``. Changes
reach every router replica through Redis; bad input is a 4xx OpenAI-style error.

Reference: docs/OPERATIONS.md#http-router-only-workers; details: docs/DESIGN.md#apiworkerspy"""

from __future__ import annotations

import json
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from swaserve.api.protocol import ProtocolError


class WorkerAdmin(Protocol):
    """What the endpoints call (the router's ``services.router.admin.WorkerAdmin``). Methods
    return the response body and raise ``ProtocolError`` for bad input."""

    async def add_worker(self, url: str, role: str) -> dict[str, Any]: ...

    async def remove_worker(self, url: str) -> dict[str, Any]: ...

    def list_workers(self) -> dict[str, Any]: ...


class AddWorkerRequest(BaseModel):
    """``POST /workers`` body."""

    model_config = ConfigDict(extra="forbid")
    url: str
    role: str


async def _url_of(request: Request, url: str | None) -> str:
    """``DELETE /workers``'s worker: the ``url`` query parameter, else a JSON body's ``url``."""
    if url:
        return url
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ProtocolError(f"Invalid JSON body: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise ProtocolError('give the worker as ?url=host:port or a JSON body {"url": ...}', param="url")
    return str(body["url"])


def install_worker_routes(app: FastAPI, admin: WorkerAdmin) -> None:
    """Add the ``/workers`` endpoints (module docstring) to ``app`` (built by
    ``swaserve.api.server.build_app``, whose error handlers render ``ProtocolError``s)."""

    @app.get("/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse(admin.list_workers())

    @app.post("/workers")
    async def add_worker(req: AddWorkerRequest) -> JSONResponse:
        return JSONResponse(await admin.add_worker(req.url, req.role))

    @app.delete("/workers")
    async def remove_worker(request: Request, url: str | None = None) -> JSONResponse:
        return JSONResponse(await admin.remove_worker(await _url_of(request, url)))
