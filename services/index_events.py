"""A prefill worker's side of the precise-mode prefix index: its prefix cache's block events go to
the cluster's Redis stream (``routing.events``) without ever holding up the engine.

The engine loop runs on the event-loop thread; ``EventPump.run`` (a task on the same loop) drains
the engine's events every ``interval_s`` (so a drain never interleaves with a step) and hands each
batch to one publishing thread through a bounded queue. Redis being slow, down or failing costs
events, never requests: a full queue drops the batch, a failed publish drops it; both are counted
and logged (once per outage, not per batch). Dropped events leave the index stale until its TTL
ages the entries out or later events of the same blocks correct it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from swaserve.routing.events import BlockEvent

log = logging.getLogger("swaserve.worker.index")


class Publisher(Protocol):
    def publish(self, events: list[BlockEvent]) -> int: ...


class EventPump:
    """Args:
    drain: returns the engine's pending events (``LLMEngine.drain_cache_events``; loop thread only).
    publisher: sends a batch (``RedisEventPublisher``); may block, runs on the pump's thread.
    interval_s: seconds between drains. max_batches: queued batches before new ones are dropped.
    on_count: called with ``("published" | "dropped", events)`` (metrics; any thread).
    """

    def __init__(
        self,
        drain: Callable[[], list[BlockEvent]],
        publisher: Publisher,
        interval_s: float = 0.02,
        max_batches: int = 1000,
        on_count: Callable[[str, int], None] | None = None,
    ) -> None:
        self.drain, self.publisher, self.interval_s = drain, publisher, interval_s
        self.on_count = on_count or (lambda what, n: None)
        self.published = self.dropped = 0
        self._failing = False
        self._q: queue.Queue[list[BlockEvent] | None] = queue.Queue(maxsize=max_batches)
        self._thread = threading.Thread(target=self._publish_loop, name="swaserve-index-events", daemon=True)
        self._thread.start()

    def pump(self) -> int:
        """Drain the engine once and queue the batch; returns the events queued (0 if dropped)."""
        events = self.drain()
        if not events:
            return 0
        try:
            self._q.put_nowait(events)
        except queue.Full:
            self._drop(len(events), "publisher queue full (Redis slow or down)")
            return 0
        return len(events)

    async def run(self) -> None:
        """Pump every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.pump()

    def close(self, timeout_s: float = 2.0) -> None:
        """Queue what is pending, let the thread publish it (up to ``timeout_s``), stop it."""
        self.pump()
        try:
            self._q.put(None, timeout=timeout_s)
        except queue.Full:
            return  # the daemon thread dies with the process
        self._thread.join(timeout_s)

    def _drop(self, n: int, why: str, exc: BaseException | None = None) -> None:
        self.dropped += n
        self.on_count("dropped", n)
        if not self._failing:
            self._failing = True
            log.warning("dropping index events: %s%s", why, f": {exc}" if exc else "")

    def _publish_loop(self) -> None:
        while (batch := self._q.get()) is not None:
            try:
                n = self.publisher.publish(batch)
            except Exception as e:  # Redis errors of every kind: the index is best effort
                self._drop(len(batch), "publish failed", e)
                continue
            self.published += n
            self.on_count("published", n)
            if self._failing:
                self._failing = False
                log.info("publishing index events again (%d dropped so far)", self.dropped)
