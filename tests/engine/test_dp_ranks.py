"""The ranks of an expert-parallel instance as one engine: request placement, merged cache events,
summed stats."""

from __future__ import annotations

from swaserve.engine.dp_ranks import EventMerger, RankBalancer
from swaserve.engine.spec import SpecStats
from swaserve.engine.stats import EngineStats, merge_stats
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.prefix_cache import CacheStats
from swaserve.kvcache.stats import PoolStats
from swaserve.model.ep_stats import EPStats


def test_balancer_prefers_the_rank_with_the_prefix_then_the_less_loaded() -> None:
    now = [0.0]
    b = RankBalancer(3, 4, lambda: now[0], ttl_s=100)
    stem = list(range(100, 132))  # 8 blocks of 4
    r0, c0 = b.choose([*stem, 1, 2], 10)
    assert (r0, c0) == (0, 34 + 10)  # all idle: the lowest rank; uncached prompt + max_tokens
    r1, c1 = b.choose(list(range(500, 510)), 5)
    assert r1 == 1 and c1 == 15  # rank 0 is loaded, rank 1 is the first idle one
    r2, _ = b.choose([*stem, 7, 7, 7], 10)
    assert r2 == 2  # rank 0: 3 uncached + 44 load > rank 2: 35 uncached
    b.done(r0, c0)
    r3, c3 = b.choose([*stem, 8, 8, 8], 10)
    assert r3 == 0 and c3 == 3 + 10  # now rank 0 (3 + 0) beats rank 2 (3 + 45: it got the stem too)
    b.done(r2, 35 + 10)
    b.done(r3, c3)
    assert b.load == [0, 15, 0]
    assert b.choose([9] * 40, 1)[0] == 0  # no prefix anywhere: least loaded, lowest rank
    b.load = [5, 0, 9]
    assert b.choose(stem, 0)[0] == 0  # ranks 0 and 2 hold the stem: 0 + 5 < 0 + 9 < 32 + 0
    now[0] = 1000.0  # past the ttl: the prefix no longer counts
    b.load = [5, 0, 9]
    assert b.choose(stem, 0)[0] == 1
    b2 = RankBalancer(2, 4, lambda: 0.0, max_blocks=2)
    b2.choose(list(range(16)), 0)
    assert len(b2.sent[0]) == 2  # capped, oldest blocks dropped first


def test_event_merger_removes_a_block_only_when_no_rank_holds_it() -> None:
    m = EventMerger()
    stored = BlockEvent("stored", (1, 2, 3))
    assert m.merge(0, [stored]) == [stored]
    assert m.merge(1, [BlockEvent("stored", (1, 2))]) == [BlockEvent("stored", (1, 2))]
    assert m.merge(0, [BlockEvent("removed", (2, 3))]) == [BlockEvent("removed", (3,))]
    assert m.merge(1, [BlockEvent("removed", (9,))]) == []  # never stored: nothing to say
    assert m.merge(1, [BlockEvent("cleared", ())]) == [BlockEvent("removed", (2,))]  # 1 stays: rank 0
    assert m.holders == {1: {0}}
    snap = m.snapshot(
        [[BlockEvent("cleared", ()), BlockEvent("stored", (5,))], [BlockEvent("stored", (5, 6))]]
    )
    assert snap == [BlockEvent("cleared", ()), BlockEvent("stored", (5,)), BlockEvent("stored", (5, 6))]
    assert m.holders == {5: {0, 1}, 6: {1}}


def test_merge_stats_sums_counts_and_keeps_shapes() -> None:
    def one(used: int, running: int) -> EngineStats:
        return EngineStats(
            num_running=running,
            num_waiting=1,
            pools={"full": PoolStats(100, used, used + 5, 64, 2, 3)},
            prefix_cache=CacheStats(queries=10, hits_device=4),
            cache_pages={"full": 3},
            outstanding_tokens=7,
            spec=SpecStats(2, 6, 3, [2, 1, 0]),
            ep=EPStats([0, 0], [1.0, 2.0], [2, 4], [0.5, 0.5]),
        )

    s = merge_stats([one(10, 2), one(20, 1)])
    assert s.num_running == 3 and s.num_waiting == 2 and s.outstanding_tokens == 14
    assert s.pools["full"] == PoolStats(200, 30, 40, 64, 2, 6)
    assert s.prefix_cache is not None and (s.prefix_cache.queries, s.prefix_cache.hits_device) == (20, 8)
    assert s.cache_pages == {"full": 6}
    assert s.spec == SpecStats(4, 12, 6, [4, 2, 0])
    assert s.ep == EPStats([0, 0], [1.0, 2.0], [2, 4], [0.5, 0.5])  # the group's, not summed
    assert s.ep.balance() == [0.5, 0.5]
