"""Request handling of the OpenAI endpoints over one ``EngineClient``: checks, prompts (a batch of
them), choices (``n`` per prompt: one engine request each), streaming, disconnects.

Every choice's first output is awaited before the response starts, so admission errors stay a
400 / 503. The other ``n - 1`` choices of a prompt start once its first choice has its first
output: the prompt's KV is then in the prefix cache, so they compute only its last partial page.
A client disconnect aborts every engine request of the job.

Request flow, errors, disconnects: docs/DESIGN.md#apiserverpy"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from swaserve.api.logprobs import TokenTexts
from swaserve.api.media import MediaFront, MediaOptions
from swaserve.api.messages import part_modality, part_url
from swaserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Prompt,
    ProtocolError,
    check_token_ids,
)
from swaserve.api.render import ChatRenderer, Choice, CompletionRenderer, Job, Renderer, sse_data
from swaserve.api.responses import ModelCard, ModelList, error_body
from swaserve.api.structured import checked, structured_output
from swaserve.api.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    PromptEncoder,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    tokenizer_info,
)
from swaserve.api.tools import plan_tools
from swaserve.engine.client import EngineClient, Unavailable
from swaserve.engine.types import MAX_LOGPROBS, RequestOutput, SamplingParams
from swaserve.media import MediaError
from swaserve.media.placeholders import MediaInputs, text_ids
from swaserve.metrics import RequestTimer, ServerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")
_SEEDS = 1 << 64


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


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j``'s settings: a seeded request's choices draw from seeds ``seed + j`` (wrapped
    into the API's range), so they differ from each other and repeat on every run."""
    if j == 0 or params.seed is None:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed - _SEEDS if seed >= _SEEDS else seed)


def not_running(engine: EngineClient) -> Unavailable | ProtocolError:
    """The 503 of an engine that is not running: its own reason (``engine.unavailable()``: the
    router's missing worker role, a dead engine core), else ``engine_not_running``."""
    reason = engine.unavailable()
    if reason is not None:
        return reason
    return ProtocolError("engine is not running", type="server_error", code="engine_not_running", status=503)


class _Streams:
    """The engine streams of a job's choices, opened in the order that shares prompt KV."""

    def __init__(self, engine: EngineClient, job: Job, metrics: ServerMetrics) -> None:
        self.engine, self.job = engine, job
        self.gens: dict[int, AsyncIterator[RequestOutput]] = {}
        self.timers: dict[int, RequestTimer] = {
            c.index: metrics.timer(len(c.prompt_ids)) for c in job.choices
        }
        self.firsts: dict[int, RequestOutput] = {}
        self.readers: list[asyncio.Task[None]] = []  # n > 1: one task reads each choice's stream

    async def _first(self, c: Choice) -> None:
        gen = self.engine.generate(c.prompt_ids, c.params, c.engine_id, media=c.media)
        self.gens[c.index] = gen
        try:
            self.firsts[c.index] = await anext(gen)
        except ValueError as e:
            raise ProtocolError(str(e)) from e

    async def _start_prompt(self, group: list[Choice]) -> None:
        await self._first(group[0])
        if len(group) > 1:
            await asyncio.gather(*(self._first(c) for c in group[1:]))

    async def start(self) -> None:
        """Open every choice's stream and await its first output (ProtocolError: refused)."""
        groups: dict[int, list[Choice]] = {}
        for c in self.job.choices:
            groups.setdefault(c.prompt_index, []).append(c)
        await asyncio.gather(*(self._start_prompt(g) for g in groups.values()))

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput, bool]]:
        """(choice, output, is its first) for every output of the job, each choice's in order."""
        for c in self.job.choices:
            yield c, self.firsts[c.index], True
        live = [c for c in self.job.choices if not self.firsts[c.index].finished]
        if len(live) == 1:
            async for out in self._rest(live[0]):
                yield live[0], out, False
            return
        queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException]] = asyncio.Queue()

        async def pump(c: Choice) -> None:
            try:
                async for out in self._rest(c):
                    queue.put_nowait((c, out))
            except Exception as e:  # to the consumer, which ends the job with it
                queue.put_nowait((c, e))

        tasks = [asyncio.create_task(pump(c)) for c in live]
        self.readers += tasks
        try:
            remaining = len(live)
            while remaining:
                c, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield c, item, False
                remaining -= item.finished
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _rest(self, c: Choice) -> AsyncIterator[RequestOutput]:
        gen = self.gens[c.index]
        while True:
            try:
                out = await anext(gen)
            except StopAsyncIteration:
                raise RuntimeError(f"engine stream of {c.engine_id} ended without finishing") from None
            except ValueError as e:  # the engine failed this request alone (its grammar broke)
                raise ProtocolError(str(e)) from e
            yield out
            if out.finished:
                return

    def observe(self, c: Choice, out: RequestOutput) -> None:
        self.timers[c.index].observe(out)

    def discard(self) -> None:
        for t in self.timers.values():
            t.discard()

    async def close(self) -> None:
        """Abort what is unfinished (no-op for finished requests and timers). The readers stop
        first: closing an engine stream while another task awaits it fails (and would leave that
        choice generating). Runs to the end even when the caller is cancelled (a client gone)."""
        for timer in self.timers.values():
            timer.abort()
        with anyio.CancelScope(shield=True):
            for task in self.readers:
                task.cancel()
            await asyncio.gather(*self.readers, return_exceptions=True)
            await asyncio.gather(*(_aclose(g) for g in self.gens.values()), return_exceptions=True)


