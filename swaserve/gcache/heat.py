"""A GCache node's page entries and their eviction order: ``Entry`` (one stored or reserved page
object), ``HeatHeaps`` (per tier and slot class, a min-heap by heat).

Heat = exponentially decayed access count (``half_life_s``), kept as the time-invariant score
``log2(count) + t / half_life`` so heats compare at any time without decaying every page (the
store lifts ancestors to their children's level: ``PageStore._propagate``). Eviction order and
lifts go by ``level(score)``, the score to 1/``LEVELS`` (half_life / 256 of recency): pages of a
chain read or written one after another share a level, so a read lifts no ancestor and costs
O(1), not O(depth), and a level's ties go to the deeper page. A heap item is
(level, -index, token, entry); an item is current while its entry's ``token`` and tier are
unchanged, so a new score or a move only pushes a new item and stale ones are skipped on pop, or
dropped when a heap grows past twice its live pages + ``HEAP_SLACK``.
Sans IO. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from swaserve.gcache.tiers import Slot, Tier

PageId = tuple[bytes, int]  # (key, kind)
HEAP_SLACK = 1024  # a class's eviction heap is compacted (stale items out) past 2x live + this
LEVELS = 256  # heat levels per score unit (a doubled count, or one half-life of recency)


def level(score: float) -> float:
    """``score`` rounded down to the heat's resolution, 1 / ``LEVELS`` (exact in binary)."""
    return math.floor(score * LEVELS) / LEVELS if score > -math.inf else score


@dataclass(frozen=True)
class Block:
    """A router prefix-index block a full page completes: its key, position in its chain and the
    previous block's key (None at depth 0) (``kvcache.hashing``)."""

    key: int
    depth: int
    parent: int | None


@dataclass(eq=False, slots=True)
class Entry:
    """A page object on a node: key, kind, parent key, index in its chain, size (object bytes:
    header + payload), where it lives (tier, slot), and the store's bookkeeping."""

    key: bytes
    kind: int
    parent: bytes
    index: int
    size: int
    tier: Tier
    slot: Slot
    committed: bool = False
    score: float = -math.inf
    token: int = 0  # the heap item that is current (0: none, the entry is gone)
    leased: int = 0
    nvme_reads: int = 0
    deadline: float = 0.0  # uncommitted: reclaimed after
    needs_parent: bool = False  # a full page whose parent must be on this node
    block: Block | None = None  # the routers' index block this page completes

    @property
    def pid(self) -> PageId:
        return self.key, self.kind

    @property
    def parent_pid(self) -> PageId:
        return self.parent, self.kind


Item = tuple[float, int, int, Entry]


class HeatHeaps:
    """Per (tier, slot class) min-heaps of entries by heat. half_life_s: heat half-life (s)."""

    def __init__(self, half_life_s: float) -> None:
        self.half_life = half_life_s
        self.heaps: dict[tuple[str, int], list[Item]] = {}
        self._cap: dict[tuple[str, int], int] = {}  # a heap's length that triggers compaction
        self._tokens = itertools.count(1)

    def heat_up(self, e: Entry, now: float) -> None:
        """One access to ``e`` at ``now`` (s): its decayed count + 1."""
        t = now / self.half_life
        count = 2.0 ** (e.score - t) if e.score > -math.inf else 0.0
        self.set_score(e, math.log2(count + 1.0) + t)

    def set_score(self, e: Entry, score: float) -> None:
        """Give ``e`` ``score`` and a current item in its tier and class's heap (after a move too)."""
        e.score, e.token = score, next(self._tokens)
        key = (e.tier.name, e.slot[0])
        heap = self.heaps.setdefault(key, [])
        heapq.heappush(heap, (level(score), -e.index, e.token, e))
        if len(heap) > self._cap.get(key, HEAP_SLACK):  # stale items pile up without evictions
            heap[:] = [item for item in heap if self._current(item, e.tier)]
            heapq.heapify(heap)
            self._cap[key] = 2 * len(heap) + HEAP_SLACK

    @staticmethod
    def forget(e: Entry) -> None:
        """``e`` left the store: its heap items are stale from now on."""
        e.token = 0

    @staticmethod
    def _current(item: Item, tier: Tier) -> bool:
        e = item[3]
        return e.token == item[2] and e.tier is tier

    def coldest(self, tier: Tier, size: int, ok: Callable[[Entry], bool]) -> Entry | None:
        """The coldest current entry of ``tier``'s class ``size`` passing ``ok`` (stale items
        dropped; current ones that fail ``ok`` kept)."""
        heap, keep = self.heaps.setdefault((tier.name, size), []), []
        found = None
        while heap:
            item = heapq.heappop(heap)
            if not self._current(item, tier):
                continue  # stale
            keep.append(item)
            if ok(item[3]):
                found = item[3]
                break
        for item in keep:
            heapq.heappush(heap, item)
        return found
