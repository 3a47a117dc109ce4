"""Precise-mode index events: the prefix cache's stored / removed block log, applied to an index,
tracks the radix tree exactly (property test through a real ``KVCacheManager`` with small pools
and a host tier), and the Redis round trip publisher -> stream -> ``IndexFollower`` -> index."""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swaserve.config import SWA, EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.kvcache.block_events import BlockEvent, BlockEventLog
from swaserve.kvcache.hashing import block_hashes
from swaserve.routing.events import apply_events
from swaserve.routing.index import InMemoryPrefixIndex
from swaserve.routing.redis.events import (
    IndexFollower,
    MarkerLost,
    RedisEventPublisher,
    marker_key,
    resync_key,
    stream_key,
)
from swaserve.routing.redis.store import RedisPrefixIndex
from tests.helpers.prefix import PrefixHarness, cached_blocks, tree_blocks

INST = "10.0.0.1:7000"
PAGE = 4


class EventChecker:
    """Drains the cache's events after every operation into an in-memory index and compares.
    With ``rng``: the drain clock advances by random steps (so stored events are linked or whole
    chains, ``BlockEventLog.refresh_s``), and now and then a snapshot replaces the drain, applied
    over stale claims it must clear (another instance's entries must survive it)."""

    def __init__(self, h: PrefixHarness, B: int, rng: random.Random | None = None) -> None:
        assert h.kv.cache is not None
        self.h, self.B, self.tree, self.rng = h, B, h.kv.cache.tree, rng
        h.kv.enable_cache_events(B)
        self.index = InMemoryPrefixIndex()
        self.index.record("other", [1, 2, 3], 0.0)
        self.prompts: list[list[int]] = []
        self.stored = self.removed = self.linked = self.snapshots = 0
        self.clock = 0.0

    def check(self) -> None:
        self.h.check()
        resync = False
        if self.rng is not None:
            self.clock += self.rng.choice([0.0, 1.0, 4.0, 12.0])
            resync = self.rng.random() < 0.1
        events = self.h.kv.drain_cache_events(self.clock, resync=resync)
        if resync:
            check_snapshot(events)
            self.index.record(INST, [12345, 678], self.clock)  # stale claims: the snapshot clears them
            self.snapshots += 1
        self.stored += sum(e.op == "stored" for e in events)
        self.linked += sum(e.op == "stored" and e.parent is not None for e in events)
        self.removed += sum(e.op == "removed" for e in events)
        apply_events(self.index, INST, events, now=self.clock)
        have = {h for h, _ in self.index.entries(INST)}
        assert have == tree_blocks(self.tree, self.B)
        assert sorted(h for h, _ in self.index.entries("other")) == [1, 2, 3]
        for p in self.prompts:
            want = cached_blocks(self.tree, p, self.B)
            assert self.index.match(block_hashes(p, self.B), self.clock).get(INST, 0) == want


def check_snapshot(events: list[BlockEvent]) -> None:
    """``cleared`` first, then stored chains, each block once, each link to a block sent before."""
    assert events[0] == BlockEvent("cleared", ())
    seen: set[int] = set()
    for e in events[1:]:
        assert e.op == "stored" and e.hashes and not seen & set(e.hashes)
        assert (e.parent is None) == (e.depth == 0) and (e.parent is None or e.parent in seen)
        seen.update(e.hashes)


