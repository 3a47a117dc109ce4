"""OpenAI-compatible HTTP server around one ``EngineClient`` (inline engine, engine process, router).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as SSE streams),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. The first output is awaited before the
response starts (admission errors stay 400 / 503); a client disconnect aborts the engine request.

Request flow, errors, disconnects: docs/DESIGN.md#apiserverpy"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from swaserve.api.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from swaserve.api.logprobs import TokenTexts
from swaserve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    ProtocolError,
    check_token_ids,
    error_body,
)
from swaserve.api.render import ChatRenderer, CompletionRenderer, Job, Renderer, sse_data
from swaserve.api.structured import structured_output
from swaserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    PromptEncoder,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from swaserve.config import EngineConfig
from swaserve.engine.client import EngineClient, Unavailable
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before the work it asked for was done."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    The request body must already have been read. Raises ClientGone on disconnect; cancelling
    ``work`` is what aborts an engine request running inside it.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _aclose(it: AsyncIterator[Any]) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


class OpenAIServer:
    """Request handling shared by the endpoints: checks, engine calls, streaming, disconnects.

    Args:
        engine: A started (or to-be-started) engine client.
        metrics: Where to record latencies and finished requests.
    """

    def __init__(self, engine: EngineClient, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.model_name = engine.model_name
        self.created = int(time.time())
        self.texts = TokenTexts(engine.tokenizer)
        self.encoder = PromptEncoder(engine.tokenizer)

    def models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=self.model_name, created=self.created, max_model_len=self.engine.max_model_len)
            ]
        )

    def model(self, model_id: str) -> ModelCard:
        self._check_model(model_id)
        return self.models().data[0]

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """``/tokenize``: the prompt ids a completion or chat request with this input would get."""
        self._check_model(req.model)
        max_len = self.engine.max_model_len
        if isinstance(req, TokenizeChatRequest):
            text = await self._render_chat(
                [m.template_dict() for m in req.messages], req.add_generation_prompt
            )
            ids = await self.encoder.encode(text, max_len, "messages", req.add_special_tokens)
        else:
            ids = await self.encoder.encode(req.prompt, max_len, "prompt", req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(req.model)
        check_token_ids(req.tokens, self.engine.model_config.vocab_size, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.engine.tokenizer.decode, req.tokens))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ProtocolError(
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
                status=404,
            )

    def _new_job(self, prefix: str, prompt_ids: list[int], params: SamplingParams, return_ids: bool) -> Job:
        return Job(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_name,
            prompt_ids=prompt_ids,
            params=params,
            return_token_ids=return_ids,
        )

    def _check_ids(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str) -> None:
        vocab = self.engine.model_config.vocab_size
        check_token_ids(prompt_ids, vocab, prompt_param)
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        structured = await structured_output(req)
        prompt = req.prompt_input()
        if isinstance(prompt, list):
            prompt_ids = list(prompt)
        else:
            prompt_ids = await self.encoder.encode(prompt, self.engine.max_model_len, "prompt")
        if not prompt_ids:
            raise ProtocolError("prompt must not be empty (it encodes to no tokens)", param="prompt")
        params = req.sampling_params(len(prompt_ids), self.engine.max_model_len)
        params = dataclasses.replace(params, structured=structured)
        self._check_ids(prompt_ids, params, "prompt")
        job = self._new_job("cmpl", prompt_ids, params, req.return_token_ids)
        return await self._run(job, CompletionRenderer(self.texts, req.include_usage), req, raw)

    async def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return await asyncio.to_thread(  # off the loop: a long conversation renders for a while
                self.engine.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # template errors (bad role order, no template) are the request's fault
            raise ProtocolError(f"could not apply the chat template: {e}", param="messages") from e

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        structured = await structured_output(req)
        text = await self._render_chat(req.template_messages(), True)
        prompt_ids = await self.encoder.encode(text, self.engine.max_model_len, "messages", False)
        if not prompt_ids:
            raise ProtocolError("messages render to an empty prompt", param="messages")
        params = req.sampling_params(len(prompt_ids), self.engine.max_model_len)
        params = dataclasses.replace(params, structured=structured)
        self._check_ids(prompt_ids, params, "messages")
        job = self._new_job("chatcmpl", prompt_ids, params, req.return_token_ids)
        num_top = req.top_logprobs or 0
        return await self._run(job, ChatRenderer(self.texts, req.include_usage, num_top), req, raw)

    async def _next(self, gen: AsyncIterator[RequestOutput]) -> RequestOutput:
        """The next output; the engine's ValueError (refused, or failed alone) is a 400."""
        try:
            return await anext(gen)
        except ValueError as e:
            raise ProtocolError(str(e)) from e

    async def _run(
        self, job: Job, renderer: Renderer, req: CompletionRequest | ChatCompletionRequest, raw: Request
    ) -> Response:
        if not self.engine.running:
            raise not_running(self.engine)
        timer = self.metrics.timer()
        gen = self.engine.generate(job.prompt_ids, job.params, job.request_id)
        handed_over = False
        try:
            if req.stream:
                first = await unless_disconnected(raw, self._next(gen))
                stream = self._events(gen, first, job, renderer, timer, req.include_usage)
                handed_over = True
                return EventSourceResponse(stream, sep="\n")
            body = await unless_disconnected(raw, self._collect(gen, job, renderer, timer))
            return JSONResponse(body)
        except ProtocolError:
            timer.discard()  # refused by the engine: not a finished request
            raise
        except ClientGone:
            logger.info("client went away; aborted %s", job.request_id)
            return Response(status_code=499)
        finally:
            if not handed_over:
                timer.abort()
                await _aclose(gen)

    async def _collect(
        self, gen: AsyncIterator[RequestOutput], job: Job, renderer: Renderer, timer: RequestTimer
    ) -> dict[str, Any]:
        out = await self._next(gen)
        while True:
            timer.observe(out)
            job.add(out)
            if out.finished:
                return renderer.response(job)
            out = await self._next(gen)

    async def _events(
        self,
        gen: AsyncIterator[RequestOutput],
        first: RequestOutput,
        job: Job,
        renderer: Renderer,
        timer: RequestTimer,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        out, is_first = first, True
        try:
            while True:
                timer.observe(out)
                for chunk in renderer.chunks(job, out, is_first):
                    yield sse_data(chunk)
                is_first = False
                if out.finished:
                    break
                out = await anext(gen)
            if include_usage:
                yield sse_data(renderer.usage_chunk(job, job.usage(out)))
            yield "[DONE]"
        except Unavailable as e:  # no capacity after the stream started: say so, end it
            logger.warning("stream %s: %s", job.request_id, e)
            yield sse_data(error_body(str(e), "server_error", code=e.code))
            yield "[DONE]"
        except ValueError as e:  # the engine failed this request alone (its grammar broke)
            logger.warning("stream %s: %s", job.request_id, e)
            yield sse_data(error_body(str(e), "invalid_request_error"))
            yield "[DONE]"
        except Exception as e:  # an engine failure after the stream started: tell the client, end it
            logger.exception("stream %s failed", job.request_id)
            yield sse_data(error_body(f"internal error: {e}", "server_error"))
            yield "[DONE]"
        finally:
            timer.abort()  # no-op when the request finished
            await _aclose(gen)


# --------------------------------------------------------------------------------------------
# Errors


def not_running(engine: EngineClient) -> Unavailable | ProtocolError:
    """The 503 of an engine that is not running: its own reason (``engine.unavailable()``: the
    router's missing worker role, a dead engine core), else ``engine_not_running``."""
    reason = engine.unavailable()
    if reason is not None:
        return reason
    return ProtocolError("engine is not running", type="server_error", code="engine_not_running", status=503)


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
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    if first.get("type") == "json_invalid":
        return f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if not loc and isinstance(first.get("input"), bytes | str):
        return "Request body must be a JSON object sent with Content-Type: application/json", None
    parts = []
    for err in errors[:3]:
        path = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
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


def build_app(
    engine: EngineClient, *, manage_engine: bool = True, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: The engine to serve (its ``model_name`` is the only accepted ``model``).
        manage_engine: Start the engine in the app's lifespan and stop it at shutdown. Pass False
            when the caller starts and stops the engine itself.
        max_request_bytes: A larger request body is a 413 (``api.body_limit``).

    Returns:
        The app; ``app.state.server`` is the ``OpenAIServer``, ``app.state.metrics`` the
        ``ServerMetrics`` (its own Prometheus registry).
    """
    # the router's ClusterEngine adds its workers' loads and its own counters
    metrics = ServerMetrics(engine.stats, engine.model_name, getattr(engine, "router_stats", None))
    server = OpenAIServer(engine, metrics)

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
    app.state.server = server
    app.state.metrics = metrics
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, limit=max_request_bytes)

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
) -> int:
    """Load the model, then serve it with uvicorn until interrupted.

    Args:
        model_dir: Checkpoint directory; None serves the default model.
        host: Interface to bind (e.g. "127.0.0.1", "0.0.0.0").
        port: TCP port.
        engine_config: Engine knobs (``engine_process``: inline or a separate core process).
        model_name: Served model name (default: the engine's, i.e. the directory's basename).
        max_request_bytes: A larger request body is a 413.

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

    engine = build_engine_client(model_dir, engine_config, model_name, on_dead=on_dead)
    app = build_app(engine, max_request_bytes=max_request_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 1 if dead else 0
