"""The simulator's L3 tier: the real GCache store (``gcache.store.PageStore``: heat, prefix-closed
eviction, size classes) and the engine's own read and write rules (``engine.l3_tier``:
``best_stop``, ``writeback``, ``PrefixCache.reserve_host`` / ``insert_host``), over a tier that
counts bytes without holding them. Page objects keep their real proportions scaled down by
``scale`` (payload bytes / scale, the header unscaled), so capacities are real bytes / scale.
One ``SimL3`` is shared by every simulated prefill instance; a fetch costs
``CostModel.l3_fetch_s``."""

from __future__ import annotations

from collections import OrderedDict

from swaserve.config import FULL
from swaserve.engine.l3_pages import (
    KNOWN_KEYS,
    ChainKeys,
    as_block_events,
    best_stop,
    router_blocks,
    writeback,
)
from swaserve.gcache import codec
from swaserve.gcache.codec import FULL_KIND, SWA_KIND
from swaserve.gcache.keys import Salt, page_keys
from swaserve.gcache.l3 import PutPage, put_into
from swaserve.gcache.store import PageStore
from swaserve.gcache.tiers import Slot, Tier
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.prefix_cache import PrefixCache
from swaserve.kvcache.radix import RadixNode


class CountingTier(Tier):
    """A DRAM-like tier that keeps slot accounting and no bytes."""

    name = "dram"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, 64)

    def _grow(self, c: object, n: int) -> None:
        return None

    def _cut(self, c: object) -> None:
        return None

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        return None

    def read(self, slot: Slot, nbytes: int) -> bytes:
        return bytes(nbytes)


class SimL3:
    """Args: capacity: L3 bytes (real). page_size, window_pages: the engine's. page_bytes: real
    bytes of one full and one SWA page. min_tokens: the least extension worth a fetch. clock:
    simulated seconds."""

    def __init__(
        self,
        capacity: int,
        page_size: int,
        window_pages: int,
        page_bytes: dict[str, int],
        min_tokens: int = 256,
        clock=None,  # type: ignore[no-untyped-def]
    ) -> None:
        self.scale = max(1, page_bytes[FULL] // 4096)
        self.store = PageStore(CountingTier(capacity // self.scale), clock=clock or (lambda: 0.0))
        self.P, self.wp = page_size, window_pages
        self.min_pages = max(window_pages, -(-min_tokens // page_size))
        self.payload = {k: bytes(max(1, v // self.scale)) for k, v in page_bytes.items()}
        self.seed = Salt("sim", "sim", "sim", page_size).seed()
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self.chain = ChainKeys(page_size, self.seed)
        self.fetched_tokens = 0

    def attach(self, cache: PrefixCache) -> None:
        """Write ``cache``'s host evictions back here (its ``l3_sink``)."""
        cache.l3_sink = lambda y, swa_only: self._sink(cache, y, swa_only)

    def _sink(self, cache: PrefixCache, y: RadixNode, swa_only: bool) -> None:
        tokens, keys, items = writeback(y, swa_only, self.wp, self.chain, self.known)
        # pages the store holds are only touched (what a put of them does there), not re-encoded
        pids = [(keys[i], FULL_KIND if kind == FULL else SWA_KIND) for kind, i, _, _ in items]
        self.store.touch(p for p in pids if p in self.store.index)
        todo = [(it, pid) for it, pid in zip(items, pids, strict=True) if pid not in self.store.index]
        blocks = router_blocks(tokens, self.P, cache.events) if todo and cache.events else {}
        pages = []
        for (kind, i, _, _), (key, k) in todo:
            parent = keys[i - 1] if i else self.seed
            obj = codec.encode(
                k, i, self.seed, key, parent, tokens[i * self.P : (i + 1) * self.P], self.payload[kind]
            )
            pages.append(PutPage((key, k), parent, i, obj, block=blocks.get(i) if kind == FULL else None))
        for p, ok in zip(pages, put_into(self.store, pages), strict=True):
            if ok and p.pid[1] == FULL_KIND:
                self.known[p.pid[0]] = None
        for key, k in pids:
            if k == FULL_KIND and key in self.known:
                self.known.move_to_end(key)
        while len(self.known) > KNOWN_KEYS:
            self.known.popitem(last=False)

    def extend(self, cache: PrefixCache, prompt: list[int]) -> int:
        """Put into ``cache``'s host tier what L3 adds to its hit on ``prompt`` (as the engine's
        fetch, instantly); returns the tokens added."""
        P = self.P
        maxp = (len(prompt) - 1) // P
        d = len(cache.tree.walk(prompt, maxp))
        if maxp - d < self.min_pages:
            return 0
        keys = page_keys(prompt[: maxp * P], P, self.seed)
        pids = [(keys[i], k) for k in (FULL_KIND, SWA_KIND) for i in range(d, maxp)]
        present, lease = self.store.lookup(pids)
        p = best_stop(present, d, self.wp, self.min_pages)
        self.store.release(lease)
        if not p:
            return 0
        got = cache.reserve_host(prompt, d, p - d, self.wp)
        if got is None:
            return 0
        full, swa = got
        self.store.touch(
            [(keys[i], FULL_KIND) for i in range(d, p)] + [(keys[i], SWA_KIND) for i in range(p - self.wp, p)]
        )
        if cache.insert_host(prompt[: p * P], d, full, [None] * (p - d - self.wp) + list(swa)) is None:
            cache.free_host(full, swa)
            return 0
        self.fetched_tokens += (p - d) * P
        return (p - d) * P

    def drain_events(self) -> list[BlockEvent]:
        """Index-block events of the store since the last drain (precise routing)."""
        out = as_block_events(self.store.events)
        self.store.events.clear()
        return out
