"""Page-pool invariants under random request streams (hypothesis), at manager level."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.plan import PoolPlan, cdiv
from swaserve.kvcache.pool import PagePool


def _check(kv: KVCacheManager, live: dict[str, tuple[int, int]], chunk_max: int) -> None:
    for kind in (kv.full, kv.swa):
        held = [p for t in kind.tables.values() for p in t.pages]
        assert len(held) == len(set(held)), "a page is held twice"
        assert not any(kind.pool.is_free(p) for p in held), "a held page is on the free list"
        assert kind.pool.num_used == len(held)
        assert 0 <= kind.pool.reserved <= kind.pool.num_free
        assert kind.pool.reserved == sum(t.reserved for t in kind.tables.values())
    if kv.layout == "hybrid":
        for rid, t in kv.swa.tables.items():
            _computed, last_chunk = live[rid]
            # window + the chunk just computed, page-rounded, +1 for an unaligned start
            bound = cdiv(kv.window + max(1, last_chunk), kv.page_size) + 1
            assert len(t.pages) <= bound, (rid, len(t.pages), bound)


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "step", "step", "step", "abort"]), st.integers(1, 200), st.integers(1, 40)
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    page=st.sampled_from([2, 4, 8, 16]),
    window=st.sampled_from([3, 8, 20]),
    layout=st.sampled_from(["hybrid", "full"]),
    chunk_max=st.integers(1, 48),
)
def test_random_streams_keep_pools_consistent(ops, page, window, layout, chunk_max) -> None:  # type: ignore[no-untyped-def]
    plan = PoolPlan(
        full_pages=60, swa_pages=60 if layout == "full" else 40, full_page_bytes=64, swa_page_bytes=32
    )
    kv = KVCacheManager(plan, page, window, layout, 2, 5)
    live: dict[str, tuple[int, int]] = {}
    total: dict[str, int] = {}
    n = 0
    for op, a, b in ops:
        if op == "add":
            rid = f"r{n}"
            n += 1
            if kv.admit(rid, a) is not None:
                live[rid], total[rid] = (0, 0), a
        elif op == "abort" and live:
            rid = sorted(live)[a % len(live)]
            kv.free(rid)
            del live[rid], total[rid]
        elif op == "step":
            for rid in sorted(live):
                done, _ = live[rid]
                want = min(total[rid] - done, b, chunk_max)
                got = kv.max_chunk(rid, done, done + want)
                if want and done > 0 and total[rid] - done >= 1:
                    # a running request can always advance by one token (its guarantee covers it)
                    assert kv.max_chunk(rid, done, done + 1) == 1
                if got:
                    assert kv.allocate(rid, done, done + got)
                    live[rid] = (done + got, got)
                if live[rid][0] == total[rid]:
                    kv.free(rid)
                    del live[rid], total[rid]
        _check(kv, live, chunk_max)
    for rid in list(live):
        kv.free(rid)
    for kind in (kv.full, kv.swa):
        assert (
            kind.pool.num_used == 0 and kind.pool.reserved == 0 and kind.pool.num_free == kind.pool.num_pages
        )


def test_double_free_is_an_error() -> None:
    pool = PagePool(4, 1, 1)
    pages = pool.allocate(2)
    assert pages is not None
    pool.free(pages)
    try:
        pool.free(pages[:1])
    except ValueError as e:
        assert "twice" in str(e)
    else:
        raise AssertionError("double free not detected")


def test_reservation_blocks_unreserved_allocation() -> None:
    pool = PagePool(4, 1, 1)
    assert pool.reserve(3)
    assert pool.allocate(2) is None  # only 1 unreserved page
    assert pool.allocate(2, from_reserved=1) is not None
    assert pool.reserved == 2 and pool.num_free == 2


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), min_size=1, max_size=40),
    st.sampled_from(["own", "budget", "arena"]),
)
@example([(True, 3000), (True, 3000), (False, 6000), (True, 5000), (True, 2000)], "own")  # compaction
@example([(True, 3000), (True, 3000), (False, 6000), (True, 5000), (True, 2000)], "arena")
def test_pages_come_in_fifo_order_of_their_frees(ops: list[tuple[bool, int]], mode: str) -> None:
    """Against a plain FIFO of free ids (a pool of its own: 0..n-1 first; on a budget: the freed
    ids first, then fresh ones in order), through the free lists' compaction (> 4096 ids taken);
    on an arena (2 units a page) the held pages' units stay distinct and come back on free."""
    import collections

    from swaserve.kvcache.budget import ByteBudget

    n = 9000
    budget = {"own": None, "budget": ByteBudget(2 * n), "arena": ByteBudget(2 * n, unit_bytes=1)}[mode]
    pool = PagePool(n, 2, 1, budget)
    model: collections.deque[int] = collections.deque(range(0 if budget else n))
    fresh = 0
    held: list[int] = []
    for take, k in ops:
        if take:
            got = pool.allocate(k)
            if len(held) + k > n:
                assert got is None
                continue
            if budget:
                while len(model) < k:
                    model.append(fresh)
                    fresh += 1
            want = [model.popleft() for _ in range(k)]
            assert got == want
            held += want
        else:
            back, held = held[: k // 2], held[k // 2 :]
            pool.free(back)
            model.extend(back)
        assert pool.num_used == len(held) and pool.num_free == n - len(held)
        assert all(not pool.is_free(p) for p in held[:50]) and pool.is_free(n + 1)
        if mode == "arena":
            assert budget is not None
            units = [u for p in held for u in pool.units[2 * p : 2 * p + 2]]
            assert len(set(units)) == len(units) and min(units, default=0) >= 0
            assert budget.free_units == 2 * (n - len(held))
    with pytest.raises(ValueError, match="twice"):
        pool.free([n + 5])
