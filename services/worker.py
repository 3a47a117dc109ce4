"""The worker service shell: one engine in the prefill or decode role behind gRPC.

``Worker`` (``Generate``, ``Abort``, ``GetLoad``), on decode workers ``KVTransfer.Push`` into verified
host staging, ``grpc.health.v1`` (SERVING after load and warm-up), reflection; a prefill worker runs
to the first token and pushes the KV to ``kv_target``, and with ``redis_url`` publishes its cache's
block events. The engine is a ``LocalEngineClient``; the module holds no policy.

Design notes: docs/DESIGN.md#servicesworkerpy"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from services.convert import ENGINE_NOT_RUNNING, chunk_message, page_from_proto, params_from_proto, usage
from services.index_events import EventPump
from services.transport import GrpcKVSender, KVSender
from swaserve.config import FULL, SWA
from swaserve.engine.client import LocalEngineClient
from swaserve.engine.types import FinishReason, SamplingParams
from swaserve.model.identity import model_identity
from swaserve.routing.buckets import ALL_LENGTHS
from swaserve.routing.redis.events import RedisEventPublisher, stream_key
from swaserve.transfer.kv_transfer import KVPayload, KVStaging, LayerShape, StagingFull, TransferError
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.worker")
ROLES = ("prefill", "decode")


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


class WorkerMetrics:
    """Prometheus metrics of a worker (own registry; served on ``--metrics-port``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.kv_sent = Counter(
            "swaserve:kv_transfer_sent_bytes",
            "KV payload bytes pushed to decode workers",
            registry=self.registry,
        )
        self.kv_received = Counter(
            "swaserve:kv_transfer_received_bytes",
            "KV payload bytes received into staging",
            registry=self.registry,
        )
        self.kv_request = Histogram(
            "swaserve:kv_transfer_request_bytes",
            "KV payload bytes per transferred request",
            buckets=tuple(2**i for i in range(10, 36, 2)),
            registry=self.registry,
        )
        self.kv_failed = Counter(
            "swaserve:kv_transfer_failed", "KV transfers refused or failed", registry=self.registry
        )
        self.index_events = Counter(
            "swaserve:index_events",
            "prefix-cache block events for the router's index, by outcome (published, dropped)",
            ["outcome"],
            registry=self.registry,
        )


def staging_for(engine: LocalEngineClient, max_bytes: int) -> KVStaging:
    cfg, ecfg = engine.model_config, engine.engine_config
    return KVStaging(
        {FULL: len(cfg.full_layers), SWA: len(cfg.swa_layers)},
        {
            FULL: LayerShape(cfg.full.num_kv_heads, cfg.full.head_dim, cfg.full.v_head_dim),
            SWA: LayerShape(cfg.swa.num_kv_heads, cfg.swa.head_dim, cfg.swa.v_head_dim),
        },
        cfg.window if ecfg.kv_layout == "hybrid" else 1 << 40,
        ecfg.page_size,
        engine.kv_dtype,
        max_bytes,
    )


class WorkerService(wgrpc.WorkerServicer):
    def __init__(self, engine: LocalEngineClient, opts: WorkerOptions, metrics: WorkerMetrics) -> None:
        self.engine, self.opts, self.metrics = engine, opts, metrics
        self.staging = staging_for(engine, opts.staging_bytes) if opts.role == "decode" else None
        self.staged_at: dict[str, float] = {}  # staged transfers (open or complete) -> when begun
        self.aborted: dict[str, float] = {}  # recently aborted ids: a late transfer for them is refused
        self.open = 0
        cfg = engine.model_config
        self.identity = model_identity(cfg, engine.tokenizer, engine.model_name)
        self.boot_id = uuid.uuid4().hex  # this process: a restart draws a new one
        self.sender: KVSender = GrpcKVSender(
            engine.engine_config.page_size, {FULL: len(cfg.full_layers), SWA: len(cfg.swa_layers)}
        )

    # -- Generate -----------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id
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
        export = self.opts.role == "prefill" and bool(request.kv_target)
        self.open += 1
        try:
            async for m in self._generate(rid, prompt, params, request.kv_target, export, prefilled):
                yield m
        finally:
            self.open -= 1

    async def _generate(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        kv_target: str,
        export: bool,
        prefilled: tuple[int, KVPayload] | None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            gen = self.engine.generate(prompt, params, rid, export_kv=export, prefilled=prefilled)
            async for o in gen:
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
                        sent = await self._push(kv_target, o.kv_payload)
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

    async def _push(self, target: str, payload: KVPayload) -> int:
        """Send ``payload`` to ``target`` (``self.sender``); returns the K/V bytes sent."""
        sent = await self.sender.send(target, payload)
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
        )

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


class KVTransferService(kvgrpc.KVTransferServicer):
    """Decode side of the KV transfer: pages into ``KVStaging``. ``staged_at`` records when each
    transfer began (for expiry); a transfer for an id in ``aborted`` is refused or dropped; a
    transfer that fails or is cancelled midway is dropped at once."""

    def __init__(
        self,
        staging: KVStaging,
        metrics: WorkerMetrics,
        staged_at: dict[str, float],
        aborted: dict[str, float] | None = None,
    ) -> None:
        self.staging, self.metrics, self.staged_at = staging, metrics, staged_at
        self.aborted = aborted if aborted is not None else {}

    async def Push(
        self, request_iterator: AsyncIterator[kvpb.TransferMessage], context: grpc.aio.ServicerContext
    ) -> kvpb.TransferAck:
        rid: str | None = None
        num_pages = received = pages = 0
        done = False
        try:
            async for m in request_iterator:
                kind = m.WhichOneof("kind")
                if kind == "header":
                    if rid is not None:
                        raise TransferError("second header in one transfer")
                    if m.header.request_id in self.aborted:
                        raise TransferError(f"request {m.header.request_id!r} was aborted")
                    if m.header.request_id in self.staging.open_ids():  # a retry supersedes it
                        self.staging.discard(m.header.request_id)
                    self.staging.begin(m.header.request_id, m.header.num_tokens, m.header.sampler_state)
                    rid, num_pages = m.header.request_id, m.header.num_pages
                    self.staged_at[rid] = time.monotonic()
                elif kind == "page":
                    if rid is None or m.page.request_id != rid:
                        raise TransferError("page before its transfer's header")
                    self.staging.add(page_from_proto(m.page))
                    received += len(m.page.k) + len(m.page.v)
                    pages += 1
            if rid is None:
                raise TransferError("empty transfer")
            if pages != num_pages:
                raise TransferError(f"header announced {num_pages} pages, got {pages}")
            if rid in self.aborted:
                raise TransferError(f"request {rid!r} was aborted during its transfer")
            self.staging.finish(rid)
            done = True
        except StagingFull as e:  # no room now: the router tries another decode worker
            self.metrics.kv_failed.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except TransferError as e:
            self.metrics.kv_failed.inc()
            await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        finally:
            if not done and rid is not None:  # failed, refused or cancelled: nothing stays staged
                self.staging.discard(rid)
                self.staged_at.pop(rid, None)
        assert rid is not None
        self.metrics.kv_received.inc(received)
        return kvpb.TransferAck(request_id=rid, bytes_received=received, pages=pages)


async def _warm_up(engine: LocalEngineClient) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate([3, 4, 5, 6, 7], params, "warmup"):
        pass
    await engine.flush_cache()
    await engine.drain_cache_events()  # the warm-up's blocks came and went: nothing to publish


def start_event_pump(
    engine: LocalEngineClient, opts: WorkerOptions, port: int, metrics: WorkerMetrics
) -> EventPump | None:
    """The publisher of a prefill worker's cache events (None: not configured)."""
    if opts.role != "prefill" or not opts.redis_url:
        return None
    if engine.engine_config.index_block_tokens is None:
        log.warning("--redis-url without index block tokens: no cache events published")
        return None
    import redis

    client = redis.Redis.from_url(
        opts.redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
    )
    instance = opts.instance_id or f"{opts.host}:{port}"
    publisher = RedisEventPublisher(client, opts.index_namespace, instance)
    log.info(
        "publishing cache events of %d-token blocks as %s to %s",
        engine.engine_config.index_block_tokens,
        instance,
        stream_key(opts.index_namespace),
    )
    return EventPump(
        engine.drain_cache_events,
        publisher,
        on_count=lambda outcome, n: metrics.index_events.labels(outcome).inc(n),
    )


async def serve_worker(
    engine: LocalEngineClient, opts: WorkerOptions, ready: asyncio.Event | None = None
) -> None:
    """Run the worker until cancelled. Binds ``opts.host:opts.port`` (0 = a free port, logged as
    ``listening on HOST:PORT``)."""
    if opts.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {opts.role!r}")
    metrics = WorkerMetrics()
    if opts.metrics_port is not None:
        start_http_server(opts.metrics_port, addr=opts.host, registry=metrics.registry)
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    )
    worker = WorkerService(engine, opts, metrics)
    wgrpc.add_WorkerServicer_to_server(worker, server)
    names = [pb.DESCRIPTOR.services_by_name["Worker"].full_name]
    if opts.role == "decode":
        assert worker.staging is not None
        kvgrpc.add_KVTransferServicer_to_server(
            KVTransferService(worker.staging, metrics, worker.staged_at, worker.aborted), server
        )
        names.append(kvpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
    health_svc = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)
    for name in ("", *names):
        await health_svc.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(f"{opts.host}:{opts.port}")
    await server.start()
    print(f"{opts.role} worker listening on {opts.host}:{port}", flush=True)
    await engine.start()
    expire = asyncio.create_task(worker.expire_staging())
    pump: EventPump | None = None
    pump_task: asyncio.Task[None] | None = None
    try:
        await _warm_up(engine)
        pump = start_event_pump(engine, opts, port, metrics)
        if pump is not None:
            pump_task = asyncio.create_task(pump.run())
        for name in ("", *names):
            await health_svc.set(name, health_pb2.HealthCheckResponse.SERVING)
        print(f"{opts.role} worker ready on {opts.host}:{port}", flush=True)
        if ready is not None:
            ready.set()
        await server.wait_for_termination()
    finally:
        for name in ("", *names):  # a dead engine core, or a stop: no new requests
            await health_svc.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        expire.cancel()
        await server.stop(grace=2.0)
        await worker.sender.close()
        if pump_task is not None:
            pump_task.cancel()
        if pump is not None and engine.running:
            with contextlib.suppress(Exception):
                await pump.pump_async()  # the last events before the engine goes
        await engine.stop()
        if pump is not None:
            await asyncio.to_thread(pump.close, 2.0, False)
