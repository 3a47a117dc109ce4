"""``serve_until_signalled``: the lifecycle the node-like services share (GCache nodes, encoders):
start, wait for SIGINT/SIGTERM, drain (the server bounds it), stop; a second signal stops at once.
``run_app``: every service's entry point, which exits without the interpreter's teardown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn, Protocol


class Drainable(Protocol):
    async def start(self) -> None: ...

    async def drain(self) -> bool:
        """Finish the work in flight; False when some was left at the server's deadline."""
        ...

    async def stop(self) -> None: ...


async def serve_until_signalled(server: Drainable, log: logging.Logger, grace_s: float) -> None:
    """Run ``server`` until a signal, as the module docstring says; ``grace_s``: the drain bound
    the server applies (only logged here)."""
    stop, signals = asyncio.Event(), 0
    drained: asyncio.Task[bool] | None = None

    def on_signal(sig: signal.Signals) -> None:
        nonlocal signals
        signals += 1
        log.info("%s: %s", sig.name, "draining (again to stop now)" if signals == 1 else "stopping now")
        stop.set()
        if signals > 1 and drained is not None:
            drained.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await server.start()
        await stop.wait()
        if signals == 1:
            drained = asyncio.create_task(server.drain())
            with contextlib.suppress(asyncio.CancelledError):
                if not await drained:
                    log.warning("drain: work left after %.0f s: stopping anyway", grace_s)
    finally:
        await server.stop()
    log.info("stopped")


def run_app(app: Callable[[], object]) -> NoReturn:
    """Run a service's CLI (``app``: a Typer app), then exit with its status at once: by then its
    servers are stopped and its files closed, and the interpreter's teardown would cost about a
    second of CPU with torch loaded. An exception other than ``SystemExit`` propagates as usual."""
    try:
        app()
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            print(e.code, file=sys.stderr)
            code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
