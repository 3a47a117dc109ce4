"""The worker service shell: one engine in the prefill or decode role behind gRPC.

``WorkerService``: the ``Worker`` servicer (``Generate``, ``Abort``, ``GetLoad``); decode workers
receive KV into verified host staging (``services.kv_receiver``) that ``Generate`` admits; a
prefill worker runs to the first token and pushes the KV to ``kv_target``. The engine is a
``LocalEngineClient``; the module holds no policy. The process around it (gRPC server, health,
reflection, metrics port, cache-event pump, ``drain`` on SIGTERM) is ``services.worker_serve``.

Design notes: docs/DESIGN.md#servicesworkerpy"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from services.convert import (
    ENGINE_NOT_RUNNING,
    WORKER_DRAINING,
    WORKER_FEATURES,
    chunk_message,
    media_from_proto,
    params_from_proto,
    usage,
)
from services.kv_receiver import staging_for, transfer_layers
from services.media_fetch import MediaFetcher, MediaFetchError, MediaRejected
from services.tls import Dialer
from services.transport import GrpcKVSender, KVSender
from services.worker_metrics import WorkerMetrics
from swaserve.engine.client import LocalEngineClient
from swaserve.engine.types import FinishReason, SamplingParams
from swaserve.kvformat import engine_formats, format_label
from swaserve.media.placeholders import MediaInputs
from swaserve.model.identity import model_identity
from swaserve.routing.buckets import ALL_LENGTHS
from swaserve.transfer.kv_transfer import KVPayload, TransferError
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.worker")
ROLES = ("prefill", "decode")
PUSH_MARGIN_S = (
    2.0  # a KV push ends this long (at most a tenth of the time left) before the request's deadline
)


@dataclass
class WorkerOptions:
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int | None = None
    staging_bytes: int = 1 << 30
    staging_ttl_s: float = 120.0
    prompt_range: tuple[int, int] | None = None  # prefill: prompt-length bucket [lo, hi) it serves
    redis_url: str | None = None  # prefill: publish cache events there (needs index_block_tokens)
    index_namespace: str = "swaserve"  # the routers' Redis namespace
    instance_id: str | None = None  # this worker in the index (default: host:port, as the router names it)
    shutdown_timeout_s: float = 30.0  # drain: longest wait for the streams in flight (seconds)
    health_port: int | None = None  # an extra plaintext port with grpc.health.v1 only (kubelet probes)
    credentials: grpc.ServerCredentials | None = None  # TLS on the main port (services.tls); None: plaintext
    dialer: Dialer = field(default_factory=Dialer)  # how a prefill worker dials decode workers (KV push)
    served_model_name: str | None = None  # the model_name label of its metrics (default: the checkpoint's)
    media_staging_bytes: int = 1 << 30  # prefill: media embeddings fetched and held at once
    media_fetch_timeout_s: float = 60.0  # prefill: one media item's fetch from its encoder


class WorkerService(wgrpc.WorkerServicer):
    def __init__(self, engine: LocalEngineClient, opts: WorkerOptions, metrics: WorkerMetrics) -> None:
        self.engine, self.opts, self.metrics = engine, opts, metrics
        self.staging = staging_for(engine, opts.staging_bytes) if opts.role == "decode" else None
        self.staged_at: dict[str, float] = {}  # staged transfers (open or complete) -> when begun
        self._max_transfer: tuple[int, int] | None = None  # (max_model_len, longest prompt staged)
        self.media = MediaFetcher(opts.dialer, opts.media_staging_bytes, opts.media_fetch_timeout_s)
        self.aborted: dict[str, float] = {}  # recently aborted ids: a late transfer for them is refused
        self.open = 0
        self.draining = False  # shutting down: new Generate calls refused, streams in flight finish
        cfg = engine.model_config
        mdigest = None if engine.media_config is None else engine.media_config.digest()
        self.identity = model_identity(cfg, engine.tokenizer, engine.model_name, mdigest)
        formats = engine_formats(engine.engine_config, cfg)
        label = format_label(str(engine.kv_dtype).removeprefix("torch."), formats)
        ecfg = engine.engine_config  # KV transfers need all of these to agree
        layout = "" if ecfg.kv_layout == "hybrid" else f" layout={ecfg.kv_layout}"
        self.kv_format = f"{label} page={ecfg.page_size}{layout}"
        self.boot_id = uuid.uuid4().hex  # this process: a restart draws a new one
        self.sender: KVSender = GrpcKVSender(
            engine.engine_config.page_size,
            transfer_layers(engine),
            dialer=opts.dialer,
        )

    def staged(self) -> int:
        """Decode role: KV transfers staged here (received or arriving) not yet claimed by a Generate."""
        return len(self.staging.open_ids()) if self.staging is not None else 0

    # -- Generate -----------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
        handed_over = request.HasField("first_token") and self.staging is not None and self.staging.ready(rid)
        if self.draining and not handed_over:  # a decode request whose KV is here still runs
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{WORKER_DRAINING} (shutting down): send it to another worker"
            )
        try:
            params = params_from_proto(request.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        prompt = list(request.prompt_token_ids)
        if not rid or not prompt:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id and prompt_token_ids are required"
            )
        prefilled: tuple[int, KVPayload] | None = None
        if request.HasField("first_token"):
            if self.staging is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "first_token sent to a prefill worker"
                )
            assert self.staging is not None
            try:
                prefilled = (request.first_token, self.staging.claim(rid))
            except TransferError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no KV staged: {e}")
            self.staged_at.pop(rid, None)
        try:
            media = media_from_proto(request.media)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        export = self.opts.role == "prefill" and bool(request.kv_target)
        left = context.time_remaining()  # the router's deadline: the KV push ends before it
        deadline = None if left is None else time.monotonic() + left
        self.open += 1
        try:
            async for m in self._generate(
                rid, prompt, params, request.kv_target, export, prefilled, media, deadline
            ):
                yield m
        finally:
            self.open -= 1
            self.media.release(rid)

    async def _generate(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        kv_target: str,
        export: bool,
        prefilled: tuple[int, KVPayload] | None,
        media: MediaInputs | None = None,
        deadline: float | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        fetch: asyncio.Task[None] | None = None
        failed: list[MediaFetchError] = []
        try:
            gen = self.engine.generate(
                prompt, params, rid, export_kv=export, prefilled=prefilled, media=media
            )
            async for o in gen:
                if o.media_wanted and media is not None:
                    fetch = asyncio.create_task(self._fetch_media(rid, media, o.media_wanted, failed))
                    continue
                if o.new_token_ids:
                    self.media.release(rid)  # the prompt (its media) is in the KV now
                if failed and o.finished:  # bad media: the client's error; else another worker may do it
                    bad = isinstance(failed[0], MediaRejected)
                    code = grpc.StatusCode.INVALID_ARGUMENT if bad else grpc.StatusCode.UNAVAILABLE
                    err = pb.Error(message=str(failed[0]), retryable=not bad, code=code.value[0])
                    yield pb.GenerateResponse(error=err, usage=usage(o))
                    return
                if o.new_token_ids or o.new_text or o.prompt_logprobs is not None:
                    m = chunk_message(o)
                    if o.finished and o.finish_reason not in (None, FinishReason.HANDOFF):
                        m.chunk.finish_reason = o.finish_reason.value  # the client's last chunk
                    yield m
                if not o.finished:
                    continue
                sent = 0
                if o.finish_reason == FinishReason.HANDOFF:
                    assert o.kv_payload is not None
                    try:
                        sent = await self._push(kv_target, o.kv_payload, deadline)
                    except (grpc.aio.AioRpcError, TransferError) as e:
                        self.metrics.kv_failed.inc()
                        if isinstance(e, grpc.aio.AioRpcError):
                            msg, code = e.details(), e.code().value[0]
                        else:
                            msg, code = str(e), 0
                        yield pb.GenerateResponse(
                            error=pb.Error(
                                message=f"KV transfer to {kv_target} failed: {msg}",
                                retryable=True,
                                code=code,
                            ),
                            usage=usage(o),
                        )
                        return
                reason = o.finish_reason.value if o.finish_reason is not None else "stop"
                yield pb.GenerateResponse(
                    complete=pb.Complete(finish_reason=reason, kv_bytes_sent=sent), usage=usage(o)
                )
        except ValueError as e:  # refused by the engine before any output
            yield pb.GenerateResponse(error=pb.Error(message=str(e), retryable=False))
        except RuntimeError as e:  # engine stopped or failed: another worker may do it
            yield pb.GenerateResponse(error=pb.Error(message=str(e), retryable=True))
        finally:
            if fetch is not None and not fetch.done():
                fetch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await fetch

    async def _fetch_media(
        self, rid: str, media: MediaInputs, wanted: list[int], failed: list[MediaFetchError]
    ) -> None:
        """Fetch and hand over a request's missing media; on failure end it (``failed`` says why:
        the stream then ends with a retryable error, or a refusal for media the encoder found bad)."""
        try:
            await self.media.supply(self.engine, rid, media, wanted, self.engine.model_config.hidden_size)
        except MediaFetchError as e:
            log.warning("request %s: %s", rid, e)
            self.metrics.media_fetch_failed.inc()
            failed.append(e)
            await self.engine.abort(rid)

    async def _push(self, target: str, payload: KVPayload, deadline: float | None = None) -> int:
        """Send ``payload`` to ``target`` (``self.sender``); returns the K/V bytes sent. With the
        Generate call's ``deadline`` (``time.monotonic()``), the push ends a margin before it, so
        that a hung decode worker fails the push (the router blames and avoids it) rather than
        the router's deadline failing this prefill worker's call.

        Raises:
            TransferError: no time left; the sender's errors."""
        timeout = None
        if deadline is not None:
            left = deadline - time.monotonic()
            timeout = left - min(PUSH_MARGIN_S, 0.1 * left)
            if timeout <= 0:
                raise TransferError("no time left for the KV transfer before the request's deadline")
        sent = await self.sender.send(target, payload, timeout)
        self.metrics.kv_sent.inc(sent)
        self.metrics.kv_request.observe(sent)
        return sent

    # -- Abort / GetLoad ------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        found = self.engine.has_request(rid)
        await self.engine.abort(rid)
        if self.staging is not None:
            self.aborted[rid] = time.monotonic()  # the KV may still be on its way
        if self.staging is not None and rid in self.staging.open_ids():
            self.staging.discard(rid)
            self.staged_at.pop(rid, None)
            found = True
        return pb.AbortResponse(found=found)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.Load:
        if not self.engine.running:  # starting, stopping, or its engine died or hung: not usable
            why = self.engine.unavailable()
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{ENGINE_NOT_RUNNING}: {why or 'not started or stopping'}"
            )
        st = self.engine.stats()
        lo, hi = self.opts.prompt_range or (0, 0)
        pools = {
            name: pb.PoolLoad(
                total_pages=p.total_pages,
                used_pages=p.used_pages,
                cached_pages=p.cached_pages,
                request_pages=p.request_pages,
                peak_used_pages=p.peak_used_pages,
                page_bytes=p.page_bytes,
                kv_format=p.kv_format,
            )
            for name, p in st.pools.items()
        }
        return pb.Load(
            role=self.opts.role,
            running=st.num_running,
            waiting=st.num_waiting,
            outstanding_tokens=max(0, st.outstanding_tokens),
            pools=pools,
            staged_bytes=self.staging.staged_bytes if self.staging is not None else 0,
            open_requests=self.open,
            prefill_tokens=st.prefill_tokens,
            min_prompt_tokens=lo,
            max_prompt_tokens=0 if hi >= ALL_LENGTHS[1] else hi,
            index_block_tokens=self.engine.engine_config.index_block_tokens or 0,
            queue_order=self.engine.engine_config.schedule_policy,
            model_fingerprint=self.identity.fingerprint,
            model_description=self.identity.description,
            boot_id=self.boot_id,
            steps=st.steps_total,
            computed_tokens=st.computed_tokens_total,
            draining=self.draining,
            kv_format=self.kv_format,
            max_model_len=self.engine.max_model_len,
            features=list(WORKER_FEATURES),
            max_transfer_tokens=self._max_transfer_tokens(),
        )

    def _max_transfer_tokens(self) -> int:
        """``Load.max_transfer_tokens`` (0: no staging), searched once per ``max_model_len``
        rather than on every poll."""
        if self.staging is None:
            return 0
        limit = self.engine.max_model_len
        if self._max_transfer is None or self._max_transfer[0] != limit:
            self._max_transfer = (limit, self.staging.max_tokens(limit))
        return self._max_transfer[1]

    async def expire_staging(self) -> None:
        """Drop transfers not claimed (or not completed) in time: a router that died between its
        two calls, a prefill worker that died mid-push; forget old aborted ids."""
        while True:
            await asyncio.sleep(max(1.0, self.opts.staging_ttl_s / 4))
            if self.staging is None:
                return
            now = time.monotonic()
            for rid, t in list(self.staged_at.items()):
                if now - t > self.opts.staging_ttl_s:
                    log.warning(
                        "dropping KV staged for %s: not claimed in %.0f s", rid, self.opts.staging_ttl_s
                    )
                    self.staging.discard(rid)
                    self.staged_at.pop(rid, None)
            for rid, t in list(self.aborted.items()):
                if now - t > self.opts.staging_ttl_s:
                    del self.aborted[rid]