class OpenAIServer:
    """Request handling shared by the endpoints: checks, engine calls, streaming, disconnects.

    Args:
        engine: A started (or to-be-started) engine client.
        metrics: Where to record latencies and finished requests.
        max_logprobs: Largest ``logprobs`` / ``top_logprobs`` / ``prompt_logprobs`` accepted.
        chat_template: Jinja chat template used instead of the tokenizer's (``api.chat_template``).
        media_options: media limits and sources (``api.media``) of a multimodal model.
    """

    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        max_logprobs: int = MAX_LOGPROBS,
        chat_template: str | None = None,
        media_options: MediaOptions | None = None,
    ) -> None:
        self.engine = engine
        mm = engine.media_config
        self.media = None if mm is None else MediaFront(mm, engine.tokenizer, media_options)
        self.metrics = metrics
        self.model_name = engine.model_name
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
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
            if any(m.media_parts() for m in req.messages):
                raise ProtocolError("/tokenize does not lay out images, audio or video", param="messages")
            text = await self._render_chat(
                [m.template_dict() for m in req.messages],
                {"add_generation_prompt": req.add_generation_prompt},
            )
            ids = await self.encoder.encode(text, max_len, "messages", req.add_special_tokens)
        else:
            ids = await self.encoder.encode(req.prompt, max_len, "prompt", req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=max_len, tokens=ids)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        return tokenizer_info(self.engine.tokenizer, self.engine.max_model_len, self.chat_template)

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

    def _job(self, prefix: str, return_ids: bool, n: int) -> Job:
        return Job(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name, return_ids, [], n)

    def _add_choices(
        self,
        job: Job,
        k: int,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        echo: str | None,
        media: MediaInputs | None = None,
    ) -> None:
        """Choices ``k * n ..`` of prompt ``k`` (ids checked against the vocabulary; media
        placeholders by the engine)."""
        vocab = self.engine.model_config.vocab_size
        check_token_ids(prompt_ids if media is None else text_ids(prompt_ids), vocab, prompt_param)
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids([t for t, _ in params.logit_bias], vocab, "logit_bias")
        for j in range(job.n):
            index = k * job.n + j
            engine_id = job.request_id if index == 0 else f"{job.request_id}-{index}"
            mine = None if media is None else dataclasses.replace(media, embeds=dict(media.embeds))
            job.choices.append(
                Choice(index, k, engine_id, prompt_ids, choice_params(params, j), echo, media=mine)
            )

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        prompts: list[Prompt] = req.prompt_inputs()
        structured = await structured_output(req)
        job = self._job("cmpl", req.return_token_ids, req.num_choices)
        for k, prompt in enumerate(prompts):
            param = "prompt"
            if isinstance(prompt, list):
                prompt_ids = list(prompt)
            else:
                prompt_ids = await self.encoder.encode(prompt, self.engine.max_model_len, param)
            if not prompt_ids:
                raise ProtocolError("prompt must not be empty (it encodes to no tokens)", param=param)
            params = req.sampling_params(len(prompt_ids), self.engine.max_model_len, self.max_logprobs)
            params = dataclasses.replace(params, structured=structured)
            echo = None
            if req.echo:
                echo = (
                    prompt
                    if isinstance(prompt, str)
                    else await asyncio.to_thread(self.engine.tokenizer.decode, prompt_ids)
                )
            self._add_choices(job, k, prompt_ids, params, param, echo)
        renderer = CompletionRenderer(
            self.texts, req.include_usage, req.prompt_logprobs is not None, req.continuous_usage
        )
        return await self._run(job, renderer, req, raw)

    async def _render_chat(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
        try:
            return await asyncio.to_thread(  # off the loop: a long conversation renders for a while
                self.engine.tokenizer.apply_chat_template,
                messages,
                tokenize=False,
                chat_template=self.chat_template,  # None: the tokenizer's
                **options,
            )
        except Exception as e:  # template errors (bad role order, no template) are the request's fault
            raise ProtocolError(f"could not apply the chat template: {e}", param="messages") from e

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(req.model)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        structured = await structured_output(req)
        options = req.template_options()
        if tools.render is not None:
            options["tools"] = tools.render
        parts = req.media_parts()
        loaded = await self._load_media(parts) if parts else []
        markers = self.media.markers if self.media is not None else None
        text = await self._render_chat(req.template_messages(markers), options)
        prompt_ids = await self.encoder.encode(text, self.engine.max_model_len, "messages", False)
        if not prompt_ids:
            raise ProtocolError("messages render to an empty prompt", param="messages")
        media = None
        if loaded:
            assert self.media is not None
            details = [getattr(getattr(p, "image_url", None), "detail", None) for p in parts]
            mp = await asyncio.to_thread(self.media.expand, prompt_ids, loaded, details)
            prompt_ids = mp.ids
            try:
                media = await self.engine.media_inputs(mp.spans, mp.items, mp.item_spans)
            except (MediaError, ValueError) as e:
                raise ProtocolError(str(e), param="messages") from e
        params = req.sampling_params(len(prompt_ids), self.engine.max_model_len, self.max_logprobs)
        params = dataclasses.replace(params, structured=structured)
        if media is not None and params.prompt_logprobs is not None:
            raise ProtocolError(
                "prompt_logprobs is not supported for prompts with media", param="prompt_logprobs"
            )
        if tools.constraint is not None:
            if structured is not None:
                raise ProtocolError(
                    "tool_choice 'required' or a named function constrains the output itself; "
                    "it cannot be combined with response_format or guided_*",
                    param="tool_choice",
                )
            params = dataclasses.replace(params, structured=await checked(tools.constraint, "tools"))
        job = self._job("chatcmpl", req.return_token_ids, req.num_choices)
        self._add_choices(job, 0, prompt_ids, params, "messages", None, media)
        renderer = ChatRenderer(
            self.texts, req.include_usage, req.top_logprobs or 0, tools, req.continuous_usage
        )
        return await self._run(job, renderer, req, raw)

    async def _load_media(self, parts: list[Any]) -> list[tuple[str, bytes]]:
        """The bytes of each media part, after the count limits (ProtocolError: 400)."""
        if self.media is None:
            raise ProtocolError("this model takes no images, audio or video", param="messages")
        modalities = [str(part_modality(p)) for p in parts]
        self.media.check_counts(modalities)
        for p in parts:
            self.media.check_part(p)
        datas = await asyncio.gather(
            *(self.media.load(part_url(p), m) for p, m in zip(parts, modalities, strict=True))
        )
        return list(zip(modalities, datas, strict=True))

    async def _run(
        self, job: Job, renderer: Renderer, req: CompletionRequest | ChatCompletionRequest, raw: Request
    ) -> Response:
        if not self.engine.running:
            raise not_running(self.engine)
        streams = _Streams(self.engine, job, self.metrics)
        handed_over = False
        try:
            await unless_disconnected(raw, streams.start())
            if req.stream:
                handed_over = True
                return EventSourceResponse(self._events(streams, renderer, req.include_usage), sep="\n")
            await unless_disconnected(raw, self._collect(streams))
            return JSONResponse(renderer.response(job))
        except ProtocolError:
            streams.discard()  # refused by the engine: not a finished request
            raise
        except ClientGone:
            logger.info("client went away; aborted %s", job.request_id)
            return Response(status_code=499)
        finally:
            if not handed_over:
                await streams.close()

    async def _collect(self, streams: _Streams) -> None:
        async for c, out, _ in streams.outputs():
            streams.observe(c, out)
            c.add(out)

    async def _events(self, streams: _Streams, renderer: Renderer, include_usage: bool) -> AsyncIterator[str]:
        job = streams.job
        try:
            async for c, out, first in streams.outputs():
                streams.observe(c, out)
                c.add(out)
                for chunk in renderer.chunks(job, c, out, first):
                    yield sse_data(chunk)
                # a send to a gone client may not suspend, nor may a queue with outputs waiting:
                # let the loop run, so the disconnect is seen within one output
                await asyncio.sleep(0)
            if include_usage:
                yield sse_data(renderer.usage_chunk(job))
            yield "[DONE]"
        except Unavailable as e:  # no capacity after the stream started: say so, end it
            logger.warning("stream %s: %s", job.request_id, e)
            yield sse_data(error_body(str(e), "server_error", code=e.code))
            yield "[DONE]"
        except ProtocolError as e:  # the engine failed this request alone (its grammar broke)
            logger.warning("stream %s: %s", job.request_id, e)
            yield sse_data(error_body(e.message, e.type, e.param, e.code))
            yield "[DONE]"
        except Exception as e:  # an engine failure after the stream started: tell the client, end it
            logger.exception("stream %s failed", job.request_id)
            yield sse_data(error_body(f"internal error: {e}", "server_error"))
            yield "[DONE]"
        finally:
            await streams.close()
