"""Request bodies parsed off the event loop: ``OffLoopJSONRoute`` is FastAPI's route with a
request whose ``json()`` decodes a body of ``OFF_LOOP_BYTES`` or more in a worker thread
(``asyncio.to_thread``), so a multi-MB body (~15-30 ms of ``json.loads`` per 10 MB on this
machine) never holds ``/health`` or other streams. Smaller bodies decode inline: a thread hop
costs more than they do. Errors are the ones ``json.loads`` raises, handled as before. The route
also makes the engine's ``max_model_len`` now (a router's: its workers' least) visible to the
request models' size checks (``api.protocol.check_sizes``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from swaserve.api.protocol import MAX_MODEL_LEN

OFF_LOOP_BYTES = 256 << 10
_decode = json.loads  # module-level so a test can watch which thread runs it


class OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            big = len(body) >= OFF_LOOP_BYTES
            self._json = await asyncio.to_thread(_decode, body) if big else _decode(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    """Set as ``app.router.route_class`` before the routes are added."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def offloop(request: Request) -> Response:
            server = getattr(request.app.state, "server", None)  # the engine's limit now (a router's
            # follows its workers'), for this task only
            MAX_MODEL_LEN.set(server.engine.max_model_len if server is not None else None)
            return await handler(OffLoopJSONRequest(request.scope, request.receive))

        return offloop
