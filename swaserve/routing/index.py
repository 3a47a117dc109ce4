"""The router's prefix index: which prefill instance holds which prefix blocks.

Keys are block hash chains (``routing.hashing``). An entry is one (block, instance) pair with its
last use. Two ways to fill it:

* *Approximate* (default): at dispatch, the router records the request's chain on the instance it
  chose (``record``), on the assumption that the worker will cache what it computed.
* *Precise*: workers publish the blocks they store and evict; ``record`` / ``evict`` follow them.

Bounds: at most ``max_entries`` entries in all (one global LRU over every instance's entries: a
per-instance cap would let the index grow with the number of instances), and an entry unused for
``ttl_s`` seconds no longer matches and is dropped. ``remove_instance`` drops an instance's entries
when it leaves. Backends: ``InMemoryPrefixIndex`` here, ``routing.redis_store.RedisPrefixIndex``
(shared by stateless router replicas). Times are the caller's clock (seconds), injected.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

# Defaults: 4M entries of 64 tokens each describe 256M cached tokens across the cluster, far more
# than 16 instances hold (a MiMo-V2.5-Pro instance holds ~2M tokens in full-layer KV on 8 H200s), at
# about 100 bytes an entry in memory or in Redis (~400 MB worst case). An hour of TTL outlives a
# cached prefix on a busy instance (the device tier turns over in minutes, the host tier in tens of
# minutes), so an entry that old points at KV that is gone.
DEFAULT_MAX_ENTRIES = 4_000_000
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class IndexConfig:
    """``max_entries``: global cap on (block, instance) entries, >= 1. ``ttl_s``: seconds an
    entry matches after its last use, > 0."""

    max_entries: int = DEFAULT_MAX_ENTRIES
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        if self.max_entries < 1 or self.ttl_s <= 0:
            raise ValueError(f"need max_entries >= 1 and ttl_s > 0, got {self.max_entries}, {self.ttl_s}")


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
    def record(self, instance: str, hashes: Sequence[int], now: float) -> None:
        """Mark ``hashes`` (a chain from its root block) as held by ``instance``, last used ``now``
        (dispatch, or a store event); then drop expired entries and enforce the cap, least recently
        used first, and among entries used at the same time the deepest blocks first (a chain
        that lost its head matches nothing)."""

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
    """The index in this process: an ordered dict of entries in LRU order plus per-hash and
    per-instance sets. ``record`` is O(blocks + dropped), ``match`` O(blocks x holders)."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self._lru: OrderedDict[tuple[int, str], float] = OrderedDict()
        self._by_hash: dict[int, set[str]] = {}
        self._by_inst: dict[str, set[int]] = {}

    def match(
        self, hashes: Sequence[int], now: float, instances: Collection[str] | None = None
    ) -> dict[str, int]:
        oldest = now - self.config.ttl_s
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for k, h in enumerate(hashes):
            holders = {i for i in self._by_hash.get(h, ()) if self._lru[(h, i)] >= oldest}
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

    def record(self, instance: str, hashes: Sequence[int], now: float) -> None:
        mine = self._by_inst.setdefault(instance, set())
        for h in reversed(hashes):  # deepest first: among equal last uses, evicted first
            key = (h, instance)
            if key in self._lru:
                self._lru.move_to_end(key)
            self._lru[key] = now
            self._by_hash.setdefault(h, set()).add(instance)
            mine.add(h)
        oldest = now - self.config.ttl_s
        while self._lru:
            key, t = next(iter(self._lru.items()))
            if t >= oldest and len(self._lru) <= self.config.max_entries:
                break
            self._drop(*key)

    def _drop(self, h: int, instance: str) -> None:
        del self._lru[(h, instance)]
        holders = self._by_hash[h]
        holders.discard(instance)
        if not holders:
            del self._by_hash[h]
        self._by_inst[instance].discard(h)

    def evict(self, instance: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            if (h, instance) in self._lru:
                self._drop(h, instance)

    def remove_instance(self, instance: str) -> int:
        hs = self._by_inst.pop(instance, set())
        for h in hs:
            del self._lru[(h, instance)]
            holders = self._by_hash[h]
            holders.discard(instance)
            if not holders:
                del self._by_hash[h]
        return len(hs)

    def size(self) -> int:
        return len(self._lru)

    def entries(self, instance: str) -> list[tuple[int, float]]:
        return [(h, self._lru[(h, instance)]) for h in self._by_inst.get(instance, ())]

    def instances(self) -> list[str]:
        """Instances with at least one entry."""
        return [i for i, hs in self._by_inst.items() if hs]
