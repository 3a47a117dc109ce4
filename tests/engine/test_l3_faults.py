"""L3 faults in the engine: every failure shortens the hit to what the device and host hold, and
outputs stay equal to the cache-off run. The store is the real in-process GCache store; faults are
injected in front of it (a page removed between lookup and read, a corrupt byte, an error, a
store that stops answering, no host room for the fetch)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.gcache.l3 import Found, L3Error, L3Store, local_store
from swaserve.gcache.store import PageId
from tests.engine.test_l3_engine import assert_same, l3_config
from tests.engine.test_prefix_cache_engine import workload


class Faulty:
    """An ``L3Store`` in front of another, with one fault."""

    def __init__(self, inner: L3Store, fault: str, store=None) -> None:  # type: ignore[no-untyped-def]
        self.inner, self.fault, self.store = inner, fault, store
        self.hits = 0

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        if self.fault == "error":
            raise L3Error("injected: node unreachable")
        if self.fault == "slow_lookup":  # answers (with a lease) after the fetch's deadline
            await asyncio.sleep(0.6)
        return await self.inner.lookup(pids, places)

    async def get(self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> list:
        if pids and self.fault == "evicted":  # eviction / lease expiry between lookup and read
            self.store.release(found.lease)
            self.store.remove([pids[len(pids) // 2]])
            self.hits += 1
        if pids and self.fault == "hang":
            await asyncio.sleep(30)
        objs = await self.inner.get(found, pids, places)
        if pids and self.fault == "corrupt" and objs and objs[-1] is not None:
            bad = bytearray(objs[-1])
            bad[-1] ^= 0x40
            objs[-1] = bytes(bad)
            self.hits += 1
        return objs

    async def put(self, pages):  # type: ignore[no-untyped-def]
        return await self.inner.put(pages)

    async def remove(self, pids, places=None) -> None:  # type: ignore[no-untyped-def]
        await self.inner.remove(pids, places)

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture(scope="module")
def base(tiny_dir: Path):  # type: ignore[no-untyped-def]
    return workload(LLMEngine(tiny_dir, EngineConfig(page_size=4, enable_prefix_caching=False)), seed=11)


def filled(tiny_dir: Path, **kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    cfg = l3_config(**kw)
    a = LLMEngine(tiny_dir, cfg)
    workload(a, seed=11)
    a.kv.flush_cache()
    a.core.l3.flush_puts()  # type: ignore[union-attr]
    return cfg


@pytest.mark.parametrize("fault", ["evicted", "corrupt", "error", "hang", "slow_lookup"])
def test_fault_costs_only_the_hit(tiny_dir: Path, base, fault: str) -> None:  # type: ignore[no-untyped-def]
    cfg = filled(tiny_dir, l3_timeout_s=0.3 if fault in ("hang", "slow_lookup") else 2.0)
    store = local_store(cfg.l3_url.split("://")[1])  # type: ignore[union-attr]
    before = len(store.index)
    b = LLMEngine(tiny_dir, cfg)
    l3 = b.core.l3
    assert l3 is not None
    l3.io.store = faulty = Faulty(l3.io.store, fault, store)
    assert_same(workload(b, seed=11), base)
    st = b.kv.cache.stats  # type: ignore[union-attr]
    assert st.hits_l3 == 0
    lost = {k: v for k, v in l3.stats.items() if k.startswith("lost_")}
    want = {
        "evicted": "lost_missing",
        "corrupt": "lost_corrupt",
        "error": "lost_error",
        "hang": "lost_deadline",
        "slow_lookup": "lost_deadline",
    }[fault]
    assert lost.get(want, 0) > 0, dict(l3.stats)
    if fault in ("evicted", "corrupt"):
        assert faulty.hits > 0
        assert len(store.index) < before  # the bad or evicted page is gone from the store
    if fault == "corrupt":
        assert l3.stats["corrupt_pages"] > 0
    if fault == "error":  # what an operator sees: the counters on /metrics
        from prometheus_client import CollectorRegistry, generate_latest

        from swaserve.metrics import EngineStatsCollector

        reg = CollectorRegistry()
        reg.register(EngineStatsCollector(b.core.stats, "m"))
        text = generate_latest(reg).decode()
        lookups = f'swaserve:l3_lookups_total{{model_name="m"}} {float(l3.stats["lookups"])}'
        lost = (
            f'swaserve:l3_fetches_lost_total{{model_name="m",reason="error"}} {float(l3.stats["lost_error"])}'
        )
        assert lookups in text and lost in text and l3.stats["lookups"] > 0, text
    if fault == "slow_lookup":  # the leases granted after the deadline end once they arrive
        deadline = time.monotonic() + 10
        while store.leases:
            assert time.monotonic() < deadline, f"{len(store.leases)} leases left held"
            time.sleep(0.05)


def test_no_host_room_means_no_fetch_and_is_counted(tiny_dir: Path, base) -> None:  # type: ignore[no-untyped-def]
    cfg = filled(tiny_dir)
    # a host tier smaller than the smallest fetch (min_pages full pages and the window's SWA
    # pages): no fetch is started (never clipped afterwards). With room for small fetches only,
    # whether one happens depends on when other fetches land (a fetch runs beside the steps).
    b = LLMEngine(tiny_dir, dataclasses.replace(cfg, host_cache_memory=20_000))
    l3 = b.core.l3
    assert l3 is not None
    smallest = l3.min_pages * l3.bytes.nbytes["full_attention"] + l3.wp * l3.bytes.nbytes["sliding_attention"]
    assert smallest > 20_000
    assert_same(workload(b, seed=11), base)
    assert l3.stats["unfulfilled_staging_full"] > 0
    assert b.kv.cache.stats.hits_l3 == 0  # type: ignore[union-attr]
