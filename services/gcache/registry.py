"""GCache nodes in Redis, the one the routers use (``{ns}`` a hash tag, as in
``swaserve.routing.redis``)::

    {ns}:gcache:nodes          HASH node id -> gRPC address (every node that registered)
    {ns}:gcache:alive:<id>     STRING gRPC address, expiring ``ttl_s`` after the node's last refresh

A node is live while its ``alive`` key exists: ``Registration`` refreshes it every ``ttl_s / 3``
and deletes both on a clean stop, so a killed or stopped node drops out within ``ttl_s``.
``live_nodes`` reads them (cached ``cache_s``). A node's name in the routers' prefix index is
``index_instance(node_id)``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Any

from swaserve.gcache.l3 import L3Error

log = logging.getLogger("swaserve.gcache")


def nodes_key(namespace: str) -> str:
    return "{" + namespace + "}:gcache:nodes"


def alive_key(namespace: str, node_id: str) -> str:
    return "{" + namespace + "}:gcache:alive:" + node_id


def index_instance(node_id: str) -> str:
    """The node's instance name in the routers' prefix index (its block events)."""
    return "l3:" + node_id


class Registration:
    """A node's entry. Args: redis_url, namespace, node_id, address (its gRPC ``host:port``),
    ttl_s: seconds the entry outlives the node's last refresh. Redis errors are logged and
    retried at the next refresh; the node keeps serving."""

    def __init__(
        self, redis_url: str, namespace: str, node_id: str, address: str, ttl_s: float = 5.0
    ) -> None:
        import redis.asyncio

        self.namespace, self.node_id, self.address, self.ttl_s = namespace, node_id, address, ttl_s
        self._r = redis.asyncio.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def register(self) -> bool:
        """Write (or refresh) the entry now; returns whether Redis took it."""
        try:
            async with self._r.pipeline(transaction=True) as p:
                p.hset(nodes_key(self.namespace), self.node_id, self.address)
                p.set(alive_key(self.namespace, self.node_id), self.address, px=int(self.ttl_s * 1000))
                await p.execute()
        except Exception as e:  # every Redis error: retried at the next refresh
            if not self._failing:
                log.warning("gcache node %s: cannot register in Redis: %s", self.node_id, e)
            self._failing = True
            return False
        if self._failing:
            log.info("gcache node %s registered in Redis again", self.node_id)
        self._failing = False
        return True

    async def start(self) -> bool:
        """Register now, then refresh every ``ttl_s / 3`` in a task; returns the first result."""
        ok = await self.register()
        self._task = asyncio.create_task(self._refresh())
        return ok

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)  # a period, not a wait for another task
            await self.register()

    async def close(self) -> None:
        """Stop refreshing and delete the entry (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            async with self._r.pipeline(transaction=True) as p:
                p.hdel(nodes_key(self.namespace), self.node_id)
                p.delete(alive_key(self.namespace, self.node_id))
                await p.execute()
        with contextlib.suppress(Exception):
            await self._r.aclose()


_lock = threading.Lock()
_clients: dict[str, Any] = {}
_cache: dict[tuple[str, str], tuple[float, dict[str, str]]] = {}


def live_nodes(redis_url: str, namespace: str = "swaserve", cache_s: float = 1.0) -> dict[str, str]:
    """Live node id -> gRPC address, read at most every ``cache_s`` seconds per (URL, namespace)
    (blocking: call it from a thread in async code). Raises ``L3Error`` when Redis fails."""
    import redis

    now = time.monotonic()
    with _lock:
        hit = _cache.get((redis_url, namespace))
        if hit is not None and now - hit[0] < cache_s:
            return dict(hit[1])
        r = _clients.get(redis_url)
        if r is None:
            r = _clients[redis_url] = redis.Redis.from_url(
                redis_url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0
            )
    try:
        ids = sorted(r.hkeys(nodes_key(namespace)))
        addrs = r.mget([alive_key(namespace, i) for i in ids]) if ids else []
    except redis.RedisError as e:
        log.warning("gcache: cannot read the node registry from Redis: %s", e)
        raise L3Error(f"gcache registry: {e}") from e
    out = {i: a for i, a in zip(ids, addrs, strict=True) if a}
    with _lock:
        _cache[(redis_url, namespace)] = (now, out)
    return dict(out)
