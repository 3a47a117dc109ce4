"""The router's worker-management endpoints (``swaserve up``'s router; ``swaserve serve`` has none).

* ``GET /workers`` — every worker the router knows: ``url``, ``instance``, ``role``, ``state``
  (``up``, ``down``, ``draining``), ``reason`` (why it is down: unreachable, or refused:
  ``model_mismatch: ...``, ``duplicate: ...``), ``source`` (``flag``: command line, ``registry``:
  added or changed at runtime), ``bucket`` (prompt tokens ``[lo, hi)``; prefill), requests in
  flight, and from its last ``GetLoad``: ``running``, ``waiting``, ``queue_order`` (``fcfs`` or
  ``compute``), ``model_fingerprint``, ``model`` (its description) and ``boot_id`` (its process);
  the list also has the router's own ``model_fingerprint`` and ``model``.
* ``POST /workers`` ``{"url": "host:port", "role": "prefill"|"decode"}`` — add a worker (checked:
  it must answer, report that role and the router's model fingerprint, and not be a process
  already registered under another address). The response shows it as that check found it (its
  state and load). ``url`` may be ``grpc://host:port``; it is the worker's name in the prefix
  index too, so give it as the worker names itself (its ``--host``) for ``--index-mode precise``.
* ``DELETE /workers?url=host:port`` (or a JSON body ``{"url": ...}``) — remove a worker: it drains
  (no new requests, those in flight finish) and its prefix-index entries are dropped. Removing the
  last worker of a role is accepted with a ``warning`` in the response: requests fail with 503
  ``no_worker_available`` until one is added.

Changes go to the routers' shared registry in Redis, so one call reaches every router replica
within a poll; without Redis they hold on the router that got them, and the response says so
(``shared: false`` and a ``note``). Bad input is a 4xx with an OpenAI-style error body (``code``:
``invalid_role``, ``invalid_worker_url``, ``worker_unreachable``, ``role_mismatch``,
``model_mismatch``, ``worker_exists`` (409: the address serves the other role, or the process is
registered under another address), ``worker_not_found`` (404)).
"""

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
