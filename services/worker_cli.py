"""Command line of a worker process (``python -m services.prefill`` / ``python -m services.decode``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path
from typing import Annotated, Literal

import typer

from swaserve.cli import _size_option


def worker_app(role: str) -> typer.Typer:
    app = typer.Typer(add_completion=False, help=f"swaserve {role} worker (gRPC).")

    @app.command()
    def main(
        model: Annotated[
            Path | None, typer.Option(help="Checkpoint directory (default: bundled model).")
        ] = None,
        host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(min=0, help="gRPC port (0 = a free one, printed).")] = 0,
        metrics_port: Annotated[
            int | None, typer.Option(min=0, help="Prometheus /metrics port (default: none).")
        ] = None,
        page_size: Annotated[int, typer.Option(min=1, help="Tokens per KV page.")] = 16,
        kv_cache_memory: Annotated[
            int, typer.Option(parser=_size_option, metavar="BYTES", help="KV cache bytes.")
        ] = "256MiB",  # type: ignore[assignment]
        kv_layout: Annotated[Literal["hybrid", "full"], typer.Option(help="KV layout.")] = "hybrid",
        max_num_seqs: Annotated[int, typer.Option(min=1, help="Most requests running at once.")] = 64,
        max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Token budget per step.")] = 512,
        dtype: Annotated[
            Literal["float32", "bfloat16", "float16"], typer.Option(help="Activation and KV dtype.")
        ] = "float32",
        device: Annotated[str | None, typer.Option(help="cpu, cuda, ... (default: CUDA if present).")] = None,
        enable_prefix_caching: Annotated[
            bool, typer.Option(help="Prefix cache (default: on for prefill, off for decode).")
        ] = role == "prefill",
        staging_memory: Annotated[
            int, typer.Option(parser=_size_option, metavar="BYTES", help="decode: host bytes for staged KV.")
        ] = "1GiB",  # type: ignore[assignment]
        staging_ttl: Annotated[float, typer.Option(min=1.0, help="decode: seconds staged KV waits.")] = 120.0,
        num_threads: Annotated[
            int | None, typer.Option(min=1, help="CPU threads for torch (default: torch's choice).")
        ] = None,
    ) -> None:
        from services.worker import WorkerOptions, serve_worker
        from swaserve.config import EngineConfig
        from swaserve.engine.async_engine import AsyncLLMEngine
        from swaserve.model.checkpoint import default_model_dir

        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")
        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        cfg = EngineConfig(
            page_size=page_size,
            kv_cache_memory=kv_cache_memory,
            kv_layout=kv_layout,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            dtype=dtype,
            device=device,
            enable_prefix_caching=enable_prefix_caching,
        )
        model_dir = model or Path(default_model_dir())
        engine = AsyncLLMEngine.from_model_dir(model_dir, cfg)
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
