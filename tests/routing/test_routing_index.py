"""Prefix index and load book: the same behaviour from the in-memory and the Redis backend
(a real redis-server), checked against a plain reference model."""

from __future__ import annotations

import random
import uuid

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.kvcache.hashing import block_hashes, chain_ids, root_hash
from swaserve.routing.index import IndexConfig, InMemoryPrefixIndex, PrefixIndex
from swaserve.routing.load import InMemoryLoadBook, Lease, LoadBook, WorkerReport
from swaserve.routing.redis.store import RedisLoadBook, RedisPrefixIndex

BACKENDS = ("memory", "redis")
KINDS = ["memory", pytest.param("redis", marks=pytest.mark.cluster)]  # redis: a redis-server


@pytest.fixture
def rclient(kind: str, request: pytest.FixtureRequest) -> redis.Redis | None:
    """A client of the session's redis-server for the ``redis`` backend (only that one starts it)."""
    if kind != "redis":
        return None
    return redis.Redis.from_url(request.getfixturevalue("redis_url"), decode_responses=True)


def make_index(kind: str, rclient: redis.Redis, **cfg: float) -> PrefixIndex:
    config = IndexConfig(**cfg)  # type: ignore[arg-type]
    if kind == "memory":
        return InMemoryPrefixIndex(config)
    return RedisPrefixIndex(rclient, config, namespace=f"t-{uuid.uuid4().hex}")


def make_book(kind: str, rclient: redis.Redis) -> LoadBook:
    return (
        InMemoryLoadBook() if kind == "memory" else RedisLoadBook(rclient, namespace=f"t-{uuid.uuid4().hex}")
    )


def test_block_hashes_chain() -> None:
    a = block_hashes(list(range(200)), 64)
    b = block_hashes([*range(128), 999, *range(129, 200)], 64)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]  # same prefix, same keys; then diverge
    assert block_hashes(list(range(63)), 64) == []
    assert block_hashes(list(range(128)), 64, salt="other")[0] != a[0]
    assert all(0 <= h < 2**64 for h in a)
    assert chain_ids([5, 6]) != chain_ids([6, 5]) and root_hash() == root_hash("")
    # continuing a chain from its last key gives the same keys as hashing the whole prefix
    assert block_hashes(list(range(64, 200)), 64, parent=a[0]) == a[1:]
    with pytest.raises(ValueError, match="block_tokens"):
        block_hashes([1], 0)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1] * 64, 64)


@pytest.mark.parametrize("kind", KINDS)
def test_match_longest_prefix_per_instance(kind: str, rclient: redis.Redis) -> None:
    idx = make_index(kind, rclient)
    h = chain_ids(range(6))
    h_big = [2**64 - 1 - x for x in range(3)]  # 64-bit values survive the trip through Lua
    idx.record("a", h[:4], now=1.0)
    idx.record("b", h[:2], now=1.0)
    idx.record("c", h[1:5], now=1.0)  # no first block: no match
    idx.record("d", h_big, now=1.0)
    assert idx.match(h, now=2.0) == {"a": 4, "b": 2}
    assert idx.match(h[:3], now=2.0) == {"a": 3, "b": 2}
    assert idx.match(h, now=2.0, instances=["b", "c"]) == {"b": 2}
    assert idx.match(h_big, now=2.0) == {"d": 3}
    assert idx.match([], now=2.0) == {}
    assert idx.size() == 4 + 2 + 4 + 3
    assert sorted(x for x, _ in idx.entries("b")) == sorted(h[:2])
    idx.evict("a", [h[2]])
    assert idx.match(h, now=2.0) == {"a": 2, "b": 2}
    assert idx.remove_instance("a") == 3
    assert idx.match(h, now=2.0) == {"b": 2}
    assert idx.size() == 2 + 4 + 3 and idx.entries("a") == []


@pytest.mark.parametrize("kind", KINDS)
def test_ttl_and_global_cap(kind: str, rclient: redis.Redis) -> None:
    idx = make_index(kind, rclient, max_entries=10, ttl_s=100.0)
    h = chain_ids(range(8))
    idx.record("a", h[:4], now=0.0)
    assert idx.match(h, now=99.0) == {"a": 4}
    assert idx.match(h, now=101.0) == {}  # expired entries do not match, even before they are dropped
    idx.record("b", h[:2], now=150.0)  # drops a's expired entries
    assert idx.size() == 2
    # the cap is global: many instances cannot grow the index past it; LRU entries go first
    for k, name in enumerate("cdefgh"):
        idx.record(name, h[:3], now=200.0 + k)
    assert idx.size() == 10
    # among entries used at the same time the deepest go first: e keeps its chain's head
    assert idx.match(h, now=210.0) == {n: 3 for n in "fgh"} | {"e": 1}
    assert [x for x, _ in idx.entries("e")] == [h[0]]


