"""Selection, balance guard, length buckets and the dispatcher (on both backends: the in-memory one
and a real redis-server)."""

from __future__ import annotations

import uuid

import pytest
import redis

from swaserve.kvcache.hashing import chain_ids
from swaserve.routing.buckets import PRODUCTION_BUCKETS, LengthBuckets, parse_range
from swaserve.routing.dispatch import Dispatcher, NoInstanceError
from swaserve.routing.index import InMemoryPrefixIndex
from swaserve.routing.load import InMemoryLoadBook, InstanceLoad, Lease, WorkerReport
from swaserve.routing.policy import (
    CacheAware,
    Candidate,
    LeastLoad,
    RoundRobin,
    choose_decode,
    make_policy,
    wait_s,
)
from swaserve.routing.redis.store import RedisLoadBook, RedisPrefixIndex
from swaserve.sched.cost import CostModel

COST = CostModel("unit", 0.0, 1e-3, 0.0, 0.01, 1e-3, 0.0)  # 1 ms per prefill token, no base


def cand(name: str, cached: int = 0, reserved_s: float = 0.0, queued: int = 0) -> Candidate:
    report = WorkerReport(queued_tokens=queued) if queued else None
    return Candidate(name, cached, InstanceLoad(reserved_s=reserved_s, report=report))


def test_cache_aware_prefers_hit_until_queue_outweighs_it() -> None:
    p = CacheAware(balance_abs_s=100.0)
    # 1000-token prompt: a 900-token hit saves 0.9 s, worth 0.8 s of queue but not 1.0 s
    d = p.choose(1000, [cand("a", 900, reserved_s=0.8), cand("b")], COST)
    assert (d.instance, d.reason, d.cached_tokens) == ("a", "affinity", 900)
    assert d.est_ttft_s == pytest.approx(0.8 + 0.1)
    assert p.choose(1000, [cand("a", 900, reserved_s=1.0), cand("b")], COST).instance == "b"
    # no hit anywhere: least load
    d = p.choose(1000, [cand("a", reserved_s=0.3), cand("b", reserved_s=0.2)], COST)
    assert (d.instance, d.reason) == ("b", "load")
    # the heartbeat's queued tokens count when they exceed the leases (a lost router's work)
    assert p.choose(1000, [cand("a", 900, queued=5000), cand("b")], COST).instance == "b"


def test_balance_guard_overrides_a_hot_prefix() -> None:
    """A 100K-token prompt whose 99K are cached on a: the estimate says wait 50 s for it there;
    the guard (queue 50 s > 0 s + 2 s) sends it to the idle b instead."""
    p = CacheAware(balance_abs_s=2.0, balance_rel=1.5)
    d = p.choose(100_000, [cand("a", 99_000, reserved_s=50.0), cand("b")], COST)
    assert (d.instance, d.reason) == ("b", "balance")
    # both busy but within the guard: affinity stays
    d = p.choose(100_000, [cand("a", 99_000, reserved_s=3.0), cand("b", reserved_s=2.5)], COST)
    assert (d.instance, d.reason) == ("a", "affinity")


def test_wait_estimate_follows_the_queue_order() -> None:
    """FCFS: a request waits for every lease. Compute order: shorter leases in full, each longer
    one up to the request's own seconds (it may be running); the heartbeat counts up to the same."""
    fcfs = InstanceLoad(2, 5.1, report=WorkerReport(queue_order="fcfs"), lease_work_s=(0.1, 5.0))
    comp = InstanceLoad(2, 5.1, report=WorkerReport(queue_order="compute"), lease_work_s=(0.1, 5.0))
    assert wait_s(fcfs, COST, 0.5) == pytest.approx(5.1)
    assert wait_s(comp, COST, 0.5) == pytest.approx(0.1 + 0.5)
    assert wait_s(comp, COST, 9.0) == pytest.approx(5.1)  # longer than all: waits for all
    assert wait_s(comp, COST, 0.5, order="fcfs") == pytest.approx(5.1)  # forced
    assert wait_s(fcfs, COST, 0.5, order="compute") == pytest.approx(0.6)
    assert wait_s(InstanceLoad(reserved_s=2.0), COST, 0.5) == pytest.approx(2.0)  # no report: FCFS
    lost = InstanceLoad(report=WorkerReport(queued_tokens=3000, queue_order="compute"))  # 3 s reported
    assert wait_s(lost, COST, 0.5) == pytest.approx(0.5) and wait_s(lost, COST, 4.0) == pytest.approx(3.0)
    # a short request whose prefix is cached on an instance busy with long work: compute-ordered
    # queues let it go there (it runs before the long ones); FCFS queues send it to the idle one
    p = CacheAware(balance_abs_s=100.0)
    busy = dict(leases=2, reserved_s=8.0, lease_work_s=(4.0, 4.0))
    a_comp = Candidate("a", 900, InstanceLoad(**busy, report=WorkerReport(queue_order="compute")))  # type: ignore[arg-type]
    a_fcfs = Candidate("a", 900, InstanceLoad(**busy, report=WorkerReport(queue_order="fcfs")))  # type: ignore[arg-type]
    b = Candidate("b", 0, InstanceLoad(reserved_s=0.9, lease_work_s=(0.9,)))
    assert p.choose(1000, [a_comp, b], COST).instance == "a"  # 2 x 0.1 + 0.1 < 0.9 + 1.0
    assert p.choose(1000, [a_fcfs, b], COST).instance == "b"
    assert CacheAware(balance_abs_s=100.0, queue_order="fcfs").choose(1000, [a_comp, b], COST).instance == "b"
    with pytest.raises(ValueError, match="queue_order"):
        CacheAware(queue_order="sjf")


