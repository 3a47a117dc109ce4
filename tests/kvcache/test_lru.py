"""``kvcache.lru.CategoryLRU``: per-category LRU order, category moves, stale entries."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from swaserve.kvcache.lru import CategoryLRU


@dataclass(eq=False)
class Item:
    id: int
    stamp: int = 0
    swa_q: str | None = None


def test_pop_order_follows_stamps_and_moves_keep_them() -> None:
    lru = CategoryLRU(("a", "b"), ("c",))
    xs = [Item(i, stamp=10 - i) for i in range(5)]  # x4 is the least recently used
    for x in xs:
        lru.put(x, "a")
    lru.put(xs[4], "c")  # tracked, never popped
    lru.put(xs[3], "b")
    lru.put(xs[3], "a")  # back: keeps its stamp, so still the oldest in "a"
    lru.restamp(xs[2], 100)  # used: now the most recent
    assert [lru.pop("a") for _ in range(4)] == [xs[3], xs[1], xs[0], xs[2]]
    assert lru.pop("a") is None and lru.pop("b") is None
    assert xs[4].swa_q == "c" and lru.counts["c"] == 1 and lru.counts["a"] == 0
    with pytest.raises(ValueError):
        lru.put(xs[0], "nope")


def test_random_operations_match_a_reference_and_heaps_stay_small() -> None:
    rng = random.Random(0)
    lru = CategoryLRU(("a", "b"))
    items = [Item(i) for i in range(50)]
    clock = 0
    for _ in range(20000):
        x = rng.choice(items)
        op = rng.random()
        if op < 0.4:
            clock += 1
            lru.restamp(x, clock)
        elif op < 0.8:
            lru.put(x, rng.choice(["a", "b", None]))
        else:
            cat = rng.choice(["a", "b"])
            want = min((y for y in items if y.swa_q == cat), key=lambda y: (y.stamp, y.id), default=None)
            assert lru.pop(cat) is want
        for cat in ("a", "b"):
            assert lru.counts[cat] == sum(y.swa_q == cat for y in items)
            assert len(lru.heaps[cat]) <= 2 * lru.counts[cat] + 257
    assert all(lru.has_entry(y) for y in items)
