"""Precise index mode through the real cluster: the prefill workers publish the blocks their
prefix caches store (Redis stream), the router's index follows them instead of recording its
dispatches, and shared prefixes still land where they are cached."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from swaserve.kvcache.hashing import block_hashes
from swaserve.launcher import Cluster
from swaserve.routing.redis.events import stream_key
from swaserve.routing.redis.store import RedisPrefixIndex
from tests.helpers.routing_cluster import WORKER_ARGS, cached, metric, send

pytestmark = pytest.mark.cluster  # starts routers, workers and Redis (``Cluster``) as child processes


def wait_settled(url: str, timeout_s: float = 30.0) -> None:
    """Until the router's view is idle: no request of its in flight on any worker (their leases)
    and every worker's last poll reporting nothing running or waiting. A stale heartbeat (a poll
    taken during the previous request, late on a loaded machine) makes the cached worker look busy,
    and cache_aware rightly sends the request to the idle one."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while any(
        w["in_flight"] or w["running"] or w["waiting"]
        for w in httpx.get(f"{url}/workers", timeout=10).json()["data"]
    ):
        assert time.monotonic() < deadline, "the router's view of the workers is still busy"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=2, decode=1, index_mode="precise", worker_args=WORKER_ARGS,
        prefill_args=["--index-block-tokens", "16"],
        router_args=["--request-timeout", "120", "--poll-interval", "0.2", "--block-tokens", "16"],
    )  # fmt: skip
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


def test_index_follows_worker_events(cluster: Cluster) -> None:
    assert cluster.redis_url is not None
    r = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    rng = random.Random(5)
    stems = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(4)]
    asyncio.run(send([(cluster.url, [*s, 7, 8]) for s in stems]))
    assert r.xlen(stream_key("swaserve")) > 0  # the workers published what they stored
    # the index is eventually consistent: a worker publishes what it stored after the response may
    # be out, so wait until every stem's blocks are indexed (the router's follower writes them)
    index = RedisPrefixIndex(r, namespace="swaserve")
    chains = [block_hashes(s, 16)[:2] for s in stems]
    deadline = time.monotonic() + 60
    while not all(max(index.match(h, time.time()).values(), default=0) >= 2 for h in chains):
        assert time.monotonic() < deadline, [index.match(h, time.time()) for h in chains]
        asyncio.run(send([(cluster.url, [1, 2, 3])]))  # a router polls the stream when it routes
        time.sleep(0.2)
    where = [index.match(h, time.time()) for h in chains]
    second = []
    for s in stems:  # one at a time, each after the router has settled the one before (its leases)
        wait_settled(cluster.url)
        second.append(asyncio.run(send([(cluster.url, [*s, 9, 10, 11])]))[0])
    # on a miss, say where the index pointed, how the router decided and what each worker's cache
    # held (an SWA window evicted emits no index event: a full-attention hit without its window)
    assert all(cached(x) >= 32 for x in second), (
        [cached(x) for x in second], where, metric(cluster.url, "swaserve:router_decisions_total"),
        metric(cluster.url, "swaserve:prefix_cache_pages"),
    )  # fmt: skip
    decisions = metric(cluster.url, "swaserve:router_decisions_total")
    assert decisions.get('model_name="mimo-v2-tiny-v2",reason="affinity"', 0) >= 4
    # every index entry came from an event: each instance's entries are blocks its cache stored
    stored = {a: len(r.hkeys(f"{{swaserve}}:i:{a}")) for a in cluster.worker_addresses["prefill"]}
    assert sum(stored.values()) >= 4 * 3  # 4 stems x 3 whole 16-token blocks at least