def test_round_robin_and_least_load() -> None:
    rr = RoundRobin()
    cs = [cand("b"), cand("a", 500), cand("c")]
    assert [rr.choose(10, cs, COST).instance for _ in range(4)] == ["a", "b", "c", "a"]
    assert LeastLoad().choose(10, [cand("a", 9, 1.0), cand("b", 0, 0.5)], COST).instance == "b"
    assert isinstance(make_policy("cache_aware", balance_abs_s=1.0), CacheAware)
    with pytest.raises(ValueError, match="known"):
        make_policy("random")


def test_choose_decode_counts_leases_before_heartbeats() -> None:
    loads = {
        "d0": InstanceLoad(leases=3, reserved_tokens=3000),
        "d1": InstanceLoad(report=WorkerReport(running_tokens=2000, kv_usage=0.5)),
        "d2": InstanceLoad(leases=1, reserved_tokens=2500),
    }
    assert choose_decode(loads) == "d1"
    with pytest.raises(ValueError):
        choose_decode({})


def test_buckets() -> None:
    assert parse_range("0-64k") == (0, 65536) and parse_range("64K-") == (65536, 1 << 62)
    for bad in ("64k", "5-3", "a-b"):
        with pytest.raises(ValueError, match="range"):
            parse_range(bad)
    b = LengthBuckets({"s0": (0, 1000), "s1": (0, 1000), "m": (1000, 8000), "l": (8000, 1 << 20)})
    assert b.candidates(10, ["s0", "s1", "m", "l"]) == (["s0", "s1"], False)
    assert b.candidates(1000, ["s0", "m", "l"]) == (["m"], False)
    # the short bucket is gone: fall back to the nearest one (m), not to l
    assert b.candidates(10, ["m", "l"]) == (["m"], True)
    assert b.candidates(9000, ["s0", "m"]) == (["m"], True)
    assert b.candidates(5, []) == ([], False)
    # an instance without a range serves any length
    assert LengthBuckets().candidates(10**6, ["x"]) == (["x"], False)
    assert len(PRODUCTION_BUCKETS) == 3 and PRODUCTION_BUCKETS[2][1] > 1 << 20


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.cluster)])  # redis: a redis-server
def dispatcher_parts(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param == "memory":
        return InMemoryPrefixIndex(), InMemoryLoadBook()
    rc = redis.Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True)
    ns = f"t-{uuid.uuid4().hex}"
    return RedisPrefixIndex(rc, namespace=ns), RedisLoadBook(rc, namespace=ns)


def test_dispatcher_affinity_load_and_release(dispatcher_parts) -> None:  # type: ignore[no-untyped-def]
    index, book = dispatcher_parts
    t = [0.0]
    d = Dispatcher(index, book, CacheAware(balance_abs_s=1.0), COST, block_tokens=100, clock=lambda: t[0])
    shared = chain_ids(range(10))  # a 1000-token prefix
    r1 = d.route_prefill("r1", 1050, shared, ["p0", "p1"])
    assert r1.decision.cached_tokens == 0 and r1.lease.work_s == pytest.approx(1.05)
    # counted at dispatch: the next cold request goes to the other instance at once
    r2 = d.route_prefill("r2", 500, chain_ids(range(100, 105)), ["p0", "p1"])
    assert r2.decision.instance != r1.decision.instance
    d.release(r1.lease)
    d.release(r2.lease)
    t[0] = 1.0
    # the shared prefix: affinity to where it was sent, with the hit counted (at most len - 1)
    r3 = d.route_prefill("r3", 1000, shared, ["p0", "p1"])
    assert (r3.decision.instance, r3.decision.reason) == (r1.decision.instance, "affinity")
    assert r3.decision.cached_tokens == 999 and r3.lease.tokens == 1
    # a hot prefix: once its instance is loaded past the guard, requests spill to the other one
    hot = r1.decision.instance
    placed = [d.route_prefill(f"h{k}", 5000, shared, ["p0", "p1"]) for k in range(6)]
    assert {r.decision.instance for r in placed} == {"p0", "p1"}
    assert any(r.decision.reason == "balance" or r.decision.instance != hot for r in placed)
    loads = book.loads(["p0", "p1"], t[0])
    assert sum(x.leases for x in loads.values()) == 7  # r3 + 6, none lost
    for r in [r3, *placed]:
        d.release(r.lease)
    assert sum(x.leases for x in book.loads(["p0", "p1"], t[0]).values()) == 0
    with pytest.raises(NoInstanceError):
        d.route_prefill("x", 10, [], [])
    dl = d.route_decode("r1", 2000, ["d0", "d1"])
    assert d.route_decode("r2", 10, ["d0", "d1"]).instance != dl.instance


