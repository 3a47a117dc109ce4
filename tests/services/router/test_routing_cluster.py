"""Routing through the real cluster: two stateless routers sharing Redis (a real redis-server
started by the launcher), 2 prefill + 1 decode workers on the tiny checkpoint.

In file order on one cluster: cache affinity across routers, a hot prefix spreading, Redis going
away and coming back, a router killed. The faults must fail no request on the surviving router.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swaserve.launcher import Cluster
from swaserve.redis_server import RedisServer
from tests.helpers.cluster import wait_idle
from tests.helpers.routing_cluster import WORKER_ARGS, cached, metric, send

pytestmark = pytest.mark.cluster  # starts routers, workers and Redis (``Cluster``) as child processes

POLL_S = 0.2
ROUTER_ARGS = ["--request-timeout", "120", "--poll-interval", str(POLL_S), "--block-tokens", "16"]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch_module.delenv("REDIS_URL", raising=False)  # this test restarts its own Redis
    c = Cluster(tiny_dir, prefill=2, decode=1, routers=2, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def prefill_dispatches(c: Cluster) -> dict[str, float]:
    """Prefill attempts per worker address, summed over the live routers."""
    total: dict[str, float] = {}
    for url in c.urls:
        try:
            got = metric(url, "swaserve:router_dispatches_total")
        except httpx.HTTPError:
            continue
        for labels, v in got.items():
            if 'role="prefill"' in labels:
                inst = re.search(r'worker="([^"]+)"', labels)
                assert inst is not None
                total[inst.group(1)] = total.get(inst.group(1), 0) + v
    return total


def one_by_one(c: Cluster, url: str, prompts: list[list[int]]) -> list[dict]:
    """Send ``prompts`` to ``url`` one at a time, each once no worker holds a request and the
    routers have polled them since: with work queued (or a load report taken while it was) on the
    cached worker, recomputing a short prompt of the tiny model elsewhere can be the faster choice
    (the TTFT estimate at work), not what these tests check."""
    out = []
    for p in prompts:
        wait_idle(c)
        time.sleep(3 * POLL_S)
        out.append(asyncio.run(send([(url, p)]))[0])
    return out


def test_shared_prefix_lands_where_it_is_cached_across_routers(cluster: Cluster) -> None:
    rng = random.Random(1)
    stems = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(4)]
    first = asyncio.run(send([(cluster.urls[0], [*s, 7, 8]) for s in stems]))
    assert all(cached(r) == 0 for r in first)
    # the second turns go through the *other* router: it sees the first router's dispatches in Redis.
    second = one_by_one(cluster, cluster.urls[1], [[*s, 9, 10, 11] for s in stems])
    got = [cached(r) for r in second]
    assert all(g >= 32 for g in got), got  # the 48-token stem, page- and window-safe aligned
    decisions = metric(cluster.urls[1], "swaserve:router_decisions_total")
    assert decisions.get('model_name="mimo-v2-tiny-v2",reason="affinity"', 0) >= 4


def test_hot_prefix_spreads_over_both_prefill_workers(cluster: Cluster) -> None:
    rng = random.Random(2)
    stem = [rng.randrange(3, 500) for _ in range(96)]
    asyncio.run(send([(cluster.urls[0], [*stem, 1])]))  # now cached on one worker
    before = prefill_dispatches(cluster)
    burst = [(cluster.urls[k % 2], [*stem, *(rng.randrange(3, 500) for _ in range(8))]) for k in range(12)]
    got = asyncio.run(send(burst))
    after = prefill_dispatches(cluster)
    delta = {a: after.get(a, 0) - before.get(a, 0) for a in cluster.worker_addresses["prefill"]}
    assert sum(delta.values()) == 12
    assert min(delta.values()) >= 2, delta  # load counted at dispatch: the hot worker does not get all
    assert sum(cached(r) > 0 for r in got) >= 6  # and most still reuse the prefix


def test_redis_restart_fails_no_request(cluster: Cluster) -> None:
    server = cluster.redis_server
    assert isinstance(server, RedisServer)
    rng = random.Random(3)
    stems = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(3)]
    server.stop()
    # both routers keep serving on their local state while Redis is gone
    down = asyncio.run(send([(cluster.urls[k % 2], [*s, k]) for k, s in enumerate(stems * 2)]))
    assert len(down) == 6
    assert all(v == 0 for v in metric(cluster.urls[0], "swaserve:router_shared_state_up").values())
    again = RedisServer(port=server.port).start()  # empty: no persistence
    cluster.services["redis"] = again.proc
    cluster.redis_server = again
    for _ in range(50):  # the routers probe every second and re-sync their local entries
        asyncio.run(send([(u, [5, 6, 7]) for u in cluster.urls]))
        ups = [metric(u, "swaserve:router_shared_state_up") for u in cluster.urls]
        if all(v == 1 for m in ups for v in m.values()):
            break
    else:
        pytest.fail("routers did not reconnect to the restarted Redis")
    import redis

    assert redis.Redis.from_url(again.url).zcard("{swaserve}:lru") > 0  # re-synced entries
    # the prefixes sent while Redis was down still route by affinity through the other router
    after = one_by_one(cluster, cluster.urls[1], [[*s, 99] for s in stems])
    assert all(cached(r) >= 32 for r in after), [cached(r) for r in after]


def test_killing_a_router_fails_nothing_on_the_other(cluster: Cluster) -> None:
    rng = random.Random(4)

    async def kill_soon() -> None:
        await asyncio.sleep(0.5)
        cluster.services["router-1"].kill()

    async def run() -> list[dict]:
        pairs = [(cluster.urls[0], [rng.randrange(3, 500) for _ in range(30)]) for _ in range(8)]
        got, _ = await asyncio.gather(send(pairs, 12), kill_soon())
        return got

    got = asyncio.run(run())
    assert len(got) == 8 and all(r["usage"]["completion_tokens"] == 12 for r in got)
    proc = cluster.services["router-1"].proc
    assert proc is not None and proc.wait(timeout=30) != 0  # it was really killed
    # and new requests keep working on the survivor
    assert len(asyncio.run(send([(cluster.urls[0], [3, 4, 5])]))) == 1
