"""A prefill worker's side of the precise-mode prefix index: its prefix cache's block events go to
the cluster's Redis stream (``routing.redis.events``) without ever holding up the engine, and what
is lost on the way is repaired by re-publishing the cache's whole state.

``EventPump``: drains on the loop, publishes from one thread through a bounded queue (a Redis
failure drops events, never requests), asks for a snapshot after a loss, when asked, and at start.
Loss and re-send: docs/DESIGN.md#servicesindex_eventspy"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from swaserve.kvcache.block_events import BlockEvent

log = logging.getLogger("swaserve.worker.index")

Batch = tuple[int, bool, list[BlockEvent]]  # (generation, is a snapshot, events)


class Drain(Protocol):
    """``LLMEngine.drain_cache_events`` or ``EngineClient.drain_cache_events`` (a coroutine):
    pending events, or with ``resync`` a snapshot."""

    def __call__(self, resync: bool = False) -> list[BlockEvent] | Awaitable[list[BlockEvent]]: ...


class Publisher(Protocol):
    """``RedisEventPublisher``: ``publish`` a batch (returns entries added), ``check`` whether the
    whole state must be re-sent; both raise on Redis errors."""

    def publish(self, events: list[BlockEvent]) -> int: ...

    def check(self) -> bool: ...


class EventPump:
    """Args:
    drain: the engine's events (``LLMEngine.drain_cache_events``; loop thread only).
    publisher: sends a batch (``RedisEventPublisher``); may block, runs on the pump's thread.
    interval_s: seconds between drains. max_batches: queued batches before new ones are dropped.
    on_count: called with ``("published" | "dropped", events)`` (metrics; any thread).
    check_s: seconds between ``publisher.check`` calls (also how soon a re-send follows an outage).

    Attributes:
        published, dropped: events so far. snapshots: snapshots queued so far (the first included).
    """

    def __init__(
        self,
        drain: Drain,
        publisher: Publisher,
        interval_s: float = 0.02,
        max_batches: int = 1000,
        on_count: Callable[[str, int], None] | None = None,
        check_s: float = 1.0,
    ) -> None:
        self.drain, self.publisher, self.interval_s, self.check_s = drain, publisher, interval_s, check_s
        self.on_count = on_count or (lambda what, n: None)
        self.published = self.dropped = self.snapshots = 0
        self._failing = False
        self._lock = threading.Lock()
        self._gen = 0  # the loop's generation, bumped by each snapshot it queues
        self._lost_gen = -1  # newest generation that lost events
        self._snapshot_due = True  # the loop takes a snapshot at its next pump
        self._snapshot_open = True  # one is due or queued: the thread asks for no other
        self._retry_s = 0.0  # a failed snapshot waits this long before the next (doubles, <= 30 s)
        self._retry_at = 0.0  # monotonic seconds
        self._q: queue.Queue[Batch | None] = queue.Queue(maxsize=max_batches)
        self._thread = threading.Thread(target=self._publish_loop, name="swaserve-index-events", daemon=True)
        self._thread.start()

    def pump(self) -> int:
        """Drain the engine once (or take the snapshot asked for) and queue the batch; returns
        the events queued (0 if none, dropped, or discarded while a re-send is awaited). For a
        ``drain`` that returns its events (``LLMEngine``); an awaitable one needs ``pump_async``."""
        resync, gen, lost = self._begin()
        events = self.drain(resync=resync)
        if inspect.isawaitable(events):
            raise TypeError("this drain is a coroutine: use pump_async")
        return self._queue(resync, gen, lost, events)

    async def pump_async(self) -> int:
        """``pump`` for a ``drain`` that may be a coroutine (``EngineClient.drain_cache_events``)."""
        resync, gen, lost = self._begin()
        events = self.drain(resync=resync)
        if inspect.isawaitable(events):
            events = await events
        return self._queue(resync, gen, lost, events)

    def _begin(self) -> tuple[bool, int, bool]:
        with self._lock:
            resync, self._snapshot_due = self._snapshot_due, False
            return resync, self._gen, self._lost_gen >= self._gen

    def _queue(self, resync: bool, gen: int, lost: bool, events: list[BlockEvent]) -> int:
        if resync:
            with self._lock:
                self._gen += 1
                gen = self._gen
            self.snapshots += 1
            return self._put((gen, True, events))
        if not events:
            return 0
        if lost:  # the snapshot after the outage covers them
            self._drop(len(events), "waiting to re-send the whole cache")
            return 0
        return self._put((gen, False, events))

    def _put(self, batch: Batch) -> int:
        try:
            self._q.put_nowait(batch)
        except queue.Full:
            self._lose(batch)
            self._drop(len(batch[2]), "publisher queue full (Redis slow or down)")
            return 0
        return len(batch[2])

    async def run(self) -> None:
        """Pump every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.pump_async()

    def close(self, timeout_s: float = 2.0, final_pump: bool = True) -> None:
        """Queue what is pending (``final_pump``: drain once more; a sync ``drain`` only), let
        the thread publish it (up to ``timeout_s``), stop it."""
        if final_pump:
            self.pump()
        try:
            self._q.put(None, timeout=timeout_s)
        except queue.Full:
            return  # the daemon thread dies with the process
        self._thread.join(timeout_s)

    def _lose(self, batch: Batch) -> None:
        gen, snapshot, _ = batch
        with self._lock:
            self._lost_gen = max(self._lost_gen, gen)
            if snapshot:  # Redis answers checks but refuses writes (OOM, replica): back off
                self._snapshot_open = False
                self._retry_s = min(30.0, max(self.check_s, 2 * self._retry_s))
                self._retry_at = time.monotonic() + self._retry_s

    def _drop(self, n: int, why: str, exc: BaseException | None = None) -> None:
        with self._lock:  # both threads drop
            self.dropped += n
            first, self._failing = not self._failing, True
        self.on_count("dropped", n)
        if first:
            log.warning("dropping index events: %s%s", why, f": {exc}" if exc else "")

    def _publish_loop(self) -> None:
        next_check = 0.0
        while True:
            try:
                item = self._q.get(timeout=max(0.0, next_check - time.monotonic()))
            except queue.Empty:  # idle: time to check
                pass
            else:
                if item is None:
                    return
                self._publish(item)
            if time.monotonic() >= next_check:
                self._check()
                next_check = time.monotonic() + self.check_s

    def _publish(self, batch: Batch) -> None:
        gen, snapshot, events = batch
        with self._lock:
            stale = gen <= self._lost_gen or gen < self._gen  # lost, or a later snapshot follows
        if stale:
            if snapshot:
                self._lose(batch)
            self._drop(len(events), "superseded by a re-send of the whole cache")
            return
        try:
            n = self.publisher.publish(events)
        except Exception as e:  # Redis errors of every kind: re-sent whole once Redis answers
            self._lose(batch)
            self._drop(len(events), "publish failed", e)
            return
        with self._lock:
            if snapshot:
                self._snapshot_open, self._retry_s = False, 0.0
            self.published += n
            back, self._failing = self._failing, False
        self.on_count("published", n)
        if back:
            log.info("publishing index events again (%d dropped so far)", self.dropped)

    def _check(self) -> None:
        try:
            wanted = self.publisher.check()
        except Exception:  # Redis down: a loss is repaired when it answers again
            return
        with self._lock:
            if self._snapshot_open or time.monotonic() < self._retry_at:
                return
            if wanted or self._lost_gen >= self._gen:
                self._snapshot_due = self._snapshot_open = True
                log.info(
                    "re-sending the whole cache to the index (%s)", "asked" if wanted else "after a loss"
                )