def test_lease_seconds_and_queue_order_round_trip(dispatcher_parts) -> None:  # type: ignore[no-untyped-def]
    """Both backends return each live lease's seconds (ascending) and the reported queue order."""
    _, book = dispatcher_parts
    for i, w in enumerate((3.0, 0.25, 1.5)):
        assert book.reserve(Lease(f"l{i}", "p0", w, 10, expires_at=100.0), now=0.0)
    assert book.reserve(Lease("old", "p0", 7.0, 10, expires_at=5.0), now=0.0)  # expires first
    book.heartbeat("p0", WorkerReport(queued_tokens=7, queue_order="compute", at=1.0), ttl_s=60.0)
    ld = book.loads(["p0", "p1"], 10.0)
    assert ld["p0"].lease_work_s == (0.25, 1.5, 3.0) and ld["p0"].reserved_s == pytest.approx(4.75)
    assert ld["p0"].report is not None and ld["p0"].report.queue_order == "compute"
    assert ld["p0"].report.queued_tokens == 7
    assert ld["p1"].lease_work_s == () and ld["p1"].report is None


def test_leases_of_a_dead_router_expire() -> None:
    book = InMemoryLoadBook()
    t = [0.0]
    d = Dispatcher(InMemoryPrefixIndex(), book, LeastLoad(), COST, clock=lambda: t[0], lease_ttl_s=30.0)
    first = d.route_prefill("a", 4000, [], ["p0", "p1"]).decision.instance
    # the router that reserved it died without releasing: after the TTL, the load is gone
    assert d.route_prefill("b", 10, [], ["p0", "p1"]).decision.instance != first
    t[0] = 31.0
    assert book.loads([first], t[0])[first].leases == 0


def test_dispatcher_credits_what_the_l3_nodes_hold_together(dispatcher_parts) -> None:  # type: ignore[no-untyped-def]
    """GCache nodes' blocks (segments spread over two nodes) count for every prefill instance: a
    prompt nobody holds goes by load, with the L3 hit credited; an instance's own longer hit
    still wins."""
    index, book = dispatcher_parts
    t = [0.0]
    cost = CostModel("unit", 0.0, 1e-3, 0.0, 0.01, 1e-3, 0.0, 10, 0, 128, 1e6)  # 10 B/token at 1 MB/s
    d = Dispatcher(index, book, CacheAware(balance_abs_s=100.0), cost, block_tokens=100, clock=lambda: t[0])
    chain = chain_ids(range(10))  # a 1000-token prefix
    index.record("l3:a", chain[:4], 0.0)  # segments: blocks 0-3 on one node, 4-7 on the other
    index.record("l3:b", chain[4:8], 0.0, depth=4, parent=chain[3])
    assert d.l3_blocks(chain, 0.0, ["l3:a", "l3:b"]) == 8
    assert d.l3_blocks(chain, 0.0, ["l3:a"]) == 4
    assert d.l3_blocks(chain, 0.0, []) == 0
    r = d.route_prefill("r1", 1050, chain, ["p0", "p1"], record=False, l3_nodes=["l3:a", "l3:b"])
    # 800 tokens fetched (8 ms) instead of computed (0.8 s)
    assert (r.decision.reason, r.decision.cached_tokens) == ("l3", 800)
    assert r.decision.est_ttft_s == pytest.approx(cost.l3_fetch_s(800) + 0.25)
    assert r.lease.tokens == 250
    d.release(r.lease)
    index.record("p1", chain[:9], 0.0)  # p1's own cache holds more than L3
    r = d.route_prefill("r2", 1050, chain, ["p0", "p1"], record=False, l3_nodes=["l3:a", "l3:b"])
    assert (r.decision.instance, r.decision.reason, r.decision.cached_tokens) == ("p1", "affinity", 900)
    d.release(r.lease)


def test_l3_fetch_is_used_only_when_cheaper() -> None:
    slow = CostModel("slow-l3", 0.0, 1e-3, 0.0, 0.01, 1e-3, 0.0, 10, 0, 128, 1e6, l3_bytes_per_s=1e3)
    # 10 B/token at 1 kB/s: fetching 100 tokens takes 1 s, computing them 0.1 s
    assert slow.prefill_with_l3_s(200, 0, 100) == pytest.approx(slow.prefill_s(200))
    fast = CostModel("fast-l3", 0.0, 1e-3, 0.0, 0.01, 1e-3, 0.0, 10, 0, 128, 1e6, l3_latency_s=0.002)
    assert fast.prefill_with_l3_s(200, 0, 100) == pytest.approx(0.002 + 1e-3 + 0.1)
    assert fast.prefill_with_l3_s(200, 150, 100) == pytest.approx(fast.prefill_s(50, 150))
