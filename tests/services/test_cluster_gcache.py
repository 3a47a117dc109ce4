"""GCache (L3) in the cluster (``swaserve up --gcache 1``'s ``Cluster``): one GCache node, 2 prefill
workers with a small device pool and host tier (what they evict goes to L3), 1 decode worker, a
router in precise index mode (the node's block events credit L3 hits to every prefill worker),
the tiny checkpoint (W = 8).

In file order on one cluster: prefill worker B stopped (SIGSTOP, marked down) while A runs a wave
of prompts and then enough others to evict them from its device pool and host tier into L3; the
wave again on A: L3 hits (cached tokens, the node's reads), outputs token for token those of the
engine with prefix caching off; A stopped, B continued: B, which never saw the wave, hits what A
wrote; then the node SIGSTOPped and SIGKILLed while requests run: every request completes within
its timeout with the same outputs, and the router keeps serving.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.launcher import Cluster
from tests.helpers.cluster import (
    CLIENT_TIMEOUT,
    FAST_POLLS,
    MODEL,
    WORKER_ARGS,
    metric,
    running,
    wait_for,
    workers,
)

pytestmark = pytest.mark.cluster  # starts Redis, a GCache node, workers and a router as child processes

NEW = 6
# a device pool of ~4 prompts and a host tier of ~8: a wave of 16 more pushes the first out to L3
PREFILL_ARGS = ["--kv-cache-memory", "300000", "--host-cache-memory", "300000", "--max-num-seqs", "5",
                "--l3-min-tokens", "8", "--l3-timeout-s", "2", "--index-block-tokens", "16"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=2, decode=1, worker_args=WORKER_ARGS, prefill_args=PREFILL_ARGS,
        router_args=[*FAST_POLLS, "--block-tokens", "16"], index_mode="precise",
        gcache=1, gcache_dram=32 << 20, gcache_nvme=32 << 20, gcache_args=["--registry-ttl-s", "2"],
    )  # fmt: skip
    with running(c) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> LLMEngine:
    """The cache-off run the cluster's outputs must equal."""
    return LLMEngine(
        tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    )


def prompts(n: int, seed: int, length: int = 72) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length + rng.randrange(0, 9))] for _ in range(n)]


async def complete(url: str, ps: list[list[int]], limit: int = 4) -> list[dict]:
    """Completions of ``ps``, at most ``limit`` at once, each within ``CLIENT_TIMEOUT``."""
    sem = asyncio.Semaphore(limit)
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:

        async def one(p: list[int]) -> dict:
            body = {"model": MODEL, "prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}  # fmt: skip
            async with sem:
                r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        return await asyncio.gather(*(one(p) for p in ps))


def assert_exact(got: list[dict], ps: list[list[int]], reference: LLMEngine) -> None:
    want = reference.generate(ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))
    for i, (r, w) in enumerate(zip(got, want, strict=True)):
        assert r["choices"][0]["token_ids"] == w, f"prompt {i} differs from the cache-off run"


def cached(got: list[dict]) -> list[int]:
    return [int(r["usage"]["prompt_tokens_details"]["cached_tokens"]) for r in got]


def node_counter(c: Cluster, name: str, service: str = "gcache-0", label: str = "") -> float:
    """A counter of ``service`` (a GCache node, or a worker) summed over its series whose line
    holds ``label`` (0 when the service does not answer)."""
    try:
        text = httpx.get(c.metrics_urls[service], timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(f"swaserve:{name}") and label in line
    )


def only(c: Cluster, name: str) -> None:
    """Route to prefill worker ``name`` only: the other is SIGSTOPped and marked down, this one up."""
    other = "prefill-1" if name == "prefill-0" else "prefill-0"
    c.services[name].kill(signal.SIGCONT)
    c.services[other].kill(signal.SIGSTOP)
    addr = {f"prefill-{i}": a for i, a in enumerate(c.worker_addresses["prefill"])}
    wait_for(
        f"{other} down and {name} up",
        lambda: workers(c.url)[addr[other]]["state"] != "up" and workers(c.url)[addr[name]]["state"] == "up",
    )


WAVE = prompts(6, seed=1)


