"""``python -m services.router --help``: the OpenAI HTTP API over prefill and decode workers."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(add_completion=False, help="swaserve router: OpenAI API, dispatch to gRPC workers.")


@app.command()
def main(
    prefill: Annotated[list[str], typer.Option(help="Prefill worker host:port (repeatable).")],
    decode: Annotated[list[str], typer.Option(help="Decode worker host:port (repeatable).")],
    model: Annotated[Path | None, typer.Option(help="Checkpoint dir (tokenizer, config).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, help="HTTP port.")] = 8000,
    served_model_name: Annotated[str | None, typer.Option(help="Model name in the API.")] = None,
    request_timeout: Annotated[float, typer.Option(min=1.0, help="Per-request deadline, seconds.")] = 600.0,
    max_retries: Annotated[int, typer.Option(min=0, help="Re-dispatches before the first decode token.")] = 2,
    poll_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between GetLoad polls (worker health, load, /metrics).")
    ] = 1.0,
) -> None:
    import uvicorn

    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app
    from swaserve.model.checkpoint import default_model_dir

    logging.basicConfig(level=logging.INFO, format="%(asctime)s router %(levelname)s %(message)s")
    engine = ClusterEngine(
        model or Path(default_model_dir()),
        prefill,
        decode,
        served_model_name,
        request_timeout,
        max_retries,
        poll_interval,
    )
    fastapi_app = build_app(engine)  # type: ignore[arg-type]
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(fastapi_app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)


if __name__ == "__main__":
    app()
