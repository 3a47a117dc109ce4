"""The router's L3 credit (precise index mode) against a real GCache node and a real Redis: the
node publishes the index blocks of the pages it stores as instance ``l3:<node id>``, the router's
follower applies them, and ``RouterRouting.choose`` credits what the live nodes hold to every
prefill worker (reason ``l3``) without ever routing to a node; the live nodes are read at most
every ``l3_cache_s``; a node that leaves is no longer credited (its entries kept, not dropped as a
worker's), a worker seen down loses only its own entries, entries outlive the index TTL through
snapshot requests, and an unreadable registry means no credit, never an error."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis

from services.gcache.client import GCacheClient
from services.router.l3 import L3Nodes
from services.router.routing import RouterRouting, RoutingOptions
from swaserve.gcache.l3 import PutPage
from swaserve.gcache.store import Block
from swaserve.kvcache.hashing import block_hashes
from swaserve.procs import free_port
from swaserve.v1 import worker_pb2 as pb
from tests.services.gcache.helpers import PAGE, chain, node, tokens

pytestmark = pytest.mark.cluster  # a Redis server as a child process

B = 16  # index block tokens (4 pages of 4)
WORKERS = ("127.0.0.1:1", "127.0.0.1:2")
DECODE = ("127.0.0.1:3",)


def pages_with_blocks(toks: list[int]) -> list[PutPage]:
    """The page objects of ``toks``, each page that completes an index block carrying it (as the
    engine's writes do: ``engine.l3_pages.router_blocks``)."""
    hs = block_hashes(toks, B)
    out = []
    for i, p in enumerate(chain(toks)):
        b = (i + 1) * PAGE // B - 1 if (i + 1) * PAGE % B == 0 else None
        blk = Block(hs[b], b, hs[b - 1] if b else None) if b is not None and b < len(hs) else None
        out.append(dataclasses.replace(p, block=blk))
    return out


def routing_for(redis_url: str, ns: str, **kw: float) -> RouterRouting:
    r = RouterRouting(
        RoutingOptions(redis_url=redis_url, namespace=ns, index_mode="precise", block_tokens=B, **kw)  # type: ignore[arg-type]
    )
    for w in WORKERS:  # idle prefill workers publishing blocks of B tokens
        r.observe(w, "prefill", pb.Load(index_block_tokens=B), True)
    r.observe(DECODE[0], "decode", pb.Load(), True)
    return r


def choose(r: RouterRouting, toks: list[int]) -> tuple[str, int, str]:
    """One routing decision (its leases released): (instance, reused tokens, reason)."""
    d, lp, ld = r.choose(uuid.uuid4().hex, len(toks), r.hashes(toks), len(toks) + 4, WORKERS, DECODE)
    r.release(lp, ld)
    return d.instance, d.cached_tokens, d.reason


async def until(what: str, cond: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def hkeys_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_hkeys", {}).get("calls", 0))


def test_live_nodes_are_credited_never_chosen(redis_url: str) -> None:
    ns = f"l3-{uuid.uuid4().hex[:8]}"
    toks = tokens(70, seed=1)  # 4 whole index blocks: 64 tokens L3 can serve
    other = tokens(70, seed=2)
    r = redis.Redis.from_url(redis_url, decode_responses=True)

    async def go() -> None:
        async with node(redis_url=redis_url, namespace=ns, node_id="n1") as server:
            client = GCacheClient(server.address, "grpc")
            assert await client.put(pages_with_blocks(toks)) == [True] * (70 // PAGE)
            await client.close()
            routing = routing_for(redis_url, ns)

            async def credited() -> bool:
                return (await asyncio.to_thread(choose, routing, toks))[2] == "l3"

            await until("the node's blocks credited", credited)
            inst, reused, reason = await asyncio.to_thread(choose, routing, toks)
            assert inst in WORKERS and reused == 64 and reason == "l3"
            assert (await asyncio.to_thread(choose, routing, other))[1:] == (0, "load")  # not stored
            assert routing.l3_nodes() == ("l3:n1",)

            # reads: at most one per l3_cache_s, whatever the number of requests
            before, t0 = hkeys_calls(r), time.monotonic()
            for _ in range(20):
                assert (await asyncio.to_thread(choose, routing, toks))[0] in WORKERS
            assert hkeys_calls(r) - before <= 1 + (time.monotonic() - t0) / routing.opts.l3_cache_s

            # a worker seen down loses its own entries only; the node's stay and are still credited
            await asyncio.to_thread(routing.observe, WORKERS[0], "prefill", None, False)
            await asyncio.to_thread(
                routing.observe, WORKERS[0], "prefill", pb.Load(index_block_tokens=B), True
            )
            assert (await asyncio.to_thread(choose, routing, toks))[1:] == (64, "l3")
        # the node stopped (deregistered): no credit from the next read on, its entries kept
        await asyncio.sleep(routing.opts.l3_cache_s + 0.1)
        assert (await asyncio.to_thread(choose, routing, toks))[1:] == (0, "load")
        assert routing.l3_nodes() == ()
        held = routing.index.match(routing.hashes(toks), time.time(), ["l3:n1"])
        assert held == {"l3:n1": 4}

    asyncio.run(go())


def test_entries_outlive_the_index_ttl(redis_url: str) -> None:
    """A page stays in L3 past its store event's last use + TTL: the router asks the live nodes to
    re-publish every half TTL, so the credit stays (without that it ends after ``ttl``)."""
    ns = f"l3-{uuid.uuid4().hex[:8]}"
    toks = tokens(40, seed=3)
    ttl = 3.0

    async def go() -> None:
        async with node(redis_url=redis_url, namespace=ns, node_id="n2") as server:
            client = GCacheClient(server.address, "grpc")
            assert all(await client.put(pages_with_blocks(toks)))
            await client.close()
            routing = routing_for(redis_url, ns, index_ttl_s=ttl)

            async def credited() -> bool:
                return (await asyncio.to_thread(choose, routing, toks))[1:] == (32, "l3")

            await until("the node's blocks credited", credited)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2 * ttl:
                assert await credited(), f"credit lost after {time.monotonic() - t0:.1f} s"
                await asyncio.sleep(0.25)

    asyncio.run(go())


def test_an_unreadable_registry_means_no_credit() -> None:
    clock = [0.0]
    nodes = L3Nodes(f"redis://127.0.0.1:{free_port()}/0", "nowhere", cache_s=1.0, clock=lambda: clock[0])
    t0 = time.monotonic()
    assert nodes.current() == ()
    assert time.monotonic() - t0 < 2.5  # refused at once (or the client's 2 s timeout at worst)
    assert (nodes.reads, nodes.failures) == (1, 1)
    clock[0] = 0.5
    assert nodes.current() == () and nodes.reads == 1  # the failure is cached too
    clock[0] = 1.5
    assert nodes.current() == () and nodes.reads == 2


def test_approximate_mode_reads_no_nodes(redis_url: str) -> None:
    """Approximate mode has no node entries in its index (no events followed): no read at all."""
    routing = RouterRouting(RoutingOptions(redis_url=redis_url, namespace=f"l3-{uuid.uuid4().hex[:8]}"))
    assert routing.l3 is None and routing.l3_nodes() == ()