@pytest.mark.cluster  # a redis-server
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["record", "extend", "evict", "remove"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 3),  # which chain
            st.integers(0, 5),  # extend: where the new blocks start (their parent is the block before)
            st.integers(1, 6),  # how many blocks
            st.integers(0, 1),  # clock step: 0 gives ties with the previous call's last use
        ),
        max_size=30,
    ),
    ttl=st.sampled_from([1e9, 3.0]),
)
def test_backends_agree_with_reference(
    ops: list[tuple[str, str, int, int, int, int]], ttl: float, redis_url: str
) -> None:
    """Random record (whole chains, or new blocks linked to a parent) / evict / remove sequences
    under a small cap and TTL, with ties in last use across calls: both backends equal a reference
    that keeps (last use, depth) per entry and evicts by (last use, deepest first, instance, hash)."""
    from swaserve.routing.index import member

    rc = redis.Redis.from_url(redis_url, decode_responses=True)
    cap = 12
    chains = [chain_ids([c * 100 + i for i in range(3)]) + chain_ids(range(3, 6)) for c in range(4)]
    chains[3] = chains[0][:3] + chain_ids([7, 8, 9])  # shares a prefix with chain 0
    idxs = [make_index(k, rc, max_entries=cap, ttl_s=ttl) for k in BACKENDS]
    ref: dict[tuple[int, str], tuple[float, int]] = {}  # (hash, instance) -> (last use, depth)
    now = 0.0
    for op, inst, c, start, n, step in ops:
        now += step
        hs, depth, parent = chains[c][:n], 0, None
        if op == "extend":
            hs, depth, parent = chains[c][start : start + n], start, (chains[c][start - 1] if start else None)
        for idx in idxs:
            if op in ("record", "extend"):
                idx.record(inst, hs, now, depth=depth, parent=parent)
            elif op == "evict":
                idx.evict(inst, hs)
            else:
                idx.remove_instance(inst)
        if op in ("record", "extend"):
            t = now
            if parent is not None and (parent, inst) in ref and ref[(parent, inst)][0] >= now - ttl:
                t = ref[(parent, inst)][0]  # linked blocks take their parent's last use
            for k, h in enumerate(hs):
                ref[(h, inst)] = (t, depth + k)
            for key in [k for k, (t0, _) in ref.items() if t0 < now - ttl]:
                del ref[key]
            while len(ref) > cap:
                del ref[min(ref, key=lambda k: (ref[k][0], member(ref[k][1], k[1], k[0])))]
        elif op == "evict":
            for h in hs:
                ref.pop((h, inst), None)
        else:
            for key in [k for k in ref if k[1] == inst]:
                del ref[key]
        for ch in chains:
            want = {}
            for i in "abc":
                k = 0
                while k < len(ch) and (ch[k], i) in ref and ref[(ch[k], i)][0] >= now - ttl:
                    k += 1
                if k:
                    want[i] = k
            assert [idx.match(ch, now) for idx in idxs] == [want, want]
        assert [idx.size() for idx in idxs] == [len(ref)] * 2
        for i in "abc":
            got = [sorted(idx.entries(i)) for idx in idxs]
            assert got == [sorted((h, t) for (h, j), (t, _) in ref.items() if j == i)] * 2


@pytest.mark.parametrize("kind", KINDS)
def test_linked_blocks_take_their_parents_last_use(kind: str, rclient: redis.Redis) -> None:
    """A chain recorded in pieces (a chunked prefill's events) ages as one: its later pieces take
    the head's last use, so under the cap its deepest blocks go first, never its head."""
    idx = make_index(kind, rclient, max_entries=6, ttl_s=100.0)
    h = chain_ids(range(6))
    idx.record("a", h[:2], now=1.0)
    idx.record("a", h[2:4], now=2.0, depth=2, parent=h[1])
    idx.record("a", h[4:6], now=3.0, depth=4, parent=h[3])
    assert sorted(t for _, t in idx.entries("a")) == [1.0] * 6
    idx.record("b", h[:1], now=4.0)  # over the cap by one: a's deepest block goes
    assert idx.match(h, now=4.0) == {"a": 5, "b": 1}
    # a parent that is missing or expired links nothing: the blocks are recorded at now
    idx.record("c", h[3:5], now=5.0, depth=3, parent=h[2])
    assert sorted(t for _, t in idx.entries("c")) == [5.0, 5.0]
    idx.record("a", h[5:6], now=150.0, depth=5, parent=h[4])  # h[4] last used at 1.0: expired
    assert idx.entries("a") == [(h[5], 150.0)]
    with pytest.raises(ValueError, match="no parent"):
        idx.record("a", h[:1], now=1.0, parent=h[0])
    with pytest.raises(ValueError, match="depth"):
        idx.record("a", h[:1], now=1.0, depth=-1)


