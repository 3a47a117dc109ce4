"""The worker process around ``WorkerService``: the gRPC server (Worker, KVTransfer on decode
workers, ``grpc.health.v1`` also in plaintext on ``health_port``, reflection), the metrics port,
the warm-up, a prefill worker's cache-event pump, and ``drain`` (SIGTERM: refuse new work, let the
streams finish within ``shutdown_timeout_s``, stop). ``services.worker_cli`` runs it.

Design notes: docs/DESIGN.md#servicesworkerpy"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.index_events import EventPump
from services.kv_receiver import KVTransferService
from services.worker import ROLES, WorkerOptions, WorkerService
from services.worker_metrics import WorkerLoadCollector, WorkerMetrics, serve_metrics
from swaserve.engine.client import LocalEngineClient
from swaserve.engine.types import SamplingParams
from swaserve.routing.redis.events import RedisEventPublisher, stream_key
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.worker")


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


async def drain(worker: WorkerService, kv: KVTransferService | None, timeout_s: float) -> bool:
    """Refuse new work (``worker.draining``) and wait until no Generate stream is open, no KV
    transfer is arriving and none staged waits for its Generate, at most ``timeout_s`` seconds.
    Returns whether everything finished (False: the timeout cut it short)."""
    worker.draining = True
    t0 = time.monotonic()

    def pushes() -> int:
        return kv.active if kv is not None else 0

    log.info(
        "draining: %d Generate streams open, %d KV transfers arriving, %d staged; waiting up to %.0f s",
        worker.open, pushes(), worker.staged(), timeout_s,
    )  # fmt: skip
    while worker.open or pushes() or worker.staged():
        if time.monotonic() - t0 >= timeout_s:
            log.warning(
                "drain timed out after %.0f s: cutting %d Generate streams, %d KV transfers arriving, "
                "%d staged (routers resume them elsewhere)",
                timeout_s, worker.open, pushes(), worker.staged(),
            )  # fmt: skip
            return False
        await asyncio.sleep(0.05)
    log.info("drained in %.1f s", time.monotonic() - t0)
    return True


async def serve_worker(
    engine: LocalEngineClient,
    opts: WorkerOptions,
    ready: asyncio.Event | None = None,
    drain_now: asyncio.Event | None = None,
) -> None:
    """Run the worker until cancelled, or until ``drain_now`` is set and ``drain`` has run (health
    NOT_SERVING first, on every service name). Binds ``opts.host:opts.port`` (0 = a free port,
    logged as ``listening on HOST:PORT``), TLS with ``opts.credentials``, and ``opts.health_port``."""
    if opts.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {opts.role!r}")
    metrics = WorkerMetrics()
    if opts.metrics_port is not None:
        serve_metrics(opts.metrics_port, opts.host, metrics.registry)
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    )
    worker = WorkerService(engine, opts, metrics)
    wgrpc.add_WorkerServicer_to_server(worker, server)
    names = [pb.DESCRIPTOR.services_by_name["Worker"].full_name]
    kv: KVTransferService | None = None
    if opts.role == "decode":
        assert worker.staging is not None
        kv = KVTransferService(
            worker.staging, metrics, worker.staged_at, worker.aborted, lambda: worker.draining
        )
        kvgrpc.add_KVTransferServicer_to_server(kv, server)
        names.append(kvpb.DESCRIPTOR.services_by_name["KVTransfer"].full_name)
    health_svc = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)

    async def set_health(status: health_pb2.HealthCheckResponse.ServingStatus.ValueType) -> None:
        for name in ("", *names):
            await health_svc.set(name, status)

    await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bind = f"{opts.host}:{opts.port}"
    if opts.credentials is not None:
        port = server.add_secure_port(bind, opts.credentials)
    else:
        port = server.add_insecure_port(bind)
    metrics.registry.register(
        WorkerLoadCollector(
            engine.stats,
            lambda: worker.staging.staged_bytes if worker.staging is not None else 0,
            opts.served_model_name or engine.model_name,
            opts.role,
            opts.instance_id or f"{opts.host}:{port}",
        )
    )
    probes: grpc.aio.Server | None = None
    if opts.health_port is not None:  # the same health servicer, in plaintext, nothing else
        probes = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_svc, probes)
        hport = probes.add_insecure_port(f"{opts.host}:{opts.health_port}")
        await probes.start()
        print(f"{opts.role} worker health (plaintext) on {opts.host}:{hport}", flush=True)
    await server.start()
    tls = " (TLS)" if opts.credentials is not None else ""
    print(f"{opts.role} worker listening on {opts.host}:{port}{tls}", flush=True)
    await engine.start()
    expire = asyncio.create_task(worker.expire_staging())
    pump: EventPump | None = None
    pump_task: asyncio.Task[None] | None = None
    try:
        await _warm_up(engine)
        pump = start_event_pump(engine, opts, port, metrics)
        if pump is not None:
            pump_task = asyncio.create_task(pump.run())
        await set_health(health_pb2.HealthCheckResponse.SERVING)
        print(f"{opts.role} worker ready on {opts.host}:{port}", flush=True)
        if ready is not None:
            ready.set()
        if drain_now is None:
            await server.wait_for_termination()
        else:
            await drain_now.wait()
            await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # readiness fails first
            await drain(worker, kv, opts.shutdown_timeout_s)
    finally:
        await set_health(health_pb2.HealthCheckResponse.NOT_SERVING)  # a dead engine core, or a stop
        worker.draining = True
        expire.cancel()
        # drained, timed out or a second signal: stop now; else (engine died) streams get 2 s
        await server.stop(grace=0 if drain_now is not None and drain_now.is_set() else 2.0)
        if probes is not None:
            await probes.stop(grace=None)
        log.info("gRPC server stopped (%d streams were still open)", worker.open)
        await worker.sender.close()
        await worker.media.close()
        if pump_task is not None:
            pump_task.cancel()
        if pump is not None and engine.running:
            with contextlib.suppress(Exception):
                await pump.pump_async()  # the last events before the engine goes
        await engine.stop()
        if pump is not None:
            await asyncio.to_thread(pump.close, 2.0, False)
