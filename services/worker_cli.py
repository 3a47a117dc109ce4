"""Command line of a worker process (``python -m services.prefill`` / ``python -m services.decode``).

The engine flags are ``swaserve serve``'s (``swaserve.options.ENGINE_OPTIONS``: same names, defaults
and help), except that prefix caching defaults to on for prefill and off for decode workers. A
prefill worker given ``--redis-url`` (explicitly: ``REDIS_URL`` in the environment is for routers,
and a stream nobody reads in approximate mode would only cost work) publishes its prefix cache's block
events for the routers' precise-mode index (``--index-block-tokens``, default 64).
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
            typer.Option(help="prefill: publish prefix-cache events to this Redis (precise index mode)."),
        ] = None,
        index_namespace: Annotated[
            str, typer.Option(help="prefill: the routers' Redis namespace for cache events.")
        ] = "swaserve",
        instance_id: Annotated[
            str | None,
            typer.Option(
                help="prefill: this worker's name in the index (default: HOST:PORT, as routers dial it)."
            ),
        ] = None,
        index_block_tokens: Annotated[
            int | None,
            typer.Option(
                min=1,
                help="prefill: tokens per index block, a multiple of --page-size (default 64 with --redis-url).",
            ),
        ] = None,
    ) -> None:
        from services.worker import WorkerOptions, serve_worker
        from swaserve.engine.factory import build_engine_client
        from swaserve.model.checkpoint import default_model_dir

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
        model_dir = model or Path(default_model_dir())
        engine_config = _with_index_events(role, engine_config, redis_url, index_block_tokens)
        dead: list[str] = []
        tasks: list[asyncio.Task[None]] = []

        def on_dead(message: str) -> None:  # the engine core died: exit non-zero, to be restarted
            logging.getLogger("swaserve.worker").error("%s: shutting down", message)
            dead.append(message)
            for t in tasks:
                t.cancel()

        engine = build_engine_client(model_dir, engine_config, on_dead=on_dead, num_threads=num_threads)
        from swaserve.routing.buckets import parse_range

        try:
            prompt_range = parse_range(prompt_len_range) if prompt_len_range else None
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--prompt-len-range") from e
        opts = WorkerOptions(role, host, port, metrics_port, staging_memory, staging_ttl, prompt_range)
        opts.redis_url, opts.index_namespace, opts.instance_id = redis_url, index_namespace, instance_id

        async def run() -> None:
            task = asyncio.create_task(serve_worker(engine, opts))
            tasks.append(task)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, task.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(run())
        if dead:
            raise typer.Exit(1)

    return app
