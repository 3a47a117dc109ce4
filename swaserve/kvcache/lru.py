"""Least-recently-used order per eviction category: lazy min-heaps keyed by a use stamp.

``CategoryLRU``: one heap of ``(stamp, id, node)`` per SWA eviction stage, so the next candidate of a
stage costs O(log n) amortized instead of a scan; a touch only sets the node's stamp, and stale or
dead entries are fixed when they reach the top.

Design notes: docs/DESIGN.md#kvcachelrupy"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Protocol


class Stamped(Protocol):
    stamp: int
    id: int
    swa_q: str | None


Entry = tuple[int, int, Stamped]


class CategoryLRU:
    """Per-category LRU heaps over nodes.

    Args:
        heap_categories: categories that get a heap (can be popped in LRU order).
        other_categories: categories that are tracked (``node.swa_q``) but never popped.
    """

    def __init__(self, heap_categories: tuple[str, ...], other_categories: tuple[str, ...] = ()) -> None:
        self.heaps: dict[str, list[Entry]] = {c: [] for c in heap_categories}
        self.known = set(heap_categories) | set(other_categories)
        self.counts: Counter[str] = Counter()

    def put(self, x: Stamped, cat: str | None) -> None:
        """Place ``x`` in ``cat`` (None = no category), keeping its stamp."""
        if cat is not None and cat not in self.known:
            raise ValueError(f"unknown category {cat!r}")
        if x.swa_q == cat:
            return
        if x.swa_q is not None:
            self.counts[x.swa_q] -= 1
        x.swa_q = cat
        if cat is not None:
            self.counts[cat] += 1
            self._push(cat, x)

    @staticmethod
    def restamp(x: Stamped, stamp: int) -> None:
        """``x`` was used: it moves to the most recent end of its category (lazily)."""
        x.stamp = stamp

    def demote(self, x: Stamped, stamp: int = -1) -> None:
        """``x`` becomes older than every use (``stamp`` below the clock's first value): it is its
        category's first candidate at once (a second entry; the first one dies at the top)."""
        x.stamp = stamp
        if x.swa_q is not None:
            self._push(x.swa_q, x)

    def _push(self, cat: str, x: Stamped) -> None:
        heap = self.heaps.get(cat)
        if heap is None:
            return
        heapq.heappush(heap, (x.stamp, x.id, x))
        if len(heap) > 2 * self.counts[cat] + 256:
            live = {e[2].id: (e[2].stamp, e[2].id, e[2]) for e in heap if self.live(e, cat)}
            heap[:] = list(live.values())
            heapq.heapify(heap)

    @staticmethod
    def live(e: Entry, cat: str) -> bool:
        """The entry's node is in ``cat`` (its stamp may have moved on since)."""
        return e[2].swa_q == cat

    def pop(self, cat: str) -> Stamped | None:
        """Remove and return the least recently used node of ``cat`` (its category becomes None;
        ``put`` it back if it stays), or None if the category is empty."""
        heap = self.heaps[cat]
        while heap:
            e = heapq.heappop(heap)
            x = e[2]
            if x.swa_q != cat:
                continue  # dead: the node moved to another category or left
            if e[0] != x.stamp:  # touched since pushed: back in at its current position
                heapq.heappush(heap, (x.stamp, x.id, x))
                continue
            self.counts[cat] -= 1
            x.swa_q = None
            return x
        return None

    def has_entry(self, x: Stamped) -> bool:
        """``x`` can be popped from its category (for invariant checks; O(heap))."""
        if x.swa_q is None or x.swa_q not in self.heaps:
            return True
        return any(e[2] is x and e[0] <= x.stamp for e in self.heaps[x.swa_q])
