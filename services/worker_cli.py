"""Command line of a worker process (``python -m services.prefill`` / ``python -m services.decode``).

The engine flags are ``swaserve serve``'s (``swaserve.cli.ENGINE_OPTIONS``: same names, defaults
and help), except that prefix caching defaults to on for prefill and off for decode workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from swaserve.cli import _size_option, engine_options
from swaserve.config import EngineConfig


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
            int, typer.Option(parser=_size_option, metavar="BYTES", help="decode: host bytes for staged KV.")
        ] = "1GiB",  # type: ignore[assignment]
        staging_ttl: Annotated[float, typer.Option(min=1.0, help="decode: seconds staged KV waits.")] = 120.0,
        num_threads: Annotated[
            int | None, typer.Option(min=1, help="CPU threads for torch (default: torch's choice).")
        ] = None,
    ) -> None:
        from services.worker import WorkerOptions, serve_worker
        from swaserve.engine.async_engine import AsyncLLMEngine
        from swaserve.model.checkpoint import default_model_dir

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        model_dir = model or Path(default_model_dir())
        engine = AsyncLLMEngine.from_model_dir(model_dir, engine_config)
        opts = WorkerOptions(role, host, port, metrics_port, staging_memory, staging_ttl)

        async def run() -> None:
            task = asyncio.create_task(serve_worker(engine, opts))
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, task.cancel)
            with contextlib.suppress(asyncio.CancelledError):
                await task

        asyncio.run(run())

    return app