def test_evicted_prefixes_come_back_from_l3_exactly(cluster: Cluster, reference: LLMEngine) -> None:
    only(cluster, "prefill-0")
    first = asyncio.run(complete(cluster.url, WAVE))
    assert_exact(first, WAVE, reference)
    # enough other prompts to push the wave out of A's device pool and host tier (into L3)
    assert_exact(asyncio.run(complete(cluster.url, prompts(16, seed=2))), prompts(16, seed=2), reference)
    wait_for("the node's puts", lambda: node_counter(cluster, "gcache_puts") > 0)
    reads = node_counter(cluster, "gcache_reads")
    l3_hits = node_counter(cluster, "worker_prefix_cache_hits_total", "prefill-0", 'tier="l3"')
    routed_l3 = metric(cluster.url, "swaserve:router_decisions_total", reason="l3")
    again = asyncio.run(complete(cluster.url, WAVE, limit=1))
    assert_exact(again, WAVE, reference)
    assert all(n > 0 for n in cached(again)), (cached(first), cached(again))
    assert node_counter(cluster, "gcache_reads") > reads  # the hits were fetched from L3
    # and the worker counts them as L3 hits
    got_l3 = node_counter(cluster, "worker_prefix_cache_hits_total", "prefill-0", 'tier="l3"') - l3_hits
    assert 0 < got_l3 <= sum(cached(again))
    # and its L3 counters: lookups, pages fetched, no fetch lost
    assert node_counter(cluster, "l3_lookups_total", "prefill-0") > 0
    assert node_counter(cluster, "l3_fetched_pages_total", "prefill-0") > 0
    assert node_counter(cluster, "l3_fetches_lost_total", "prefill-0") == 0
    # the router knew: the node's blocks (precise index) credited to the worker
    assert metric(cluster.url, "swaserve:router_decisions_total", reason="l3") > routed_l3


def test_a_second_prefill_worker_hits_what_the_first_wrote(cluster: Cluster, reference: LLMEngine) -> None:
    only(cluster, "prefill-1")  # B never saw WAVE: what it finds cached comes from L3
    reads = node_counter(cluster, "gcache_reads")
    l3_hits = node_counter(cluster, "worker_prefix_cache_hits_total", "prefill-1", 'tier="l3"')
    routed = metric(cluster.url, "swaserve:prefix_cache_hits_total", tier="l3")
    got = asyncio.run(complete(cluster.url, WAVE, limit=1))
    assert_exact(got, WAVE, reference)
    assert all(n > 0 for n in cached(got)), cached(got)
    assert node_counter(cluster, "gcache_reads") > reads
    # every token B had cached came from L3, and its metrics say so
    wait_for(
        "B's L3 hits in its metrics",
        lambda: (
            node_counter(cluster, "worker_prefix_cache_hits_total", "prefill-1", 'tier="l3"') - l3_hits
            == sum(cached(got))
        ),
    )
    # and the router's per-tier hits (from the prefill workers' usage) too
    assert metric(cluster.url, "swaserve:prefix_cache_hits_total", tier="l3") - routed == sum(cached(got))
    cluster.services["prefill-0"].kill(signal.SIGCONT)


@pytest.mark.parametrize(
    "sig",
    [pytest.param(signal.SIGSTOP, marks=pytest.mark.slow), signal.SIGKILL],  # stopped: slow, ~13 s
)
def test_a_stopped_or_killed_node_costs_no_request(cluster: Cluster, reference: LLMEngine, sig: int) -> None:
    node = cluster.services["gcache-0"]
    cluster.services["prefill-0"].kill(signal.SIGCONT)
    addrs = cluster.worker_addresses["prefill"]
    wait_for("both prefill workers up", lambda: all(workers(cluster.url)[a]["state"] == "up" for a in addrs))
    # prompts that are in L3 and no longer on the workers, so the requests below fetch them
    xs = prompts(8, seed=10 + sig)
    asyncio.run(complete(cluster.url, xs))
    puts = node_counter(cluster, "gcache_puts")
    asyncio.run(complete(cluster.url, prompts(24, seed=20 + sig)))
    wait_for("the node's puts", lambda: node_counter(cluster, "gcache_puts") > puts)
    ps = [*xs, *prompts(8, seed=30 + sig)]

    async def go() -> list[dict]:
        task = asyncio.ensure_future(complete(cluster.url, ps, limit=2))
        await asyncio.sleep(0.3)  # requests in flight (fetching, writing back) when it happens
        node.kill(sig)
        return await task

    t0 = time.monotonic()
    try:
        got = asyncio.run(go())
        took = time.monotonic() - t0
        assert_exact(got, ps, reference)
        assert took < CLIENT_TIMEOUT, cached(got)  # nothing waited for the node for good
        after = asyncio.run(complete(cluster.url, prompts(2, seed=9)))  # the router keeps serving
        assert_exact(after, prompts(2, seed=9), reference)
    finally:
        node.kill(signal.SIGCONT)
