"""Two GCache node processes registered in a real Redis, read and written through ``ShardedL3``
(``sharded_client`` / ``connect("redis://...")``): pages spread over both by placement segment,
a killed node's pages are misses while the other's still hit, and its registry entry lapses.
The nodes publish their stored blocks for the routers' index under ``l3:<node id>``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import redis

from services.gcache.client import GCacheClient, connect
from services.gcache.registry import index_instance, live_nodes
from swaserve.gcache.l3 import placements
from swaserve.gcache.store import Block
from swaserve.routing.redis.events import stream_key
from tests.services.gcache.helpers import chain, run, tokens
from tests.services.gcache.test_node_process import gcache_node

pytestmark = pytest.mark.cluster  # Redis and two GCache nodes as child processes


def wait_for(what: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_two_nodes_share_the_pages_and_a_dead_one_costs_only_its_own(redis_url: str) -> None:
    ns = f"gc-{uuid.uuid4().hex[:8]}"
    common = ("--redis-url", redis_url, "--namespace", ns, "--registry-ttl-s", "1.5", "--dram", "32MiB")
    with (
        gcache_node("gcache-a", *common, "--node-id", "a") as (proc_a, addr_a),
        gcache_node("gcache-b", *common, "--node-id", "b") as (_, addr_b),
    ):
        assert live_nodes(redis_url, ns, cache_s=0) == {"a": addr_a, "b": addr_b}  # registered before SERVING
        pages = chain(tokens(4 * 160), payload=300)  # 10 placement segments of 16 pages
        places = placements([p.pid[0] for p in pages], 0)
        for p, place in zip(pages, places, strict=True):
            p.place = place
        pages[15].block = Block(key=7, depth=0, parent=None)  # a routers' block the page completes
        pids = [p.pid for p in pages]

        async def spread() -> dict[str, list[bool]]:
            l3 = connect(f"redis://{redis_url.split('://')[1]}?namespace={ns}&timeout_s=5")
            assert await l3.put(pages) == [True] * len(pages)
            found = await l3.lookup(pids, places)
            assert all(found.present)
            assert await l3.get(found, pids, places) == [p.obj for p in pages]
            # a get of no pages (a miss, no staging room) or of one node's pages ends the leases
            # the lookup took on every node, not only those it reads from
            for read in ([], pids[:16]):
                await l3.get(await l3.lookup(pids, places), read, places[: len(read)])
                for addr in (addr_a, addr_b):
                    c = GCacheClient(addr, "grpc")
                    assert sum(t.leased for t in (await c.info()).tiers) == 0, (addr, len(read))
                    await c.close()
            await l3.close()
            held = {}
            for name, addr in (("a", addr_a), ("b", addr_b)):
                c = GCacheClient(addr, "grpc")
                f = await c.lookup(pids)
                await c.get(f, [])  # ends the lease
                held[name] = f.present
                await c.close()
            return held

        held = run(spread())
        assert all(x != y for x, y in zip(held["a"], held["b"], strict=True))  # each page on one node
        assert 0 < sum(held["a"]) < len(pages)
        owner_of_block = "a" if held["a"][15] else "b"
        r = redis.Redis.from_url(redis_url, decode_responses=True)
        wait_for(
            lambda: any(
                f.get("instance") == index_instance(owner_of_block) and f.get("op") == "stored"
                for _, f in r.xrange(stream_key(ns))
            )
        )

        proc_a.kill()  # SIGKILL

        async def after() -> None:
            from services.gcache.client import sharded_client

            l3 = sharded_client(redis_url, ns, timeout_s=5.0)
            t0 = time.monotonic()
            found = await l3.lookup(pids, places)
            assert time.monotonic() - t0 < 5.0
            assert found.present == held["b"]
            got = await l3.get(found, pids, places)
            assert [g is not None for g in got] == held["b"]
            assert all(g == p.obj for g, p in zip(got, pages, strict=True) if g is not None)
            assert l3.node_errors["lookup"] > 0  # node a failed: counted for the metrics
            await l3.close()

        run(after())
        wait_for(lambda: live_nodes(redis_url, ns, cache_s=0) == {"b": addr_b})  # its entry lapsed
