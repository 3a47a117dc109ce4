"""The worker registry (``swaserve.routing.registry``): last-writer-wins merge, tombstones over
command-line workers, a change made while the shared backend is away, a backend restarted empty;
in memory and in a real Redis."""

from __future__ import annotations

import pytest
import redis

from swaserve.redis_server import RedisServer
from swaserve.routing.redis.registry import RedisWorkerRegistry
from swaserve.routing.registry import (
    ACTIVE,
    REMOVED,
    InMemoryWorkerRegistry,
    RegistryReplica,
    WorkerEntry,
    WorkerRegistry,
)


def test_entries_merge_last_writer_wins_and_ties_are_the_same_everywhere() -> None:
    reg = InMemoryWorkerRegistry()
    reg.sync([WorkerEntry("h:1", "prefill", ACTIVE, 10.0)])
    got = reg.sync([WorkerEntry("h:1", "prefill", REMOVED, 5.0)])  # older: ignored
    assert got["h:1"].state == ACTIVE
    got = reg.sync([WorkerEntry("h:1", "prefill", REMOVED, 10.0)])  # a tie: the removal wins
    assert got["h:1"].state == REMOVED
    got = reg.sync([WorkerEntry("h:1", "prefill", ACTIVE, 10.0)])
    assert got["h:1"].state == REMOVED
    with pytest.raises(ValueError, match="role"):
        WorkerEntry("h:1", "encoder", ACTIVE, 1.0)


def _two_routers(reg: WorkerRegistry) -> None:
    flags = {"p0:1": "prefill", "d0:1": "decode"}
    a, b = RegistryReplica(flags), RegistryReplica(flags)
    a.set(WorkerEntry("p1:1", "prefill", ACTIVE, 1.0))
    a.sync(reg)
    b.sync(reg)
    assert b.effective() == {**flags, "p1:1": "prefill"} and b.source("p1:1") == "registry"
    b.set(WorkerEntry("p0:1", "prefill", REMOVED, 2.0))  # a command-line worker removed on b
    b.sync(reg)
    a.sync(reg)
    assert a.effective() == {"d0:1": "decode", "p1:1": "prefill"}
    late = RegistryReplica(flags)  # a router started later with p0 on its command line
    late.sync(reg)
    assert "p0:1" not in late.effective()
    a.set(WorkerEntry("p0:1", "prefill", ACTIVE, 3.0))  # re-added
    a.sync(reg)
    late.sync(reg)
    assert late.effective()["p0:1"] == "prefill"


def test_replicas_share_changes_in_memory() -> None:
    _two_routers(InMemoryWorkerRegistry())


@pytest.mark.cluster  # a redis-server
def test_replicas_share_changes_in_redis(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ns = "test-registry"
    client.delete("{" + ns + "}:workers")
    _two_routers(RedisWorkerRegistry(client, ns))
    # stored as plain fields: "<at> <state> <role>"
    assert client.hget("{" + ns + "}:workers", "p0:1") == "3.0 active prefill"
    client.hset("{" + ns + "}:workers", "junk", "not an entry")  # skipped, not fatal
    assert "junk" not in RedisWorkerRegistry(client, ns).sync([])


@pytest.mark.cluster  # a redis-server
def test_a_restarted_empty_redis_is_refilled_by_the_replicas() -> None:
    server = RedisServer().start()
    try:
        client = redis.Redis.from_url(server.url, decode_responses=True, socket_timeout=1.0)
        reg = RedisWorkerRegistry(client)
        a = RegistryReplica({"p0:1": "prefill"})
        a.set(WorkerEntry("p1:1", "prefill", ACTIVE, 1.0))
        a.sync(reg)
        server.stop()
        a.set(WorkerEntry("p0:1", "prefill", REMOVED, 2.0))  # while Redis is away: local only
        with pytest.raises(redis.exceptions.ConnectionError):
            a.sync(reg)
        assert a.effective() == {"p1:1": "prefill"}
        again = RedisServer(port=server.port).start()
        try:
            a.sync(RedisWorkerRegistry(redis.Redis.from_url(again.url, decode_responses=True)))
            b = RegistryReplica({"p0:1": "prefill"})
            b.sync(RedisWorkerRegistry(redis.Redis.from_url(again.url, decode_responses=True)))
            assert b.effective() == {"p1:1": "prefill"}
        finally:
            again.stop()
    finally:
        server.stop()
