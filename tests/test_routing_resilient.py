"""Routing state that survives Redis going away: fallback to the local copy, probe, re-sync
(a real redis-server, stopped and restarted on the same port)."""

from __future__ import annotations

import redis

from swaserve.redis_server import RedisServer
from swaserve.routing.hashing import chain_ids
from swaserve.routing.load import Lease, WorkerReport
from swaserve.routing.redis_store import RedisLoadBook, RedisPrefixIndex
from swaserve.routing.resilient import FallbackBook, FallbackIndex, SharedState


def test_fallback_and_resync_across_a_redis_restart() -> None:
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1.0)
        t = [0.0]
        state = SharedState(client.ping, (redis.exceptions.RedisError, OSError), lambda: t[0], retry_s=5.0)
        index = FallbackIndex(RedisPrefixIndex(client), state)
        book = FallbackBook(RedisLoadBook(client), state)
        a, b = chain_ids(range(4)), chain_ids(range(10, 14))
        index.record("p0", a, now=0.0)
        assert state.up and index.match(a, 0.0) == {"p0": 4}
        assert client.zcard("{swaserve}:lru") == 4

        server.stop()
        # Redis is gone: reads and writes go to the local copy, nothing raises
        assert index.match(a, 1.0) == {"p0": 4} and not state.up and state.outages == 1
        index.record("p1", b, now=1.0)
        assert index.match(b, 1.0) == {"p1": 4}
        assert book.reserve(Lease("r1", "p1", 2.0, 100, 1e9), now=1.0)
        assert book.loads(["p1"], 1.0)["p1"].reserved_s == 2.0
        book.heartbeat("p1", WorkerReport(queued_tokens=7, at=1.0))
        t[0] = 3.0  # before retry_s: no probe yet
        assert index.match(b, 3.0) == {"p1": 4} and not state.up

        again = RedisServer(port=server.port).start()  # a fresh, empty Redis on the same address
        try:
            t[0] = 6.0  # next call probes, finds Redis, re-syncs what was recorded while it was down
            assert index.match(b, 6.0) == {"p1": 4}
            assert state.up
            fresh = RedisPrefixIndex(redis.Redis.from_url(again.url, decode_responses=True))
            assert fresh.match(b, 6.0) == {"p1": 4}  # another router sees it now
            assert fresh.match(a, 6.0) == {"p0": 4}  # recorded before the outage: restored too
            book.release("p1", "r1")  # the lease lived only locally: released there, no error
            assert book.local.loads(["p1"], 6.0)["p1"].leases == 0
        finally:
            again.stop()
    finally:
        server.stop()
