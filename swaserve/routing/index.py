"""The router's prefix index: which prefill instance holds which prefix blocks (keys: block hash
chains, ``kvcache.hashing``), filled at dispatch (approximate) or from the workers' cache events
(precise). Bounded by one global LRU (``max_entries``) and a TTL; one eviction order in every
backend (oldest last use, deepest block first). ``InMemoryPrefixIndex`` here, the Redis one in
``routing.redis.store``. Times are the caller's clock (seconds), injected.

Design notes: docs/DESIGN.md#routingindexpy"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass

# Defaults: 4M entries of 64 tokens each describe 256M cached tokens across the cluster, far more
# than 16 instances hold (a MiMo-V2.5-Pro instance holds ~2M tokens in full-layer KV on 8 H200s), at
# about 100 bytes an entry in memory or in Redis (~400 MB worst case). An hour of TTL outlives a
# cached prefix on a busy instance (the device tier turns over in minutes, the host tier in tens of
# minutes), so an entry that old points at KV that is gone.
DEFAULT_MAX_ENTRIES = 4_000_000
DEFAULT_TTL_S = 3600.0
MAX_DEPTH = 999_999_999  # deepest block position an entry may have (9 digits in ``member``)


@dataclass(frozen=True)
class IndexConfig:
    """``max_entries``: global cap on (block, instance) entries, >= 1. ``ttl_s``: seconds an
    entry matches after its last use, > 0."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.ttl_s <= 0:
            raise ValueError(f"need max_entries >= 1 and ttl_s > 0, got {self.max_entries}, {self.ttl_s}")


def member(depth: int, instance: str, h: int) -> str:
    """An entry's tie-break key among equal last uses (its member in Redis' LRU sorted set):
    ``"<MAX_DEPTH - depth, 9 digits>|<instance>|<hash>"``, so deeper blocks sort first."""
    return f"{MAX_DEPTH - depth:09d}|{instance}|{h}"


def check_chain(hashes: Sequence[int], depth: int, parent: int | None) -> None:
    """Validate ``record``'s arguments. Raises ValueError: a negative depth, a depth past
    ``MAX_DEPTH``, or a parent link on a chain that starts at the root (depth 0)."""
    if depth < 0 or depth + len(hashes) > MAX_DEPTH:
        raise ValueError(f"block depth must be in [0, {MAX_DEPTH}], got {depth} + {len(hashes)} blocks")
    if parent is not None and depth == 0:
        raise ValueError("a chain from the root block (depth 0) has no parent")


class PrefixIndex(ABC):
    """Block chains per instance, one interface for every backend."""

    config: IndexConfig

    @abstractmethod
    def match(
        self, hashes: Sequence[int], now: float, instances: Collection[str] | None = None
    ) -> dict[str, int]:
        """Leading blocks of ``hashes`` each instance holds (fresh entries only).

        Returns:
            instance -> number of leading blocks (>= 1); instances with none are left out, and so
            are instances not in ``instances`` when it is given.
        """

    @abstractmethod
    def record(
        self, instance: str, hashes: Sequence[int], now: float, depth: int = 0, parent: int | None = None
    ) -> None:
        """Mark ``hashes`` as held by ``instance``: blocks ``depth, depth + 1, ...`` of one chain
        (``depth`` 0: the chain from its root block). Their last use is ``now`` (dispatch, or a
        store event); with ``parent`` (the key of block ``depth - 1``: the blocks continue a chain
        recorded before) it is the parent entry's last use instead when ``instance`` holds it fresh
        (else ``now``). Then drop expired entries and enforce the cap in eviction order (module
        docstring).

        Raises:
            ValueError: see ``check_chain``.
        """

    @abstractmethod
    def evict(self, instance: str, hashes: Sequence[int]) -> None:
        """``instance`` no longer holds ``hashes`` (an eviction event)."""

    @abstractmethod
    def remove_instance(self, instance: str) -> int:
        """Drop every entry of ``instance``; returns how many there were."""

    @abstractmethod
    def size(self) -> int:
        """Entries held (expired ones not yet dropped included)."""

    @abstractmethod
    def entries(self, instance: str) -> list[tuple[int, float]]:
        """``(hash, last_use)`` of one instance's entries (for re-sync and debugging)."""


