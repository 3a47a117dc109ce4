"""``serve_until_signalled``: the lifecycle the node-like services share (GCache nodes, encoders):
start, wait for SIGINT/SIGTERM, drain (the server bounds it), stop; a second signal stops at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Protocol


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
