"""Consistency checks of pools, page tables, the radix tree and the host tier (tests, debugging).

``check(kv)`` raises ``AssertionError`` naming the first broken invariant: page ownership across
pools and tiers, reservations, admissions and locks, tree shape, SWA eviction categories.

The invariants: docs/DESIGN.md#kvcacheinvariantspy"""

from __future__ import annotations

from collections import Counter

from swaserve.kvcache.budget import ByteBudget
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.radix import RadixNode


def _units(budget: ByteBudget, pools: list[PagePool], name: str) -> None:
    """Arena units: each page held maps to its own units, free pages to none, every unit is either
    free or held by exactly one page, and the units held are the bytes used."""
    held: list[int] = []
    for q in pools:
        m = q.units_per_page
        assert m * (budget.unit_bytes or 0) == q.page_bytes, f"{name}: page bytes not whole units"
        for p in range(q.issued):
            us = q.units[p * m : (p + 1) * m]
            if q.is_free(p):
                assert all(u == -1 for u in us), f"{name} free page {p} still maps to units {list(us)}"
            else:
                assert all(0 <= u < budget.num_units for u in us), f"{name} page {p}: units {list(us)}"
                held.extend(us)
    assert len(held) == len(set(held)), f"{name} arena: a unit is held by two pages"
    assert len(held) + budget.free_units == budget.num_units, f"{name} arena: units leaked"
    assert len(held) * (budget.unit_bytes or 0) == budget.used, f"{name} arena: units held != bytes used"


def _owned(pool: PagePool, owners: dict[int, str], name: str) -> None:
    for p in range(pool.issued):
        free = pool.is_free(p)
        assert not (free and p in owners), f"{name} page {p} is free and owned by {owners[p]}"
        assert free or p in owners, f"{name} page {p} is neither free nor owned (leak)"


def _claim(owners: dict[int, str], pages: list[int], who: str, name: str) -> None:
    for p in pages:
        assert p not in owners, f"{name} page {p} owned by both {owners[p]} and {who}"
        owners[p] = who


def check(kv: KVCacheManager) -> None:
    """Assert every invariant in the module doc over ``kv`` and its prefix cache."""
    cache = kv.cache
    owners: dict[str, dict[int, str]] = {"full": {}, "swa": {}, "host_full": {}, "host_swa": {}}
    nodes: list[RadixNode] = cache.tree.nodes() if cache is not None else []
    for x in nodes:
        P = kv.page_size
        n = len(x.key) // P
        assert n > 0 and len(x.key) == n * P, f"{x}: key not whole pages"
        assert x.parent is not None and x.parent.children.get(tuple(x.key[:P])) is x, f"{x}: bad parent link"
        for attr in ("full", "swa", "host_full", "host_swa"):
            v = getattr(x, attr)
            assert v is None or len(v) == n, f"{x}: {attr} has {len(v)} pages for {n}"
        assert x.full is not None or x.host_full is not None, f"{x}: no full KV in any tier"
        assert x.swa is None or x.full is not None, f"{x}: device SWA without device full KV"
        if x.full is None:
            assert not x.has_device_child(), f"{x}: off device but a child is on device"
        assert x.lock >= 0 and x.swa_lock >= 0, f"{x}: negative lock"
        assert x.swa_lock == len(x.swa_holders), f"{x}: SWA lock count != holders"
        assert x.swa_lock == 0 or x.swa is not None, f"{x}: SWA-locked tombstone"
        if cache is not None and cache.tree.window is not None and cache.tree.has_swa:
            dead = x.full is not None and x.swa is None and x.lock == 0 and not x.children
            assert not dead, f"{x}: unlocked SWA-tombstone leaf on device"
        if cache is not None:
            cat = cache.tree.swa_category(x)
            assert x.swa_q == cat, f"{x}: SWA eviction category {x.swa_q} != {cat}"
            assert cache.tree.swa_order.has_entry(x), f"{x}: no live LRU entry in {cat}"
        _claim(owners["full"], x.full or [], f"node {x.id}", "full")
        _claim(owners["swa"], x.swa or [], f"node {x.id}", "swa")
        _claim(owners["host_full"], x.host_full or [], f"node {x.id}", "host_full")
        _claim(owners["host_swa"], [p for p in x.host_swa or [] if p is not None], f"node {x.id}", "host_swa")
    if cache is not None:
        for name, pages in cache.staged.items():  # host pages an L3 fetch holds
            _claim(owners[name], sorted(pages), "L3 staging", name)
        expect_lock: Counter[int] = Counter()
        expect_swa: Counter[int] = Counter()
        for h in cache.tree.handles():
            y: RadixNode | None = h.node
            while y is not None and y is not cache.tree.root:
                expect_lock[y.id] += 1
                y = y.parent
            for z in h.swa_nodes:
                expect_swa[z.id] += 1
        for x in nodes:
            assert x.lock == expect_lock[x.id], f"{x}: lock {x.lock} != handles {expect_lock[x.id]}"
            assert x.swa_lock == expect_swa[x.id], f"{x}: SWA lock {x.swa_lock} != {expect_swa[x.id]}"
    for name, k in (("full", kv.full), ("swa", kv.swa)):
        tree_pages = set(owners[name])
        for rid, t in k.tables.items():
            shared = t.pages[: max(0, t.shared_end - t.base)]
            assert all(p in tree_pages for p in shared), f"request {rid}: shared {name} page not in tree"
            _claim(owners[name], t.private(), f"request {rid}", name)
        assert sum(t.reserved for t in k.tables.values()) == k.pool.reserved, f"{name}: reservations"
    assert set(kv.admitted) == set(kv.full.tables), "admitted requests and page tables differ"
    live = {h.id for h in cache.tree.handles()} if cache is not None else set()
    for rid, a in kv.admitted.items():
        assert a.lock is None or a.lock.id in live, f"request {rid}: its cache lock is not a live handle"
    pools: dict[str, PagePool | None] = {"full": kv.full.pool, "swa": kv.swa.pool}
    if cache is not None:
        pools["host_full"], pools["host_swa"] = cache.host_full, cache.host_swa
    for name, pool in pools.items():
        if pool is not None and (name != "swa" or kv.has_swa):
            _owned(pool, owners[name], name)
    budgets: list[tuple[ByteBudget | None, list[PagePool | None], str]] = [
        (kv.budget, [kv.full.pool, kv.swa.pool], "device")
    ]
    if cache is not None and cache.host_full is not None and cache.host_full.budget is not None:
        budgets.append((cache.host_full.budget, [cache.host_full, cache.host_swa], "host"))
    for budget, bpools, name in budgets:
        if budget is None:
            continue
        ps = [q for q in bpools if q is not None and q.budget is budget]
        used = sum(q.num_used * q.page_bytes for q in ps)
        reserved = sum(q.reserved * q.page_bytes for q in ps)
        assert budget.used == used, f"{name} budget: {budget.used} B used, pools hold {used} B"
        assert budget.reserved == reserved, f"{name} budget: {budget.reserved} B reserved, pools {reserved} B"
        assert budget.used + budget.reserved <= budget.total, f"{name} budget exceeded: {budget}"
        if budget.unit_bytes is not None:
            _units(budget, ps, name)
    if cache is not None:
        assert kv.cached_pages() == cache.cached_pages(), (
            "pool-derived cache page counts disagree with the tree"
        )
