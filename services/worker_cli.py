"""Command line of a worker process (``python -m services.prefill`` / ``python -m services.decode``).

The engine flags are ``swaserve serve``'s (``swaserve.options.ENGINE_OPTIONS``: same names, defaults
and help), except that prefix caching defaults to on for prefill and off for decode workers. A
prefill worker given ``--redis-url`` (or ``SWASERVE_INDEX_REDIS_URL``; not ``REDIS_URL`` in the environment is for routers,
and a stream nobody reads in approximate mode would only cost work) publishes its prefix cache's block
events for the routers' precise-mode index (``--index-block-tokens``, default 64).

SIGTERM (or SIGINT) drains the worker (``services.worker_serve.drain``: health NOT_SERVING, new work
refused, streams in flight finish within ``--shutdown-timeout``) and exits 0; a second signal, or
one before the worker is ready, stops it at once. TLS: ``--grpc-tls-*`` (``services.tls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from swaserve.config import EngineConfig
from swaserve.front_options import (
    GrpcTlsCaOption,
    GrpcTlsCertOption,
    GrpcTlsKeyOption,
    GrpcTlsServerNameOption,
)
from swaserve.kvcache.hashing import DEFAULT_BLOCK_TOKENS
from swaserve.options import engine_options, size_option


def _with_index_events(
    role: str, config: EngineConfig, redis_url: str | None, block_tokens: int | None
) -> EngineConfig:
    """``config`` with ``index_block_tokens`` set when this worker publishes cache events: a prefill
    worker with a Redis URL and a prefix cache (events with nobody draining them would pile up)."""
    if role != "prefill" or not redis_url:
        return config
    if not config.enable_prefix_caching:
        if block_tokens is not None:
            raise typer.BadParameter("needs prefix caching", param_hint="--index-block-tokens")
        logging.getLogger("swaserve.worker").warning("no prefix cache: no cache events to publish")
        return config
    B = block_tokens or DEFAULT_BLOCK_TOKENS
    if B % config.page_size:
        raise typer.BadParameter(
            f"{B} is not a multiple of --page-size {config.page_size}", param_hint="--index-block-tokens"
        )
    return dataclasses.replace(config, index_block_tokens=B)


def worker_app(role: str) -> typer.Typer:
    app = typer.Typer(add_completion=False, help=f"swaserve {role} worker (gRPC).")

    @app.command()
    @engine_options(
        enable_prefix_caching=(role == "prefill", "Prefix cache (default: on for prefill, off for decode).")
    )
    def main(
        model: Annotated[
            Path | None, typer.Option(help="Checkpoint directory (default: bundled model).")
        ] = None,
        host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, help="gRPC port (0 = a free one, printed).")] = 0,
        metrics_port: Annotated[
            int | None, typer.Option(min=0, help="Prometheus /metrics port (default: none).")
        ] = None,
        engine_config: EngineConfig = None,  # type: ignore[assignment]  # the ENGINE_OPTIONS flags
        staging_memory: Annotated[
            int, typer.Option(parser=size_option, metavar="BYTES", help="decode: host bytes for staged KV.")
        ] = "1GiB",  # type: ignore[assignment]
        staging_ttl: Annotated[float, typer.Option(min=1.0, help="decode: seconds staged KV waits.")] = 120.0,
        media_staging_memory: Annotated[
            int,
            typer.Option(
                parser=size_option,
                metavar="BYTES",
                help="prefill: media embeddings fetched from encoders, held at once.",
            ),
        ] = "1GiB",  # type: ignore[assignment]
        media_fetch_timeout: Annotated[
            float,
            typer.Option(min=0.1, help="prefill: seconds one media item's fetch (its encoding) may take."),
        ] = 60.0,
        num_threads: Annotated[
            int | None,
            typer.Option(
                min=1, help="CPU threads for torch (default: torch's choice, at most the usable CPUs)."
            ),
        ] = None,
        prompt_len_range: Annotated[
            str | None,
            typer.Option(help="prefill: prompt lengths this worker serves, LO-HI tokens (e.g. 0-64k, 64k-)."),
        ] = None,
        redis_url: Annotated[
            str | None,
            typer.Option(
                envvar="SWASERVE_INDEX_REDIS_URL",
                help="prefill: publish prefix-cache events to this Redis (precise index mode). Not "
                "REDIS_URL (that one is the routers'); the variable keeps a password off the command line.",
            ),
        ] = None,
        index_namespace: Annotated[
            str, typer.Option(help="prefill: the routers' Redis namespace for cache events.")
        ] = "swaserve",
        instance_id: Annotated[
            str | None,
            typer.Option(
                help="The address routers dial this worker at (its name in the prefix index and its "
                "metrics' worker label; default: HOST:PORT). Behind a 0.0.0.0 bind: the pod IP and port."
            ),
        ] = None,
        served_model_name: Annotated[
            str | None,
            typer.Option(help="The model_name label of its metrics (as the routers' --served-model-name)."),
        ] = None,
        index_block_tokens: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="prefill: tokens per index block, a multiple of --page-size (default 64 with --redis-url).",
            ),
        ] = None,
        shutdown_timeout: Annotated[
            float,
            typer.Option(
                min=0.0,
                help="On SIGTERM: seconds the requests in flight may take to finish (no new ones are "
                "taken, health says NOT_SERVING); then the rest is cut (routers resume it elsewhere).",
            ),
        ] = 30.0,
        health_port: Annotated[
            int | None,
            typer.Option(
                min=0,
                help="Also serve grpc.health.v1, in plaintext, on this port (kubelet probes of a TLS worker).",
            ),
        ] = None,
        grpc_tls_cert: GrpcTlsCertOption = None,
        grpc_tls_key: GrpcTlsKeyOption = None,
        grpc_tls_ca: GrpcTlsCaOption = None,
        grpc_tls_server_name: GrpcTlsServerNameOption = None,
    ) -> None:
        from services.tls import Dialer, server_credentials
        from services.worker import WorkerOptions
        from services.worker_serve import serve_worker
        from swaserve.engine.factory import build_engine_client, check_ep, check_kv_formats
        from swaserve.model.checkpoint import default_model_dir

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
        log = logging.getLogger("swaserve.worker")
        if (grpc_tls_cert is None) != (grpc_tls_key is None):
            raise typer.BadParameter("give both or neither", param_hint="--grpc-tls-cert/--grpc-tls-key")
        try:  # read now: a bad file stops the worker before the model loads
            dialer = Dialer.from_flags(grpc_tls_ca, grpc_tls_server_name)
            creds = None
            if grpc_tls_cert is not None and grpc_tls_key is not None:
                creds = server_credentials(grpc_tls_cert, grpc_tls_key)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from e
        model_dir = model or Path(default_model_dir())
        engine_config = _with_index_events(role, engine_config, redis_url, index_block_tokens)
        dead: list[str] = []
        tasks: list[asyncio.Task[None]] = []

        def on_dead(message: str) -> None:  # the engine core died: exit non-zero, to be restarted
            logging.getLogger("swaserve.worker").error("%s: shutting down", message)
            dead.append(message)
            for t in tasks:
                t.cancel()

        try:
            check_ep(model_dir, engine_config)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--ep-size") from e
        try:
            check_kv_formats(model_dir, engine_config)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--kv-cache-dtype") from e
        engine = build_engine_client(model_dir, engine_config, on_dead=on_dead, num_threads=num_threads)
        from swaserve.routing.buckets import parse_range

        try:
            prompt_range = parse_range(prompt_len_range) if prompt_len_range else None
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--prompt-len-range") from e
        opts = WorkerOptions(role, host, port, metrics_port, staging_memory, staging_ttl, prompt_range)
        opts.redis_url, opts.index_namespace, opts.instance_id = redis_url, index_namespace, instance_id
        opts.served_model_name = served_model_name
        opts.media_staging_bytes, opts.media_fetch_timeout_s = media_staging_memory, media_fetch_timeout
        opts.shutdown_timeout_s, opts.health_port = shutdown_timeout, health_port
        opts.credentials, opts.dialer = creds, dialer

        async def run() -> None:
            ready, drain = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(serve_worker(engine, opts, ready, drain))
            tasks.append(task)

            def on_signal(sig: signal.Signals) -> None:
                if drain.is_set() or not ready.is_set():  # a second signal, or nothing to drain yet
                    log.warning("%s: stopping now", sig.name)
                    task.cancel()
                else:
                    log.info("%s: draining (up to %.0f s; again to stop now)", sig.name, shutdown_timeout)
                    drain.set()

            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, on_signal, sig)
            with contextlib.suppress(asyncio.CancelledError):
                await task
            log.info("stopped")

        asyncio.run(run())
        if dead:
            raise typer.Exit(1)

    return app
