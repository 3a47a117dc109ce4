"""The engine's L3 I/O thread: an asyncio loop of its own running ``L3Store`` calls, so the step
loop (a step thread or the core process) never waits on the network. Calls return
``concurrent.futures.Future``s the core polls between steps. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from swaserve.gcache.l3 import L3Store, connect

T = TypeVar("T")


class L3IO:
    """Args: url: the L3 store's URL (``swaserve.gcache.l3.connect``), opened on the thread's
    loop. Raises ValueError for a bad URL."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="swaserve-l3", daemon=True)
        self._thread.start()

        async def open_store() -> L3Store:
            return connect(url)

        try:
            self.store: L3Store = self.run(open_store).result(timeout=30)
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args)`` on the I/O loop."""
        return asyncio.run_coroutine_threadsafe(fn(*args), self.loop)  # type: ignore[arg-type]

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a store that cannot close cleanly: go anyway
            self.run(self.store.close).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
