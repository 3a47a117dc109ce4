"""Lost index events are repaired: a prefill engine's ``EventPump`` (a real ``LLMEngine`` and a
real redis-server) re-publishes its whole cache after Redis restarted empty, after Redis refused
its events (the index kept claiming evicted blocks), and when a router's follower missed entries
(stream trimmed); the router's index then equals the engine's radix tree. And a long prompt
prefilled chunk by chunk costs a linear number of index writes."""

from __future__ import annotations

import contextlib
import itertools
import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from services.index_events import EventPump
from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.kvcache.hashing import block_hashes
from swaserve.redis_server import RedisServer
from swaserve.routing.index import InMemoryPrefixIndex
from swaserve.routing.redis.events import IndexFollower, RedisEventPublisher, stream_key
from swaserve.routing.redis.store import RedisPrefixIndex
from tests.helpers.prefix import cached_blocks, tree_blocks

pytestmark = pytest.mark.cluster  # starts a redis-server as child processes

B = 4
INST = "10.0.0.9:7000"
_ids = itertools.count()


def make_engine(tiny_dir: Path, kv_bytes: int, clock: Callable[[], float] = time.monotonic) -> LLMEngine:
    cfg = EngineConfig(page_size=4, kv_cache_memory=kv_bytes, max_num_batched_tokens=32, index_block_tokens=B)  # type: ignore[arg-type]
    return LLMEngine(tiny_dir, cfg, clock=clock)


def make_prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def serve(eng: LLMEngine, prompts: list[list[int]], after_step: Callable[[], object]) -> None:
    """Run ``prompts`` to their first token, calling ``after_step`` after every engine step (as
    the worker's event loop pumps between steps)."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for p in prompts:
        eng.add_request(f"r{next(_ids)}", p, params)
    while eng.has_unfinished():
        eng.step()
        after_step()


def truth(eng: LLMEngine) -> set[int]:
    assert eng.kv.cache is not None
    return tree_blocks(eng.kv.cache.tree, B)


def indexed(follower: IndexFollower) -> set[int]:
    return {h for h, _ in follower.index.entries(INST)}


def converge(pump: EventPump, follower: IndexFollower, eng: LLMEngine, timeout_s: float = 20.0) -> None:
    """Pump and follow until the index holds exactly the engine's cached blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        pump.pump()
        with contextlib.suppress(redis.RedisError):
            follower.poll()
        if indexed(follower) == truth(eng):
            return
        if time.monotonic() > deadline:
            have, want = indexed(follower), truth(eng)
            raise AssertionError(f"index != cache: {len(have - want)} stale, {len(want - have)} missing")
        time.sleep(0.02)


def assert_matches(follower: IndexFollower, eng: LLMEngine, prompts: list[list[int]]) -> None:
    assert eng.kv.cache is not None
    for p in prompts:
        want = cached_blocks(eng.kv.cache.tree, p, B)
        assert follower.index.match(block_hashes(p, B), time.monotonic()).get(INST, 0) == want


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    try:
        yield s
    finally:
        s.stop()


def start(eng: LLMEngine, url: str, ns: str) -> tuple[EventPump, redis.Redis]:
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=0.5, socket_connect_timeout=0.5)
    pump = EventPump(eng.drain_cache_events, RedisEventPublisher(client, ns, INST), check_s=0.05)
    return pump, redis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0)


def test_resend_after_redis_restarts_empty(tiny_dir: Path, server: RedisServer) -> None:
    eng = make_engine(tiny_dir, 1 << 20)  # 1384 tokens of full KV: the outage's prompts evict
    ns = f"t-{uuid.uuid4().hex}"
    pump, rc = start(eng, server.url, ns)
    try:
        follower = IndexFollower(RedisPrefixIndex(rc, namespace=ns), rc, ns, time.monotonic)
        first = make_prompts(1, 6, 120)
        serve(eng, first, pump.pump)
        converge(pump, follower, eng)
        before = truth(eng)
        server.stop()
        outage = make_prompts(2, 8, 120)
        serve(eng, outage, pump.pump)  # stored and evicted while Redis is gone
        after = truth(eng)
        assert before - after and after - before and pump.dropped > 0
        again = RedisServer(port=server.port).start()  # empty: stream and index are gone
        try:
            deadline = time.monotonic() + 20
            while pump.snapshots < 2 and time.monotonic() < deadline:
                pump.pump()  # the thread sees Redis back and asks the loop for a snapshot
                time.sleep(0.01)
            assert pump.snapshots == 2
            later = make_prompts(3, 3, 120)
            serve(eng, later, pump.pump)  # drained after the snapshot: applied after it
            converge(pump, follower, eng)  # the old follower reads the new stream: no gap
            assert follower.gaps == 0
            assert_matches(follower, eng, first + outage + later)
        finally:
            again.stop()
    finally:
        pump.close()


