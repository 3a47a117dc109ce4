"""The GCache (L3) nodes a router credits: ``L3Nodes`` reads the live nodes from the registry
(``services.gcache.registry.live_nodes``) at most every ``cache_s`` seconds and names them as the
prefix index knows them (``l3:<node id>``, the instance their block events are published under).

A node's index entries are filled by its own block events (precise index mode: the router's
``IndexFollower`` applies them as any worker's) and are never dispatched to: they only go to
``Dispatcher.route_prefill(..., l3_nodes=...)``, which credits what they hold to every prefill
worker. A failed read means no L3 credit until the next read (``cache_s`` later), never an error.

Stored events come once per page (writes are write-once), so an entry's last use is its store
time; ``due`` names the live nodes whose entries have not been re-published for ``resync_s``
(the router asks them for a snapshot, which records every block they hold again), so pages that
outlive the index TTL keep their credit."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from services.gcache.registry import index_instance, live_nodes

log = logging.getLogger("swaserve.router")


class L3Nodes:
    """Args: redis_url, namespace: the registry's (the cluster's Redis and namespace).
    cache_s: seconds a read is used for. resync_s: seconds between snapshot requests of a live
    node (None: never; the first is due ``resync_s`` after the node is first seen, as a node
    publishes a snapshot when it starts). clock: seconds (monotonic)."""

    def __init__(
        self,
        redis_url: str,
        namespace: str,
        cache_s: float = 1.0,
        resync_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis_url, self.namespace, self.cache_s, self.resync_s = redis_url, namespace, cache_s, resync_s
        self.clock = clock
        self.names: tuple[str, ...] = ()  # the last read's index instances, sorted
        self.reads = 0  # reads from Redis (tests, debugging)
        self.failures = 0  # of those, failed ones
        self._read_at = -math.inf
        self._refreshed: dict[str, float] = {}  # instance -> when its entries were last (re)published

    def current(self) -> tuple[str, ...]:
        """The live nodes' index instances: the last read while it is younger than ``cache_s``,
        else read now (blocking; () when Redis fails, logged once per run of failures)."""
        now = self.clock()
        if now - self._read_at < self.cache_s:
            return self.names
        self._read_at = now
        self.reads += 1
        try:
            nodes = live_nodes(self.redis_url, self.namespace, cache_s=0.0)
        except Exception as e:  # any failure: no L3 credit until the next read
            if not self.failures:
                log.warning("cannot read the GCache nodes (no L3 credit meanwhile): %s", e)
            self.failures += 1
            self.names = ()
            return self.names
        if self.failures:
            log.info("GCache nodes readable again after %d failed reads", self.failures)
        self.failures = 0
        self.names = tuple(sorted(index_instance(n) for n in nodes))
        for gone in set(self._refreshed) - set(self.names):
            del self._refreshed[gone]
        for inst in self.names:
            self._refreshed.setdefault(inst, now)
        return self.names

    def due(self) -> list[str]:
        """Live nodes (as of the last read) whose entries are to be re-published now; each is
        counted as refreshed from this call on."""
        if self.resync_s is None:
            return []
        now = self.clock()
        out = [i for i in self.names if now - self._refreshed.get(i, now) >= self.resync_s]
        for i in out:
            self._refreshed[i] = now
        return out