def run_stream(cfg: dict, seed: int, n_ops: int) -> EventChecker:
    rng = random.Random(seed)
    window = cfg["window"]
    swa_need = -(-window // PAGE) + 2 + 8 // PAGE + 2
    h = PrefixHarness(
        PAGE, window, cfg["full_pages"], max(cfg["swa_pages"], swa_need), cfg["layout"], cfg["host"],
        cfg["policy"],
    )  # fmt: skip
    c = EventChecker(h, cfg["B"], random.Random(seed + 1))
    stems = [[rng.randrange(1, 30) for _ in range(rng.randrange(1, 3 * PAGE + 6))] for _ in range(4)]
    done: list[list[int]] = []
    n = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.3 or not h.live:
            if done and rng.random() < 0.5:
                prompt = rng.choice(done) + [
                    rng.randrange(1, 30) for _ in range(rng.randrange(1, 2 * PAGE + 3))
                ]
            else:
                prompt = [t for s in rng.sample(stems, rng.randrange(1, 3)) for t in s]
                prompt += [rng.randrange(1, 30) for _ in range(rng.randrange(1, 6))]
            prompt = prompt[-(6 * PAGE + 3 * window + 20) :]
            n += 1
            c.prompts.append(prompt)
            h.admit(f"r{n}", prompt, rng.randrange(1, 6))
        elif op < 0.92:
            rid = rng.choice(list(h.live))
            tokens = list(h.live[rid].tokens)
            if h.advance(rid, rng.randrange(1, 3 * PAGE + 4), rng.randrange(1, 30)):
                done.append(tokens)
                c.prompts.append(tokens)
        else:
            done.append(h.finish(rng.choice(list(h.live))))
        c.check()
    for rid in list(h.live):
        h.finish(rid)
    c.check()
    h.kv.flush_cache()
    c.check()
    assert c.index.entries(INST) == []
    return c


CONFIGS = st.fixed_dictionaries(
    {
        "B": st.sampled_from([4, 8]),
        "window": st.sampled_from([3, 4, 6, 8]),
        "full_pages": st.integers(10, 60),
        "swa_pages": st.integers(8, 40),
        "layout": st.sampled_from(["hybrid", "hybrid", "full"]),
        "host": st.sampled_from([None, (8, 4), (40, 20), (200, 100)]),
        "policy": st.sampled_from(["on_evict", "second_hit"]),
    }
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**32 - 1))
def test_index_follows_the_tree(cfg: dict, seed: int) -> None:
    run_stream(cfg, seed, 100)


def test_streams_store_and_remove_through_every_tier() -> None:
    """Guard against a vacuous property test: evictions, host moves and host drops happen."""
    for B, host in ((4, (8, 4)), (8, None), (8, (40, 20))):
        cfg = {"B": B, "window": 4, "full_pages": 14, "swa_pages": 10, "layout": "hybrid",
               "host": host, "policy": "on_evict"}  # fmt: skip
        c = run_stream(cfg, 7, 150)
        assert c.stored > 10 and c.removed > 5 and c.linked > 3 and c.snapshots > 3


def test_swa_only_changes_and_splits_emit_nothing() -> None:
    h = PrefixHarness(PAGE, 4, 40, 30)
    h.kv.enable_cache_events(8)
    prompt = list(range(1, 34))  # 33 tokens: 8 pages, 4 whole blocks of 8
    h.admit("a", prompt, 1)
    h.advance("a", 16, 5)
    h.advance("a", 16, 5)  # partial inserts of 16 then 32 tokens coalesce into one chain
    (ev,) = h.kv.drain_cache_events()
    assert ev == BlockEvent("stored", tuple(block_hashes(prompt, 8)))
    h.advance("a", 1, 5, partial=False)  # the last prompt token: "a" holds the whole path
    cache = h.kv.cache
    assert cache is not None
    assert all(x.swa is not None for x in cache.tree.nodes())
    before = h.kv.swa.pool.num_free
    cache.evict(SWA, h.kv.swa.pool.num_pages)  # trims / tombstones SWA KV, splitting nodes
    assert h.kv.swa.pool.num_free > before and len(cache.tree.nodes()) > 1
    assert h.admit("c", [*prompt[:20], 99, 98, 97], 1)  # a hit inside a node: split
    h.check()
    for rid in ("a", "c"):
        h.finish(rid)
    assert h.kv.drain_cache_events() == []
    h.kv.flush_cache()
    events = h.kv.drain_cache_events()
    assert {e.op for e in events} == {"removed"}
    assert sorted(x for e in events for x in e.hashes) == sorted(ev.hashes)