@pytest.mark.parametrize("kind", KINDS)
def test_leases_versions_and_expiry(kind: str, rclient: redis.Redis) -> None:
    book = make_book(kind, rclient)
    l0 = book.loads(["p0", "p1"], now=0.0)
    assert l0["p0"].leases == 0 and l0["p0"].reserved_s == 0.0 and l0["p0"].report is None
    assert book.reserve(Lease("r1", "p0", 1.25, 100, expires_at=10.0), now=0.0, expect={"p0": 0, "p1": 0})
    # a second router that read the loads before r1 was reserved is refused (compare-and-reserve)
    assert not book.reserve(Lease("r2", "p1", 0.5, 10, expires_at=10.0), now=0.0, expect={"p0": 0, "p1": 0})
    l1 = book.loads(["p0", "p1"], now=1.0)
    assert (l1["p0"].leases, l1["p0"].reserved_s, l1["p0"].reserved_tokens) == (1, 1.25, 100)
    assert l1["p1"].leases == 0 and l1["p0"].version == l0["p0"].version + 1
    assert book.reserve(Lease("r2", "p1", 0.5, 10, expires_at=10.0), now=1.0, expect={"p0": 1, "p1": 0})
    assert book.reserve(Lease("r3", "p0", 2.0, 7, expires_at=5.0), now=1.0)  # unconditional
    assert book.loads(["p0"], now=2.0)["p0"].reserved_s == pytest.approx(3.25)
    assert book.loads(["p0"], now=6.0)["p0"].reserved_s == pytest.approx(1.25)  # r3 expired
    book.release("p0", "r1")
    book.release("p0", "r1")  # twice: no error
    assert book.loads(["p0"], now=6.0)["p0"].leases == 0
    # renewal: a running request's router moves its lease's expiry; a dead router's is not moved
    assert book.reserve(Lease("r4", "p1", 1.5, 20, expires_at=12.0), now=6.0)
    assert book.renew("p1", "r4", 40.0) and not book.renew("p1", "nope", 40.0)
    got = book.loads(["p1"], now=30.0)["p1"]
    assert (got.leases, got.reserved_s, got.reserved_tokens) == (1, 1.5, 20)  # r2 expired at 10, r4 renewed


@pytest.mark.parametrize("kind", KINDS)
def test_heartbeats_and_liveness(kind: str, rclient: redis.Redis) -> None:
    book = make_book(kind, rclient)
    rep = WorkerReport(queued_tokens=300, running_tokens=50, running_requests=2, kv_usage=0.25, at=100.0)
    book.heartbeat("p0", rep, ttl_s=10.0)
    book.heartbeat("p1", WorkerReport(at=90.0), ttl_s=10.0)  # until 100
    assert set(book.live(104.0)) == {"p0"} and book.live(104.0)["p0"] == rep
    assert book.loads(["p0"], now=104.0)["p0"].report == rep
    assert book.loads(["p0"], now=111.0)["p0"].report is None  # stale heartbeat: not counted
    book.forget("p0")
    assert book.live(104.0) == {}


@pytest.mark.cluster  # a redis-server
def test_redis_concurrent_reserves_count_every_lease(redis_url: str) -> None:
    """Threads reserving through separate connections: every lease is counted once, and a
    compare-and-reserve on stale versions never succeeds."""
    import threading

    ns = f"t-{uuid.uuid4().hex}"
    ok: list[bool] = []

    def worker(k: int) -> None:
        book = RedisLoadBook(redis.Redis.from_url(redis_url, decode_responses=True), namespace=ns)
        rng = random.Random(k)
        for j in range(25):
            name = f"p{rng.randrange(3)}"
            while True:  # the dispatcher's loop: read versions, reserve if unchanged
                v = book.loads(["p0", "p1", "p2"], now=0.0)
                if book.reserve(
                    Lease(f"{k}-{j}", name, 1.0, 1, 1e9), 0.0, {i: x.version for i, x in v.items()}
                ):
                    ok.append(True)
                    break

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loads = RedisLoadBook(redis.Redis.from_url(redis_url, decode_responses=True), namespace=ns).loads(
        ["p0", "p1", "p2"], now=0.0
    )
    assert len(ok) == 100 and sum(x.leases for x in loads.values()) == 100
    assert sum(x.version for x in loads.values()) == 100
