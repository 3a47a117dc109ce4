"""The prefix cache: radix tree + independent SWA / full eviction + the host-memory tier.

``PrefixCache``: ``acquire`` (window-safe match, host pages loaded back, lock), SWA eviction in
stages (trim to the window, tombstone inner nodes, evict leaves) and full eviction (leaves), each
least recently used first; host tier (L2) with the ``on_evict`` or ``second_hit`` write policy;
optional block events for the router's precise index.

Eviction stages and host tier: docs/DESIGN.md#kvcacheprefix_cachepy"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swaserve.config import FULL, SWA
from swaserve.kvcache.adaptive import AdaptiveSplit, node_page_hashes
from swaserve.kvcache.block_events import BlockEvent, BlockEventLog
from swaserve.kvcache.host_tier import HostTier
from swaserve.kvcache.mover import NoCopy, PageMover
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.radix import INNER, TRIM_INNER, TRIM_LEAF, CacheLock, RadixNode, RadixTree
from swaserve.kvcache.stats import CacheStats

WritePolicy = Literal["on_evict", "second_hit"]
__all__ = ["Acquired", "CacheStats", "PrefixCache", "WritePolicy"]


@dataclass
class Acquired:
    """A locked hit: the request reuses ``length`` tokens; its page tables start from these."""

    lock: CacheLock | None
    length: int
    host_tokens: int
    full: list[int] = field(default_factory=list)  # [length / page] device full pages
    swa: list[int | None] = field(default_factory=list)  # [length / page]; None = not in window
    diverge: int = 0  # tokens the tree holds full KV for (>= length): where the prompt leaves it


class PrefixCache(HostTier):
    """Args:
    page_size: tokens per page. window: SWA window in tokens, None = SWA-unaware (full layout).
    full_pool, swa_pool: device pools (swa_pool None if the model has no SWA layers).
    host_full, host_swa: host-tier pools (None = no host tier).
    mover: copies pages between tiers. write_policy: see module doc.
    split, host_split: the adaptive split of a shared byte budget (``kvcache.adaptive``) when the
        device pools (host pools) draw from one ``ByteBudget``; None = pools of their own.
    """

    def __init__(
        self,
        page_size: int,
        window: int | None,
        full_pool: PagePool,
        swa_pool: PagePool | None,
        host_full: PagePool | None = None,
        host_swa: PagePool | None = None,
        mover: PageMover | None = None,
        write_policy: WritePolicy = "on_evict",
        split: AdaptiveSplit | None = None,
        host_split: AdaptiveSplit | None = None,
    ) -> None:
        if write_policy not in ("on_evict", "second_hit"):
            raise ValueError(f"host write policy must be on_evict or second_hit, got {write_policy!r}")
        self.tree = RadixTree(page_size, window, full_pool, swa_pool)
        self.page_size, self.window = page_size, window
        self.full_pool, self.swa_pool = full_pool, swa_pool
        self.host_full, self.host_swa = host_full, host_swa
        self.mover: PageMover = mover or NoCopy()
        self.write_policy = write_policy
        self.stats = CacheStats()
        self._pinned: set[RadixNode] = set()
        self.staged: dict[str, set[int]] = {"host_full": set(), "host_swa": set()}
        self._suspects: set[RadixNode] = set()  # nodes that may have become dead leaves
        self.events: BlockEventLog | None = None  # the block event log (``enable_events``)
        self.split, self.host_split = split, host_split

    @property
    def has_host(self) -> bool:
        return self.host_full is not None

    # -- events ---------------------------------------------------------------------------------
    def enable_events(self, block_tokens: int, salt: str = "") -> None:
        """Start logging stored / removed block events (``kvcache.block_events``) of
        ``block_tokens``-token blocks. Raises ValueError unless it is a multiple of the page size."""
        self.events = self.tree.events = BlockEventLog(block_tokens, self.page_size, salt)

    def drain_events(self) -> list[BlockEvent]:
        """Events since the last drain, oldest first (empty when events are off)."""
        return self.events.drain() if self.events is not None else []

    def _detach(self, y: RadixNode) -> None:
        """Unlink ``y`` (off device; with its subtree) from its parent: its blocks leave the tree."""
        assert y.parent is not None
        if self.events is not None:
            self.events.removed(y)
        del y.parent.children[tuple(y.key[: self.page_size])]
        self._suspects.add(y.parent)
        y.parent = None

    # -- match and acquire ------------------------------------------------------------------------
    def match_length(self, tokens: list[int], max_tokens: int, use_host: bool = True) -> tuple[int, int]:
        """(window-safe hit tokens, of which the device alone serves) for ``tokens[:max_tokens]``;
        no state change."""
        P = self.page_size
        pages = self.tree.walk(tokens, max_tokens // P)
        n, _ = self.tree.best_length(pages, use_host and self.has_host)
        return n * P, self.tree.best_length(pages, False)[0] * P

    def acquire(
        self, tokens: list[int], max_tokens: int, use_host: bool = True, observe: bool = True
    ) -> Acquired | None:
        """Match ``tokens[:max_tokens]``, load host-resident pages of the hit back to device, lock.
        ``observe``: feed the lookup to the adaptive split (once per admission).

        Returns None (tree unchanged apart from splits and cache-to-cache eviction) if the device
        pools cannot take the host pages to load; retry with ``use_host=False, observe=False``.
        """
        P, tree = self.page_size, self.tree
        use_host = use_host and self.has_host
        pages = tree.walk(tokens, max_tokens // P)
        n, _ = tree.best_length(pages, use_host)
        diverge = len(pages) * P
        if observe and self.split is not None:
            self._observe(tokens, max_tokens // P, pages, n, use_host)
        if n == 0:
            return Acquired(None, 0, 0, diverge=diverge)
        dev = tree.best_length(pages, False)[0]  # what the device alone would have served
        node = tree.node_at(pages, n)
        wp = tree.window_pages()
        win_start = 0 if wp is None else max(0, n - wp)
        if tree.has_swa and use_host:  # a node needing SWA from host must lie inside the window
            pages = tree.walk(tokens, n)
            pg = pages[win_start]
            if pg.swa is None and pg.index > 0:
                tree.split(pg.node, pg.index)
        lock = tree.lock(node, swa=False)
        pages = tree.walk(tokens, n)
        nodes = _path_nodes(pages)
        self._pinned = set(nodes)
        try:
            ok = self._load(nodes, pages, win_start)
        finally:
            self._pinned = set()
        if not ok:
            tree.unlock(lock)
            self._suspects.update(nodes)
            self._reap()
            return None
        if tree.has_swa:
            tree.lock_swa(lock)
        tree.touch(node)
        for x in nodes:
            x.hits += 1
            if self.write_policy == "second_hit" and x.hits >= 2 and self.has_host and x.host_full is None:
                self._backup(x)
        self._reap()
        pages = tree.walk(tokens, n)
        return Acquired(
            lock,
            n * P,
            (n - dev) * P,
            [p.full for p in pages],  # type: ignore[misc]
            [p.swa if i >= win_start else None for i, p in enumerate(pages)],
            diverge,
        )

    def _observe(self, tokens: list[int], max_pages: int, pages: list, hit: int, use_host: bool) -> None:
        """Ghost gains of one lookup (``AdaptiveSplit``) move the device and host targets."""
        split = self.split
        assert split is not None
        gs = split.swa_gain(pages, hit, use_host) if self.tree.has_swa and self.tree.window else 0
        full_ok = all(pg.full is not None or (use_host and pg.host_full is not None) for pg in pages)
        gf = split.full_gain(tokens, pages, max_pages) if full_ok else 0
        split.update(gs, gf)
        if self.host_split is not None:
            self.host_split.update(gs, gf)

    def _lost_pages(self, y: RadixNode, nbytes: int, end_hit: bool = True) -> None:
        """``y`` leaves the tree with no copy anywhere: its pages become full ghosts (``end_hit``:
        a hit could end at its end)."""
        if self.split is not None:
            self.split.lost_pages(node_page_hashes(y, self.page_size), nbytes, end_hit)

    def _load(self, nodes: list[RadixNode], pages: list, win_start: int) -> bool:
        """Bring the host-resident full KV of ``nodes`` and the SWA KV of the window back to device."""
        P_full = [x for x in nodes if x.full is None]
        first_win = {pg.node for pg in pages[win_start:]} if self.tree.has_swa else set()
        P_swa = [x for x in nodes if x in first_win and x.swa is None]
        need_full = sum(len(x.key) for x in P_full) // self.page_size
        need_swa = sum(len(x.key) for x in P_swa) // self.page_size
        if self.full_pool.budget is not None:
            swa_bytes = need_swa * self.swa_pool.page_bytes if self.swa_pool is not None else 0
            if not self.make_room_bytes(need_full * self.full_pool.page_bytes + swa_bytes):
                return False
        elif not self.make_room(FULL, need_full) or not self.make_room(SWA, need_swa):
            return False
        for x in P_full:
            assert x.host_full is not None
            dev = self.full_pool.allocate(len(x.host_full))
            assert dev is not None
            self.mover.to_device(FULL, x.host_full, dev)
            x.full = dev
            self.tree.dev_lru[x] = None
            self.stats.loaded_pages += len(dev)
        for x in P_swa:
            assert x.host_swa is not None and self.swa_pool is not None
            host = [p for p in x.host_swa if p is not None]
            if len(host) != len(x.host_swa):
                raise RuntimeError(f"window node {x} lacks host SWA pages (internal error)")
            dev = self.swa_pool.allocate(len(host))
            assert dev is not None
            self.mover.to_device(SWA, host, dev)
            x.swa = dev
            self.stats.loaded_pages += len(dev)
        for x in P_full + P_swa:
            self.tree.requeue(x, x.parent)
        return True

    def record(self, prompt_tokens: int, acq: Acquired, l3_tokens: int = 0) -> None:
        """Count one admitted request's lookup in ``stats`` (tokens); ``l3_tokens`` of its host
        hit came from L3 for it."""
        l3 = min(l3_tokens, acq.host_tokens)
        self.stats.queries += prompt_tokens
        self.stats.hits_device += acq.length - acq.host_tokens
        self.stats.hits_host += acq.host_tokens - l3
        self.stats.hits_l3 += l3

    def release(self, lock: CacheLock | None) -> None:
        """Drop a request's locks; a node left as an unlocked tombstone leaf is evicted."""
        if lock is None:
            return
        self.tree.unlock(lock)
        self._suspects.add(lock.node)
        self._reap()

    def _dead_leaf(self, x: RadixNode) -> bool:
        """An unlocked SWA-tombstone leaf on device: no hit can ever end in or pass through it."""
        tree = self.tree
        return (
            tree.window is not None
            and tree.has_swa
            and x.parent is not None
            and x is not tree.root
            and x.full is not None
            and x.swa is None
            and x.lock == 0
            and x not in self._pinned
            and not x.children
        )

    def _reap(self) -> None:
        """Evict every suspect that turned out to be a dead leaf (and, in turn, its parent)."""
        while self._suspects:
            x = self._suspects.pop()
            if self._dead_leaf(x):
                self._evict_device(x)

    # -- device eviction --------------------------------------------------------------------------
    def make_room(self, kind: str, n: int) -> bool:
        """Evict unlocked cache pages until ``n`` pages of ``kind`` are available (free and not
        reserved) on device. Returns whether that was reached."""
        pool = self.full_pool if kind == FULL else self.swa_pool
        if n <= 0:
            return True
        if pool is None:
            return False
        if pool.num_available < n:
            self.mover.sync()  # no page freed below may still be the target of a host load
            if pool.budget is not None:
                self._evict_shared(n * pool.page_bytes)
            else:
                self.evict(kind, n - pool.num_available)
        return pool.num_available >= n

    def make_room_bytes(self, need: int) -> bool:
        """Shared budget: evict until ``need`` bytes are available (free and not promised)."""
        budget = self.full_pool.budget
        assert budget is not None, "make_room_bytes needs pools on a shared budget"
        if budget.available < need:
            self.mover.sync()  # freed units may go to the other kind: no load may still land there
            self._evict_shared(need)
        return budget.available >= need

    def _evict_shared(self, need: int) -> None:
        """Evict until ``need`` bytes of the shared budget are available: from the side over the
        adaptive target first (``AdaptiveSplit.swa_first``: SWA stages, else least-recently-used
        leaves), from the other side when the first has no victim."""
        split, swa, budget = self.split, self.swa_pool, self.full_pool.budget
        assert budget is not None
        has_stages = swa is not None and self.tree.window is not None and self.tree.has_swa

        def swa_over() -> bool:  # without a split (full layout): least recently used leaves only
            return has_stages and split is not None and split.swa_first(swa.num_used * swa.page_bytes)  # type: ignore[union-attr]

        def done() -> bool:
            return budget.available >= need

        while not done():
            # trims first: SWA inside nodes, before their trailing window, serves only hits that
            # end there (rare: prefills stop at divergence points); then the split decides
            progress = has_stages and self._evict_swa(done, (TRIM_INNER, TRIM_LEAF))
            if done():
                break
            over = swa_over()
            progress = over and self._evict_swa(lambda: done() or not swa_over(), (INNER,))
            if not progress:
                victims = self._device_leaves(None, need - budget.available)
                for x in victims:
                    self._evict_device(x)
                progress = bool(victims)
            if not progress and has_stages and not over:
                progress = self._evict_swa(done, (INNER,))
            self._reap()
            if not progress:
                break
        self._reap()  # the trims' host backups may have detached host-only children

    def evict(self, kind: str, n: int) -> int:
        """Free at least ``n`` device pages of ``kind`` if possible; returns pages of it freed."""
        pool = self.full_pool if kind == FULL else self.swa_pool
        assert pool is not None
        before = pool.num_free
        progress = True
        while progress and pool.num_free - before < n:
            progress = False
            if kind == SWA and self.tree.window is not None:
                progress = self._evict_swa(lambda: pool.num_free >= before + n)
            victims = self._device_leaves(kind, n - (pool.num_free - before))
            for x in victims:
                self._evict_device(x)
            progress = progress or bool(victims)
            self._reap()
        return pool.num_free - before

    def _device_leaves(self, kind: str | None, n: int) -> list[RadixNode]:
        """Unlocked device leaves holding ``n`` pages of ``kind`` (None: ``n`` bytes of both
        kinds), least recently used first (fewer if there are not enough). A parent precedes none of its children in the LRU, so a parent
        these leaves leave bare is found by the next call."""
        out: list[RadixNode] = []
        got = 0
        for x in self.tree.dev_lru:
            if got >= n:
                break
            if x.full is None or x.lock or x in self._pinned or x.has_device_child():
                continue
            pages = x.full if kind in (FULL, None) else x.swa
            if not pages:
                continue  # frees no page of this kind
            out.append(x)
            if kind is None:
                got += len(pages) * self.full_pool.page_bytes
                got += len(x.swa or []) * (self.swa_pool.page_bytes if self.swa_pool is not None else 0)
            else:
                got += len(pages)
        return out

    def _evict_swa(
        self, done: Callable[[], bool], stages: tuple[str, ...] = (TRIM_INNER, TRIM_LEAF, INNER)
    ) -> bool:
        """SWA-only eviction, least recently used first within each stage, until ``done()``:
        1. trim inner nodes: tombstone all but their trailing window (a hit can end at a branch
           point, which needs only that window); 2. trim leaves likewise; 3. tombstone inner nodes,
        keeping the trailing pages that live children shorter than the window need for a hit at
        their own end. Leaves are evicted whole afterwards by the caller. Returns whether anything
        was freed. Each stage pops its own LRU heap (``RadixTree.swa_order``)."""
        tree = self.tree
        wp = tree.window_pages()
        assert wp is not None
        freed = False
        for stage in stages:
            skipped: list[RadixNode] = []
            while not done():
                x = tree.swa_order.pop(stage)
                if x is None:
                    break
                assert isinstance(x, RadixNode) and x.swa is not None
                if tree.swa_category(x) != stage:  # defensive: a category hook was missed
                    tree.requeue(x)
                    continue
                if x.swa_lock or x in self._pinned:
                    skipped.append(x)
                    continue
                if stage == INNER:
                    # keep what live children shorter than the window need for a hit at their end
                    keep = tree.window_keep(x)
                    self._tombstone(tree.split(x, len(x.swa) - keep) if keep else x)
                else:
                    self._trim(x)
                tree.requeue(x)
                freed = True
            tree.requeue(*skipped)
        return freed

    def _trim(self, x: RadixNode) -> None:
        """Tombstone ``x``'s SWA KV but for its trailing window (a hit ending at ``x``'s end, e.g.
        at a branch point or a prompt's end, needs only that)."""
        wp = self.tree.window_pages()
        assert x.swa is not None and wp is not None
        self._tombstone(self.tree.split(x, len(x.swa) - wp), ghost=False)

    def _tombstone(self, x: RadixNode, ghost: bool = True) -> None:
        """Free ``x``'s device SWA KV; ``ghost``: a window a hit could end at was lost (not a trim)."""
        assert x.swa is not None and self.swa_pool is not None
        if self.write_policy == "on_evict" and self.has_host:
            self._backup(x)  # its trailing SWA (and full KV) stay reachable from the host tier
        if ghost and self.split is not None and (x.host_swa is None or None in x.host_swa):
            self.split.lost_window(x, len(x.swa))
        self.swa_pool.free(x.swa)
        x.swa = None
        self.tree.requeue(x, x.parent)

    def _evict_device(self, x: RadixNode) -> None:
        """Move a device leaf off the device (to host if it has a copy there, else delete it)."""
        tree = self.tree
        assert x.full is not None and not x.has_device_child() and x.lock == 0
        if self.has_host and self.write_policy == "on_evict":
            if x.host_full is None:
                self._backup(x)
            elif x.swa is not None:
                self._backup_swa(x)
        nbytes = len(x.full) * self.full_pool.page_bytes
        hittable = x.swa is not None or not self.tree.has_swa or self.tree.window is None
        self.full_pool.free(x.full)
        x.full = None
        del tree.dev_lru[x]
        if x.swa is not None:
            assert self.swa_pool is not None
            nbytes += len(x.swa) * self.swa_pool.page_bytes
            self.swa_pool.free(x.swa)
            x.swa = None
        parent = x.parent
        tree.requeue(x, parent)
        if x.host_full is None:
            self._lost_pages(x, nbytes, hittable)  # a tombstoned window: no hit could end at it
            self._delete_subtree(x)
        assert parent is not None
        self._suspects.add(parent)  # no tombstone may be left as a leaf (see _reap)

    def _delete_subtree(self, x: RadixNode) -> None:
        """Remove ``x`` (off device) and its descendants (all off device) from the tree."""
        stack, doomed = [x], []
        while stack:
            y = stack.pop()
            doomed.append(y)
            stack.extend(y.children.values())
        self.mover.sync()
        for y in doomed:
            assert y.full is None and y.swa is None and y.lock == 0
            self._drop_host(y)
        self._detach(x)

    # -- whole-cache operations -------------------------------------------------------------------
    def flush(self) -> None:
        """Drop every unlocked cached page, device and host."""
        self.evict(FULL, self.full_pool.num_pages)
        if self.swa_pool is not None:
            self.evict(SWA, self.swa_pool.num_pages)
        self.mover.sync()
        for y in sorted(self.tree.nodes(), key=lambda n: -_depth(n)):
            if y.parent is None:
                continue  # already deleted with an ancestor
            if y.full is None and not y.children and y.lock == 0:
                self._drop_host(y)  # first: the L3 sink reads y's path
                self._detach(y)
            elif y.full is not None:
                self._drop_host(y)
        self._reap()

    def cached_pages(self) -> dict[str, int]:
        """Pages the tree holds per tier pool: full, swa, host_full, host_swa."""
        out = {"full": 0, "swa": 0, "host_full": 0, "host_swa": 0}
        for x in self.tree.nodes():
            out["full"] += len(x.full or [])
            out["swa"] += len(x.swa or [])
            out["host_full"] += len(x.host_full or [])
            out["host_swa"] += sum(p is not None for p in x.host_swa or [])
        return out


def _path_nodes(pages: list) -> list[RadixNode]:
    out: list[RadixNode] = []
    for pg in pages:
        if not out or out[-1] is not pg.node:
            out.append(pg.node)
    return out


def _depth(x: RadixNode) -> int:
    d = 0
    while x.parent is not None:
        d, x = d + 1, x.parent
    return d