def test_chunks_send_only_new_blocks_and_the_chain_is_refreshed() -> None:
    """A chunked prefill drained after every chunk (as the worker's pump does) sends each block
    once: the first chunk's chain from the root, then the new blocks linked to their parent. A
    continuation more than ``refresh_s`` after the chain was sent whole sends it whole again."""
    h = PrefixHarness(PAGE, 4, 80, 40)
    h.kv.enable_cache_events(8)
    prompt = list(range(1, 66))  # 65 tokens: 8 whole blocks of 8
    keys = block_hashes(prompt, 8)
    h.admit("a", prompt, 1)
    events: list[BlockEvent] = []
    for t in range(4):  # chunks of 16 tokens, one second apart
        h.advance("a", 16, 5)
        events += h.kv.drain_cache_events(float(t))
    assert events == [
        BlockEvent("stored", tuple(keys[:2])),
        *(BlockEvent("stored", tuple(keys[d : d + 2]), keys[d - 1], d) for d in (2, 4, 6)),
    ]
    h.advance("a", 1, 5)
    h.finish("a")
    index = InMemoryPrefixIndex()
    apply_events(index, INST, events, now=3.0)
    assert index.match(keys, 3.0) == {INST: 8} and {t for _, t in index.entries(INST)} == {3.0}
    # the next turn of a conversation: within refresh_s linked, after it the chain whole again
    for rid, now, whole, t0 in (("b", 5.0, False, 100), ("c", 20.0, True, 200)):
        turn = [*prompt[:64], *range(t0, t0 + 17)]
        h.kv.drain_cache_events(now)
        h.admit(rid, turn, 1)
        assert h.kv.admitted[rid].hit_tokens == 64
        h.advance(rid, 16, 5)
        (ev,) = h.kv.drain_cache_events(now)
        tk = block_hashes(turn, 8)
        want = BlockEvent("stored", tuple(tk)) if whole else BlockEvent("stored", tuple(tk[8:]), tk[7], 8)
        assert ev == want
        h.finish(rid)


def test_block_tokens_must_be_a_multiple_of_the_page() -> None:
    with pytest.raises(ValueError, match="multiple of the page size"):
        BlockEventLog(6, 4)
    h = PrefixHarness(PAGE, 4, 20, 20)
    with pytest.raises(ValueError):
        h.kv.enable_cache_events(2)
    assert h.kv.drain_cache_events() == []  # off: nothing logged


# -- Redis round trip -------------------------------------------------------------------------------
@pytest.fixture
def rc(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def chain(seed: int, blocks: int, B: int = 4) -> list[int]:
    rng = random.Random(seed)
    return block_hashes([rng.randrange(100) for _ in range(blocks * B)], B)


@pytest.mark.cluster  # a redis-server
def test_publish_follow_round_trip_and_resume(rc: redis.Redis) -> None:
    ns = f"t-{uuid.uuid4().hex}"
    a, b = chain(1, 6), chain(2, 3)
    pa, pb = RedisEventPublisher(rc, ns, "A"), RedisEventPublisher(rc, ns, "B")
    assert (
        pa.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(a)), BlockEvent("stored", ())]) == 2
    )
    assert pb.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(a[:2]))]) == 2
    raw = rc.xrange(stream_key(ns))
    assert raw[1][1] == {"instance": "A", "op": "stored", "hashes": ",".join(map(str, a)), "seq": "1"}

    index = RedisPrefixIndex(rc, namespace=ns)
    follower = IndexFollower(index, rc, ns, clock=lambda: 100.0)
    late = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=lambda: 100.0, from_start=False)
    assert follower.poll() == 4
    assert index.match(a, 100.0) == {"A": 6, "B": 2}
    assert follower.poll() == 0  # nothing new: resumes after its last id

    pa.publish([BlockEvent("removed", tuple(a[3:])), BlockEvent("stored", tuple(b))])
    assert late.poll() == 2  # only what came after it was made
    assert late.index.match(a, 100.0) == {}  # its index never saw A's stored chain
    assert late.gaps == 1 and rc.smembers(resync_key(ns)) == {"A"}  # so it asked A for a snapshot
    assert pa.check() and not pb.check()  # A takes the request; B's marker is its own
    assert follower.poll(count=1) == 1  # one at a time
    assert index.match(a, 100.0) == {"A": 3, "B": 2}
    assert follower.poll(block_ms=50) == 1
    assert index.match(b, 100.0) == {"A": 3}

    again = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=lambda: 5.0, last_id=follower.last_id)
    assert again.poll() == 0
    fresh = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=lambda: 5.0)  # a new router: backlog
    assert fresh.poll() == 6 and fresh.gaps == 0  # every instance's backlog starts with its snapshot
    assert fresh.index.match(a, 5.0) == {"A": 3, "B": 2}
    assert fresh.index.entries("A") and {h for h, t in fresh.index.entries("A")} == set(a[:3] + b)


