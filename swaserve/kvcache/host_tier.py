"""The host tier (L2) of the prefix cache: copies of device pages in host memory, their LRU eviction,
and, when the host pools share one byte budget, the adaptive split between them.

``HostTier`` is a mixin of ``PrefixCache`` (``kvcache.prefix_cache``): it holds the host side of the
cache's methods and reads the cache's tree, pools and mover. Host tier design:
docs/DESIGN.md#kvcacheprefix_cachepy"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from swaserve.config import FULL, SWA
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.radix import RadixNode

if TYPE_CHECKING:
    from swaserve.kvcache.adaptive import AdaptiveSplit
    from swaserve.kvcache.mover import PageMover
    from swaserve.kvcache.radix import RadixTree
    from swaserve.kvcache.stats import CacheStats


class HostTier:
    """Host-tier methods of ``PrefixCache`` (attributes declared here are set by it)."""

    tree: RadixTree
    page_size: int
    host_full: PagePool | None
    host_swa: PagePool | None
    mover: PageMover
    split: AdaptiveSplit | None
    host_split: AdaptiveSplit | None
    stats: CacheStats
    _pinned: set[RadixNode]

    # set by PrefixCache (its methods): annotations only, no fallback body
    _lost_pages: Callable[..., None]
    _detach: Callable[[RadixNode], None]
    # L3 write-back (engine.l3_tier): called with a node whose host copies are about to be freed
    # (``swa_only``: only its host SWA pages); it copies what it wants before returning
    l3_sink: Callable[[RadixNode, bool], None] | None = None
    staged: dict[str, set[int]]  # host pages reserved for L3 fetches, not yet in the tree

    def _host_swa_slice(self, x: RadixNode) -> int:
        """Index of the first page of ``x`` whose SWA KV gets a host copy."""
        wp = self.tree.window_pages()
        n = len(x.key) // self.page_size
        return 0 if wp is None else max(0, n - wp)

    def _backup(self, x: RadixNode) -> bool:
        """Copy ``x``'s device full KV (and trailing SWA) to host; False if the host has no room."""
        assert x.full is not None and self.host_full is not None
        if x.host_full is None:
            if not self._host_room(self.host_full, len(x.full), x):
                return False
            host = self.host_full.allocate(len(x.full))
            assert host is not None
            self.mover.to_host(FULL, x.full, host)
            x.host_full = host
            self.tree.host_lru[x] = None
            self.stats.saved_pages += len(host)
        if x.swa is not None:
            self._backup_swa(x)
        return True

    def _backup_swa(self, x: RadixNode) -> None:
        if x.swa is None or self.host_swa is None:
            return
        k = self._host_swa_slice(x)
        have = x.host_swa or [None] * len(x.swa)
        missing = [i for i in range(k, len(x.swa)) if have[i] is None]
        if not missing or not self._host_room(self.host_swa, len(missing), x):
            return
        host = self.host_swa.allocate(len(missing))
        assert host is not None
        self.mover.to_host(SWA, [x.swa[i] for i in missing], host)
        for i, h in zip(missing, host, strict=True):
            have[i] = h
        x.host_swa = have
        self.stats.saved_pages += len(host)

    def _host_room(self, pool: PagePool, n: int, keep: RadixNode) -> bool:
        """Evict host copies (LRU) until ``n`` pages of ``pool`` are free; never ``keep``'s."""
        if n > pool.num_pages:
            return False
        if pool.num_free >= n:
            return True
        self.mover.sync()
        hs, split = self.host_split, self.host_swa
        progress = True
        while progress and pool.num_free < n:
            side = pool
            if hs is not None and split is not None and self.host_full is not None:
                over = split.num_used > 0 and hs.swa_first(split.num_used * split.page_bytes)
                side = split if over else self.host_full
            need = (n - pool.num_free) * pool.page_bytes
            progress = self._host_evict(side, need, keep)
            if not progress and side is not pool:  # shared budget: the other side
                other = self.host_full if side is split else split
                assert other is not None
                progress = self._host_evict(other, need, keep)
        return pool.num_free >= n

    def _host_evict(self, side: PagePool, need: int, keep: RadixNode) -> bool:
        """Drop host copies of ``side``'s kind, least recently used first, worth ``need`` bytes."""
        victims: list[RadixNode] = []
        got = 0
        for y in self.tree.host_lru:  # collect first: evicting changes the LRU
            if got >= need:
                break
            if y is keep or y in self._pinned:
                continue
            if side is self.host_swa:
                if y.host_swa is not None:
                    victims.append(y)
                    got += sum(p is not None for p in y.host_swa) * side.page_bytes
            elif y.full is not None or (not y.children and y.lock == 0):
                victims.append(y)  # a host copy of a device node, or an off-device leaf
                got += len(y.host_full or []) * side.page_bytes
        for y in victims:
            if side is self.host_swa:
                if self.l3_sink is not None:
                    self.l3_sink(y, True)
                self._free_host_swa(y)
            elif y.full is not None:
                self._drop_host(y)
            else:
                self._lost_pages(y, len(y.host_full or []) * side.page_bytes)
                self._drop_host(y)  # first: the L3 sink reads y's path
                self._detach(y)
        return bool(victims)

    def _free_host_swa(self, y: RadixNode) -> None:
        assert self.host_swa is not None and y.host_swa is not None
        if self.split is not None and y.swa is None and y.parent is not None:
            self.split.lost_window(y, len(y.host_swa))
        self.host_swa.free([p for p in y.host_swa if p is not None])
        y.host_swa = None

    def _drop_host(self, y: RadixNode) -> None:
        if self.l3_sink is not None and (y.host_full is not None or y.host_swa is not None):
            self.l3_sink(y, False)
        if y.host_swa is not None:
            self._free_host_swa(y)
        if y.host_full is not None:
            assert self.host_full is not None
            self.host_full.free(y.host_full)
            y.host_full = None
            del self.tree.host_lru[y]

    # -- L3 (engine.l3_tier) --------------------------------------------------------------------
    def reserve_host(
        self, tokens: list[int], d: int, n_full: int, n_swa: int
    ) -> tuple[list[int], list[int]] | None:
        """Host pages for KV fetched from L3 to extend the cached path of ``tokens`` at page ``d``:
        ``n_full`` full and ``n_swa`` SWA pages, evicting other host copies (never those of that
        path). None: the host tier cannot hold them (nothing is taken)."""
        hf, hs = self.host_full, self.host_swa
        if hf is None or (n_swa and hs is None):
            return None
        path = {pg.node for pg in self.tree.walk(tokens, d)}
        keep = next(iter(path), self.tree.root)
        self._pinned = path
        try:
            if not self._host_room(hf, n_full, keep):
                return None
            full = hf.allocate(n_full)
            if full is None:
                return None
            if n_swa:
                assert hs is not None
                swa = hs.allocate(n_swa) if self._host_room(hs, n_swa, keep) else None
                if swa is None:
                    hf.free(full)
                    return None
            else:
                swa = []
        finally:
            self._pinned = set()
        self.staged["host_full"].update(full)
        self.staged["host_swa"].update(swa)
        return full, swa

    def free_host(self, full: list[int], swa: list[int]) -> None:
        """Give back pages ``reserve_host`` took (a fetch that failed or came too late)."""
        self.staged["host_full"].difference_update(full)
        self.staged["host_swa"].difference_update(swa)
        if full:
            assert self.host_full is not None
            self.host_full.free(full)
        if swa:
            assert self.host_swa is not None
            self.host_swa.free(swa)

    def insert_host(
        self, tokens: list[int], d: int, host_full: list[int], host_swa: list[int | None]
    ) -> RadixNode | None:
        """Add host-resident KV (fetched from L3) for pages ``d .. d + len(host_full)`` of ``tokens``
        as a new node under the node ending at page ``d`` (split there if needed). The tree must
        still hold full KV for exactly pages ``0 .. d`` of ``tokens``; None (nothing changed) when
        it no longer does. The pages become the tree's."""
        tree, P = self.tree, self.page_size
        n = len(host_full)
        if n == 0 or len(host_swa) != n or len(tokens) < (d + n) * P:
            raise ValueError("insert_host needs one full and one SWA slot per page")
        pages = tree.walk(tokens, d + 1)
        if len(pages) != d:
            return None
        parent = tree.node_at(pages, d)
        self.staged["host_full"].difference_update(host_full)
        self.staged["host_swa"].difference_update(p for p in host_swa if p is not None)
        key = tokens[d * P : (d + n) * P]
        x = RadixNode(key, parent)
        parent.children[tuple(key[:P])] = x
        x.host_full = host_full
        x.host_swa = host_swa if any(p is not None for p in host_swa) else None
        tree.host_lru[x] = None
        tree.requeue(x, parent)
        if tree.events is not None:
            tree.events.stored(tokens[: (d + n) * P], d * P)
        return x