def test_resend_after_redis_refused_events(tiny_dir: Path, server: RedisServer) -> None:
    """Redis kept its index but refused the events of an eviction (out of memory): the index
    claimed evicted blocks until the engine re-sent its cache."""
    eng = make_engine(tiny_dir, 1 << 20)
    ns = f"t-{uuid.uuid4().hex}"
    pump, rc = start(eng, server.url, ns)
    try:
        follower = IndexFollower(RedisPrefixIndex(rc, namespace=ns), rc, ns, time.monotonic)
        first = make_prompts(4, 6, 120)
        serve(eng, first, pump.pump)
        converge(pump, follower, eng)
        rc.config_set("maxmemory-policy", "noeviction")
        rc.config_set("maxmemory", "1")  # every write is refused (OOM), reads still work
        try:
            outage = make_prompts(5, 8, 120)
            serve(eng, outage, pump.pump)
            deadline = time.monotonic() + 10
            while pump.dropped == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            follower.poll()
            assert indexed(follower) - truth(eng)  # evicted blocks still claimed
        finally:
            rc.config_set("maxmemory", "0")
        converge(pump, follower, eng)
        assert pump.snapshots >= 2
        assert_matches(follower, eng, first + outage)
    finally:
        pump.close()


def test_follower_that_missed_entries_gets_a_snapshot(tiny_dir: Path, redis_url: str) -> None:
    eng = make_engine(tiny_dir, 16 << 20)
    ns = f"t-{uuid.uuid4().hex}"
    pump, rc = start(eng, redis_url, ns)
    try:
        prompts = make_prompts(6, 5, 60)
        serve(eng, prompts, pump.pump)
        converge(pump, IndexFollower(InMemoryPrefixIndex(), rc, ns, time.monotonic), eng)
        rc.xtrim(stream_key(ns), maxlen=2, approximate=False)  # the stream's cap, before a router read it
        late = IndexFollower(InMemoryPrefixIndex(), rc, ns, time.monotonic)  # a router starting now
        late.poll()
        assert late.gaps == 1 and indexed(late) < truth(eng)
        converge(pump, late, eng)  # it asked; the engine's pump re-sent its cache
        assert pump.snapshots == 2 and late.gaps == 1
        assert_matches(late, eng, prompts)
    finally:
        pump.close()


def test_long_chunked_prompt_costs_linear_index_writes(tiny_dir: Path, server: RedisServer) -> None:
    """16 chunks of 8 blocks, drained and applied after each: every block's entry is written once
    (each chunk's chain from the root block would write 8 + 16 + ... + 128 = 1088 entries)."""
    eng = make_engine(tiny_dir, 16 << 20, clock=lambda: 100.0)
    ns = f"t-{uuid.uuid4().hex}"
    rc = redis.Redis.from_url(server.url, decode_responses=True)
    pub = RedisEventPublisher(rc, ns, INST)
    follower = IndexFollower(RedisPrefixIndex(rc, namespace=ns), rc, ns, clock=lambda: 100.0)
    (prompt,) = make_prompts(7, 1, 513)  # 128 whole blocks of 4 tokens
    rc.config_resetstat()
    serve(eng, [prompt], lambda: (pub.publish(eng.drain_cache_events()), follower.poll()))
    assert follower.index.match(block_hashes(prompt, B), 100.0) == {INST: 128}
    assert rc.xlen(stream_key(ns)) >= 16  # one stored entry per chunk at least
    assert rc.info("commandstats")["cmdstat_zadd"]["calls"] == 128
