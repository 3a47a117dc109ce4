"""Routing state that survives Redis going away: fallback to the local copy, probe, re-sync
(a real redis-server, stopped and restarted on the same port)."""

from __future__ import annotations

import pytest
import redis

from swaserve.kvcache.hashing import chain_ids
from swaserve.redis_server import RedisServer
from swaserve.routing.load import Lease, WorkerReport
from swaserve.routing.redis.store import RedisLoadBook, RedisPrefixIndex
from swaserve.routing.resilient import FallbackBook, FallbackIndex, SharedState


@pytest.mark.cluster  # a redis-server, stopped and restarted
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


def test_a_hung_probe_is_not_repeated_at_once() -> None:
    """A probe that blocks (hung Redis) sets the next probe from when it ended: calls in between
    go straight to the local copy instead of each waiting on another probe."""
    t = [0.0]
    probes: list[float] = []

    def hung_probe() -> None:
        probes.append(t[0])
        t[0] += 2.0  # blocked for its socket timeout
        raise TimeoutError("hung")

    state = SharedState(hung_probe, (TimeoutError,), lambda: t[0], retry_s=1.0)

    def shared() -> str:
        raise TimeoutError("hung")

    assert state.call(shared, lambda: "local") == "local" and not state.up
    for _ in range(5):
        t[0] += 0.5
        assert state.call(shared, lambda: "local") == "local"
    # probe at 1.0 ends at 3.0, so the next one is due at 4.0 (timed from the probe's start it
    # would run at 3.5, and with a slow enough probe at every call)
    assert probes == [1.0, 4.0]


@pytest.mark.cluster  # a redis-server, stopped and restarted
def test_router_routing_precise_mode_survives_redis_loss_and_drops_dead_workers() -> None:
    from services.router.routing import RouterRouting, RoutingOptions
    from swaserve.v1 import worker_pb2 as pb

    server = RedisServer().start()
    try:
        r = RouterRouting(
            RoutingOptions(redis_url=server.url, index_mode="precise", block_tokens=4, redis_retry_s=0.1)
        )
        hashes = chain_ids(range(3))
        r.index.record("p0", hashes, now=r.dispatcher.clock())  # as if p0's events said so
        d, pl, dl = r.choose("a", 12, hashes, 20, ["p0", "p1"], ["d0"])
        assert d.instance == "p0" and d.cached_tokens == 11
        assert set(r.active) == {pl.lease_id, dl.lease_id} and r.renew() == 2  # running work renewed
        r.release(pl, dl)
        assert r.active == {} and r.renew() == 0
        fresh = chain_ids(range(50, 53))  # precise mode, Redis up: a dispatch records nothing
        for rid in ("f1", "f2"):
            d, pl, dl = r.choose(rid, 12, fresh, 20, ["p0", "p1"], ["d0"])
            assert d.cached_tokens == 0
            r.release(pl, dl)
        # a prefill worker seen back after it was down is asked to re-publish its cache (its
        # entries were dropped, its cache may have survived); its queue order reaches the book
        from swaserve.routing.redis.events import resync_key

        r.observe("p1", "prefill", None, False)
        r.observe("p1", "prefill", pb.Load(role="prefill", queue_order="compute"), True)
        assert redis.Redis.from_url(server.url, decode_responses=True).smembers(resync_key("swaserve")) == {
            "p1"
        }
        rep = r.book.loads(["p1"], r.dispatcher.clock())["p1"].report
        assert rep is not None and rep.queue_order == "compute"
        server.stop()
        # Redis gone: the follower's poll and the index fall back; routing goes on
        d, pl, dl = r.choose("b", 12, hashes, 20, ["p0", "p1"], ["d0"])
        assert d.instance == "p0" and r.shared_up is False
        r.release(pl, dl)
        # ... and with no events arriving, dispatches are recorded locally: a new prompt keeps
        # its affinity through the outage
        new = chain_ids(range(70, 73))
        first, pl, dl = r.choose("n1", 12, new, 20, ["p0", "p1"], ["d0"])
        r.release(pl, dl)
        again, pl, dl = r.choose("n2", 12, new, 20, ["p0", "p1"], ["d0"])
        assert (again.instance, again.cached_tokens) == (first.instance, 11)
        r.release(pl, dl)
        # p0 seen down (even if a request noticed first): its entries go, once
        r.observe("p0", "prefill", None, False)
        r.observe("p0", "prefill", None, False)
        assert r.index.match(hashes, r.dispatcher.clock()) == {}
        r.observe("p0", "prefill", pb.Load(role="prefill"), True)
        assert "p0" not in r._gone
    finally:
        server.stop()


@pytest.mark.cluster  # a redis-server, stopped and restarted
def test_precise_follower_over_fallback_index_across_a_redis_restart() -> None:
    """The router's precise-mode stack (``IndexFollower`` -> ``FallbackIndex`` over Redis) and a
    worker's publisher, through a Redis restart: the router re-syncs its local copy (linked
    entries keep their depths), then applies the worker's snapshot, which clears the blocks the
    worker evicted while its events could not be published."""
    from swaserve.kvcache.block_events import BlockEvent
    from swaserve.routing.index import MAX_DEPTH
    from swaserve.routing.redis.events import IndexFollower, RedisEventPublisher

    server = RedisServer().start()
    again: RedisServer | None = None
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1.0)
        t = [0.0]
        state = SharedState(client.ping, (redis.exceptions.RedisError, OSError), lambda: t[0], retry_s=0.5)
        index = FallbackIndex(RedisPrefixIndex(client, namespace="ns"), state)
        follower = IndexFollower(index, client, "ns", lambda: t[0])
        pub = RedisEventPublisher(redis.Redis.from_url(server.url, decode_responses=True), "ns", "p0")
        a, b, c = chain_ids(range(4)), chain_ids(range(10, 14)), chain_ids(range(20, 24))
        assert pub.check()  # no snapshot yet: a new worker sends one first
        pub.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(a[:2]))])
        pub.publish([BlockEvent("stored", tuple(a[2:]), a[1], 2)])  # the next chunk: linked
        assert state.call(follower.poll, lambda: 0) == 3 and not pub.check()
        assert index.match(a, 0.0) == {"p0": 4}
        server.stop()
        assert state.call(follower.poll, lambda: 0) == 0 and not state.up
        # meanwhile p0 evicts a and stores b (lost), and this router dispatches c to p1 (local)
        with pytest.raises(redis.exceptions.ConnectionError):
            pub.publish([BlockEvent("removed", tuple(a)), BlockEvent("stored", tuple(b))])
        index.record("p1", c[:2], 0.5)
        index.record("p1", c[2:], 0.5, depth=2, parent=c[1])
        again = RedisServer(port=server.port).start()  # empty
        t[0] = 1.0
        assert pub.check()  # its marker is gone: p0 re-sends its whole cache
        pub.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(b))])
        assert state.call(follower.poll, lambda: 0) == 2 and state.up  # re-sync, then the snapshot
        assert follower.gaps == 0
        for idx in (index, index.local, RedisPrefixIndex(client, namespace="ns")):
            assert idx.match(a, 1.0) == {} and idx.match(b, 1.0) == {"p0": 4}
            assert idx.match(c, 1.0) == {"p1": 4}
        assert client.hget("{ns}:i:p1", str(c[3])).startswith(f"{MAX_DEPTH - 3:09d}|")  # type: ignore[union-attr]
    finally:
        if again is not None:
            again.stop()
        server.stop()