@pytest.mark.cluster  # a redis-server
def test_publisher_appends_only_while_its_marker_holds(rc: redis.Redis) -> None:
    """Redis lost the stream and the marker (restarted empty): a batch that is not a snapshot is
    refused whole (its chains would hang off blocks nobody saw) until a snapshot claims it again."""
    ns = f"t-{uuid.uuid4().hex}"
    a = chain(3, 4)
    p = RedisEventPublisher(rc, ns, "A")
    assert p.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(a[:2]))]) == 2
    rc.delete(stream_key(ns), marker_key(ns, "A"))  # what a restart without persistence leaves
    with pytest.raises(MarkerLost):
        p.publish([BlockEvent("stored", tuple(a[2:]), a[1], 2)])
    assert rc.xlen(stream_key(ns)) == 0 and p.seq == 2 and p.check()
    rc.set(marker_key(ns, "A"), "someone else")  # another publisher took the name
    with pytest.raises(MarkerLost):
        p.publish([BlockEvent("removed", tuple(a[:1]))])
    assert p.publish([BlockEvent("cleared", ()), BlockEvent("stored", tuple(a))]) == 2
    assert p.publish([BlockEvent("removed", tuple(a[3:]))]) == 1
    f = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=lambda: 0.0)
    assert (
        f.poll() == 3 and f.gaps == 0 and [e[1]["seq"] for e in rc.xrange(stream_key(ns))] == ["2", "3", "4"]
    )
    assert f.index.match(a, 0.0) == {"A": 3}


@pytest.mark.cluster  # a redis-server
def test_follower_skips_malformed_entries(rc: redis.Redis) -> None:
    ns = f"t-{uuid.uuid4().hex}"
    rc.xadd(stream_key(ns), {"instance": "A", "op": "moved", "hashes": "1,2"})
    rc.xadd(stream_key(ns), {"instance": "A", "op": "stored", "hashes": "x"})
    RedisEventPublisher(rc, ns, "A").publish([BlockEvent("stored", (7, 8))])
    f = IndexFollower(InMemoryPrefixIndex(), rc, ns, clock=lambda: 0.0)
    assert f.poll() == 1
    assert f.index.match([7, 8], 0.0) == {"A": 2}
    assert f.poll() == 0


@pytest.mark.cluster  # a redis-server
def test_stream_is_capped(rc: redis.Redis) -> None:
    ns = f"t-{uuid.uuid4().hex}"
    p = RedisEventPublisher(rc, ns, "A", maxlen=50)
    for i in range(20):
        p.publish([BlockEvent("stored", (i * 100 + j,)) for j in range(50)])
    n = rc.xlen(stream_key(ns))
    assert 50 <= n <= 250  # MAXLEN ~: trimmed by whole stream nodes (100 entries by default)
    with pytest.raises(ValueError):
        RedisEventPublisher(rc, ns, "A", maxlen=0)


def test_apply_events_rejects_unknown_ops() -> None:
    index = InMemoryPrefixIndex()
    assert apply_events(index, "A", [BlockEvent("stored", (1, 2)), BlockEvent("removed", (2,))], 0.0) == 2
    assert index.match([1, 2], 0.0) == {"A": 1}
    with pytest.raises(ValueError):
        apply_events(index, "A", [BlockEvent("moved", (1,))], 0.0)  # type: ignore[arg-type]


def test_engine_config_checks_index_block_tokens(tiny_dir: Path) -> None:
    base = {"page_size": 4, "kv_cache_memory": 16 << 20, "max_num_batched_tokens": 32}
    with pytest.raises(ValueError, match="multiple of the page size"):
        LLMEngine(tiny_dir, EngineConfig(**base, index_block_tokens=6))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix caching"):
        LLMEngine(tiny_dir, EngineConfig(**base, index_block_tokens=8, enable_prefix_caching=False))  # type: ignore[arg-type]
    eng = LLMEngine(tiny_dir, EngineConfig(**base, index_block_tokens=8))  # type: ignore[arg-type]
    prompt = list(range(3, 23))
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    assert eng.drain_cache_events() == [BlockEvent("stored", tuple(block_hashes(prompt, 8)))]
    assert eng.drain_cache_events() == []