class InMemoryPrefixIndex(PrefixIndex):
    """The index in this process: entries in a dict, per-hash and per-instance sets, and the
    eviction order as a lazy min-heap of ``(last use, member)`` (an entry re-recorded leaves a
    dead heap item behind, skipped when it reaches the top; the heap is rebuilt when dead items
    outnumber live ones). ``record`` is O(blocks log n + dropped), ``match`` O(blocks x holders)."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._entries: dict[tuple[int, str], tuple[float, str]] = {}  # (hash, inst) -> (t, member)
        self._heap: list[tuple[float, str, int, str]] = []  # (t, member, hash, inst)
        self._by_hash: dict[int, set[str]] = {}
        self._by_inst: dict[str, set[int]] = {}

    def match(
        self, hashes: Sequence[int], now: float, instances: Collection[str] | None = None
    ) -> dict[str, int]:
        oldest = now - self.config.ttl_s
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for k, h in enumerate(hashes):
            holders = {i for i in self._by_hash.get(h, ()) if self._entries[(h, i)][0] >= oldest}
            if alive is None:
                alive = holders if instances is None else holders & set(instances)
            else:
                for i in alive - holders:
                    out[i] = k
                alive &= holders
            if not alive:
                return out
        for i in alive or ():
            out[i] = len(hashes)
        return out

    def record(
        self, instance: str, hashes: Sequence[int], now: float, depth: int = 0, parent: int | None = None
    ) -> None:
        check_chain(hashes, depth, parent)
        oldest = now - self.config.ttl_s
        t = now
        if parent is not None:
            got = self._entries.get((parent, instance))
            if got is not None and got[0] >= oldest:
                t = got[0]
        mine = self._by_inst.setdefault(instance, set())
        for k, h in enumerate(hashes):
            m = member(depth + k, instance, h)
            self._entries[(h, instance)] = (t, m)
            heapq.heappush(self._heap, (t, m, h, instance))
            self._by_hash.setdefault(h, set()).add(instance)
            mine.add(h)
        while self._heap:
            t0, m0, h0, i0 = self._heap[0]
            if self._entries.get((h0, i0)) != (t0, m0):
                heapq.heappop(self._heap)  # dead: re-recorded or dropped since
            elif t0 < oldest or len(self._entries) > self.config.max_entries:
                heapq.heappop(self._heap)
                self._drop(h0, i0)
            else:
                break
        if len(self._heap) > 2 * len(self._entries) + 1024:
            self._heap = [(t, m, h, i) for (h, i), (t, m) in self._entries.items()]
            heapq.heapify(self._heap)

    def _drop(self, h: int, instance: str) -> None:
        del self._entries[(h, instance)]
        holders = self._by_hash[h]
        holders.discard(instance)
        if not holders:
            del self._by_hash[h]
        self._by_inst[instance].discard(h)

    def evict(self, instance: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            if (h, instance) in self._entries:
                self._drop(h, instance)

    def remove_instance(self, instance: str) -> int:
        hs = self._by_inst.pop(instance, set())
        for h in hs:
            del self._entries[(h, instance)]
            holders = self._by_hash[h]
            holders.discard(instance)
            if not holders:
                del self._by_hash[h]
        return len(hs)

    def size(self) -> int:
        return len(self._entries)

    def entries(self, instance: str) -> list[tuple[int, float]]:
        return [(h, self._entries[(h, instance)][0]) for h in self._by_inst.get(instance, ())]

    def dump(self, instance: str) -> list[tuple[int, float, int]]:
        """``(hash, last_use, depth)`` of one instance's entries (re-sync keeps depths)."""
        out = []
        for h in self._by_inst.get(instance, ()):
            t, m = self._entries[(h, instance)]
            out.append((h, t, MAX_DEPTH - int(m[:9])))
        return out

    def instances(self) -> list[str]:
        """Instances with at least one entry."""
        return [i for i, hs in self._by_inst.items() if hs]
