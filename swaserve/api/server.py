"""OpenAI-compatible HTTP server around one ``EngineClient`` (inline engine, engine process, router):
the app, its error envelope and ``serve``; request handling is ``api.serving``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as SSE streams),
``GET /v1/models[/{id}]``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``.

Request flow, errors, disconnects: docs/DESIGN.md#apiserverpy"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.api.auth import ADMIN_PATHS, AdminTokenAuth, ApiKeyAuth
from swaserve.api.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from swaserve.api.media import MediaOptions
from swaserve.api.offloop import OffLoopJSONRoute
from swaserve.api.protocol import ChatCompletionRequest, CompletionRequest, ProtocolError
from swaserve.api.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    error_body,
)
from swaserve.api.serving import OpenAIServer, not_running
from swaserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from swaserve.config import EngineConfig
from swaserve.engine.client import EngineClient, Unavailable
from swaserve.engine.types import MAX_LOGPROBS
from swaserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Errors


def _error(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]

    def fields(err: Any) -> list[str]:  # the body's field path: no "body", no union member names
        return [str(p) for p in err.get("loc", ()) if p != "body" and not str(p)[:1].isupper()]

    loc = fields(first)
    if first.get("type") == "json_invalid":
        return f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and isinstance(first.get("input"), bytes | str):
        return "Request body must be a JSON object sent with Content-Type: application/json", None
    parts = []
    for err in errors[:3]:
        path = ".".join(fields(err)) or "body"
        parts.append(f"{path}: {err.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "Invalid request: " + "; ".join(parts) + more, (loc[0] if loc else None)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProtocolError)
    async def _protocol(_: Request, exc: ProtocolError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(Unavailable)
    async def _unavailable(_: Request, exc: Unavailable) -> JSONResponse:
        logger.warning("request refused: %s", exc)
        return _error(503, str(exc), "server_error", code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return _error(
            exc.status_code, message, "invalid_request_error" if exc.status_code < 500 else "server_error"
        )

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error(500, f"internal error: {exc}", "server_error")


# --------------------------------------------------------------------------------------------
# App


_ERRORS = {
    400: "Invalid request: a wrong type, an unknown field, a value out of range (`error.param` names it)",
    401: "Missing or wrong API key (`--api-key`)",
    404: "Unknown model or path",
    413: "Request body over `--max-request-bytes`",
    503: "No engine or worker can take the request now",
}


def _document_errors(app: FastAPI) -> None:
    """OpenAPI: the error answers this server sends (OpenAI's envelope), not FastAPI's 422."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = schema.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas.update(
                ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}").pop("$defs")
            )
            schemas["ErrorResponse"] = ErrorResponse.model_json_schema(
                ref_template="#/components/schemas/{model}"
            )
            ref = {
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
            }
            for item in schema.get("paths", {}).values():
                for op in item.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)
                    for status, text in _ERRORS.items():
                        responses.setdefault(str(status), {"description": text, **ref})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(
    engine: EngineClient,
    *,
    manage_engine: bool = True,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    admin_token: str | None = None,
    media_options: MediaOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: The engine to serve (its ``model_name`` is the only accepted ``model``).
        manage_engine: Start the engine in the app's lifespan and stop it at shutdown. Pass False
            when the caller starts and stops the engine itself.
        max_request_bytes: A larger request body is a 413 (``api.body_limit``).
        api_key: Every request but ``/health`` and ``/metrics`` needs ``Authorization: Bearer
            api_key`` (``api.auth``); None: no key.
        chat_template: Jinja chat template used instead of the tokenizer's (already checked:
            ``api.chat_template.resolve_chat_template``).
        max_logprobs: Largest ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` a request may
            ask for (``--max-logprobs``), at most the engine's ``MAX_LOGPROBS``.
        admin_token: The admin paths (``api.auth.ADMIN_PATHS``: the router's ``/workers``) need
            ``Authorization: Bearer admin_token`` instead of the API key; None: they are
            guarded like the rest (by ``api_key`` if given).
        media_options: media limits and sources of a multimodal model (``api.media``).

    Raises:
        ValueError: ``max_logprobs`` out of ``[0, MAX_LOGPROBS]``; an empty or padded ``api_key``
            or ``admin_token``.

    Returns:
        The app; ``app.state.server`` is the ``OpenAIServer``, ``app.state.metrics`` the
        ``ServerMetrics`` (its own Prometheus registry).
    """
    # the router's ClusterEngine adds its workers' loads and its own counters
    metrics = ServerMetrics(
        engine.stats, engine.model_name, getattr(engine, "router_stats", None), engine.max_model_len
    )
    if not 0 <= max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {max_logprobs}")
    server = OpenAIServer(engine, metrics, max_logprobs, chat_template, media_options)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await engine.stop()

    app = FastAPI(title="swaserve", version="0.1.0", lifespan=lifespan)
    app.router.route_class = OffLoopJSONRoute  # a large body's JSON decodes in a thread
    app.state.server = server
    app.state.metrics = metrics
    _install_error_handlers(app)
    _document_errors(app)
    app.add_middleware(BodyLimit, limit=max_request_bytes)
    for what, secret in (("API key", api_key), ("admin token", admin_token)):  # now, not at the first request
        if secret is not None and (not secret or secret != secret.strip()):
            raise ValueError(f"the {what} must not be empty or start or end with whitespace")
    admin = ADMIN_PATHS if admin_token is not None else ()
    if api_key is not None:  # added last, so it runs first: before any of the body is read
        app.add_middleware(ApiKeyAuth, api_key=api_key, guarded_elsewhere=admin)
    if admin_token is not None:
        app.add_middleware(AdminTokenAuth, token=admin_token, paths=admin)

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await server.completions(req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat(req, raw)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return server.models()

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        return server.model(model_id)

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        return await server.tokenize(req)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return await server.detokenize(req)

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def get_tokenizer_info() -> TokenizerInfoResponse:
        return server.tokenizer_info()

    @app.get("/health")
    async def health() -> Response:
        if engine.running:
            return JSONResponse({"status": "ok"})
        err = not_running(engine)
        code = err.code if isinstance(err, Unavailable) else "engine_not_running"
        return _error(503, str(err), "server_error", code=code)

    @app.get("/metrics")
    async def prometheus() -> Response:
        data, content_type = metrics.render()
        return Response(content=data, headers={"Content-Type": content_type})

    return app


def serve(
    model_dir: str | None,
    host: str,
    port: int,
    engine_config: EngineConfig,
    model_name: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    num_threads: int | None = None,
    ssl_certfile: str | None = None,
    ssl_keyfile: str | None = None,
    media_options: MediaOptions | None = None,
) -> int:
    """Load the model, then serve it with uvicorn until interrupted.

    Args:
        model_dir: Checkpoint directory; None serves the default model.
        host: Interface to bind (e.g. "127.0.0.1", "0.0.0.0").
        port: TCP port.
        engine_config: Engine knobs (``engine_process``: inline or a separate core process).
        model_name: Served model name (default: the engine's, i.e. the directory's basename).
        max_request_bytes: A larger request body is a 413.
        api_key, chat_template, max_logprobs: as ``build_app``'s (the template already checked).
        num_threads: torch threads of the process that runs the model (None: torch's default, capped at the usable CPUs).
        ssl_certfile, ssl_keyfile: serve HTTPS with this certificate chain and key (PEM files; uvicorn's).

    Returns:
        The exit status: 0, or 1 if the engine core process died (open streams got an error
        event or a 503 first), so that a supervisor restarts the server.
    """
    import uvicorn

    from swaserve.engine.factory import build_engine_client

    if model_dir is None:
        from swaserve.model.checkpoint import default_model_dir

        model_dir = str(default_model_dir())
    dead: list[str] = []
    server: uvicorn.Server | None = None

    def on_dead(message: str) -> None:
        logger.error("%s: shutting down", message)
        dead.append(message)
        if server is not None:
            server.should_exit = True

    engine = build_engine_client(
        model_dir, engine_config, model_name, on_dead=on_dead, num_threads=num_threads
    )
    app = build_app(
        engine,
        max_request_bytes=max_request_bytes,
        api_key=api_key,
        chat_template=chat_template,
        max_logprobs=max_logprobs,
        media_options=media_options,
    )
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5,
        ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
    )  # fmt: skip
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 1 if dead else 0
