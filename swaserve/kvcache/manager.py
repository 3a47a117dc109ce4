"""Per-attention-kind KV page managers and the two-pool ``KVCacheManager``.

Full-attention layers keep every token's KV: a request's page table grows with its length.
Sliding-window layers only need the last ``window`` tokens before each query: a request holds the
pages covering ``[start - window, end)`` of the chunk being computed, and pages wholly before
``start - window`` go back to the pool when the next chunk is allocated — after the previous step
has finished, so no page a step in flight reads is ever recycled. ::

    positions   0 ... 15 | 16 ... 31 | 32 ... 47 | 48 ... 63 |      (page_size 16, window 20)
    chunk [50, 60):  SWA keys needed from 30  ->  page 0 freed, pages 1..3 held
    full pool:                                    pages 0..3 held

Admission reserves, in each pool, the most pages the request can hold at once that it must be
guaranteed (full: prompt + max_tokens; SWA: window + one token, i.e. ceil(window / page) + 2),
so a running request never fails for lack of pages. Prefill chunks bigger than that draw on
unreserved free pages; the scheduler sizes chunks with ``max_chunk``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from swaserve.config import FULL, SWA
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.host import PageMover
from swaserve.kvcache.plan import PoolPlan, cdiv
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.prefix_cache import Acquired, PrefixCache, WritePolicy
from swaserve.kvcache.radix import CacheLock
from swaserve.kvcache.stats import PoolStats


@dataclass
class PageTable:
    """A request's pages in one pool: ``pages[i]`` holds logical page ``base + i``."""

    base: int = 0
    pages: list[int] = field(default_factory=list)
    guarantee: int = 0  # pages this request is promised it can hold at once
    reserved: int = 0  # part of the guarantee not allocated yet (held in the pool's reservation)
    slot_cache: torch.Tensor | None = None  # slots of every held position, rebuilt when pages change
    shared_end: int = 0  # logical pages below this belong to the prefix cache (locked, never freed here)

    @property
    def end_page(self) -> int:
        return self.base + len(self.pages)

    def private(self) -> list[int]:
        """Pages this request owns (logical >= shared_end)."""
        return self.pages[max(0, self.shared_end - self.base) :]


class KindManager:
    """Page tables of one attention kind over one ``PagePool``.

    Args:
        pool: the page pool. page_size: tokens per page.
        window: previous tokens each query sees (None = full attention, keep everything).
    """

    def __init__(self, pool: PagePool, page_size: int, window: int | None) -> None:
        self.pool = pool
        self.page_size = page_size
        self.window = window
        self.tables: dict[str, PageTable] = {}
        self.keep_boundary_window = False  # set when a prefix cache will take the request's pages

    def guarantee_for(self, max_total_tokens: int, cached_pages: int = 0) -> int:
        """Own pages a request must be sure to get (``cached_pages`` come from the prefix cache)."""
        total = cdiv(max_total_tokens, self.page_size)
        if self.window is None:
            return total - cached_pages
        return min(total, cdiv(self.window, self.page_size) + 2)

    def can_admit(self, max_total_tokens: int) -> bool:
        return self.pool.can_reserve(self.guarantee_for(max_total_tokens))

    def admit(
        self, rid: str, max_total_tokens: int, base: int = 0, shared: list[int] | None = None, cached: int = 0
    ) -> bool:
        """Reserve the request's guarantee; its table starts with the cache's ``shared`` pages
        (logical ``base ..``, ending at logical page ``cached``)."""
        if rid in self.tables:
            raise ValueError(f"request {rid} already admitted")
        g = self.guarantee_for(max_total_tokens, cached)
        if not self.pool.reserve(g):
            return False
        self.tables[rid] = PageTable(
            base=base, pages=list(shared or []), guarantee=g, reserved=g, shared_end=cached
        )
        return True

    def first_needed_page(self, start: int) -> int:
        """Lowest logical page a chunk starting at ``start`` reads (with ``keep_boundary_window``:
        or that the last page boundary ``b <= start`` needs, so the request can still be cached
        window-safely up to ``b``; at most one more page, within the guarantee)."""
        if self.window is None:
            return 0
        if self.keep_boundary_window:
            start = start // self.page_size * self.page_size
        return max(0, start - self.window) // self.page_size

    def pages_to_add(self, rid: str, start: int, end: int) -> tuple[int, int]:
        """(pages that would be freed, pages that must be allocated) for chunk [start, end)."""
        t = self.tables[rid]
        freed = max(0, min(self.first_needed_page(start), t.end_page) - t.base)
        new = max(0, cdiv(end, self.page_size) - t.end_page)
        return freed, new

    def allocate(self, rid: str, start: int, end: int) -> bool:
        """Free pages before the window of chunk [start, end) and add pages up to ``end``.

        Returns False (nothing allocated, but out-of-window pages may have been freed) if the pool
        has no room for the pages beyond the request's guarantee.
        """
        t = self.tables[rid]
        first = self.first_needed_page(start)
        if first > t.base:
            k = min(first, t.end_page) - t.base
            dropped, t.pages = t.pages[:k], t.pages[k:]
            own = max(0, t.shared_end - t.base)  # dropped[:own] belong to the prefix cache
            t.base = t.base + k if t.pages else first
            self.pool.free(dropped[own:])
            t.slot_cache = None
            self._rebalance(t)
        new = cdiv(end, self.page_size) - t.end_page
        if new <= 0:
            return True
        from_res = min(new, t.reserved)
        pages = self.pool.allocate(new, from_reserved=from_res)
        if pages is None:
            return False
        t.reserved -= from_res
        t.pages.extend(pages)
        t.slot_cache = None
        return True

    def _rebalance(self, t: PageTable) -> None:
        """After freeing, top the reservation back up to the guarantee."""
        want = max(0, t.guarantee - len(t.private()))
        if want > t.reserved:
            if not self.pool.reserve(want - t.reserved):  # cannot fail: the freed pages are free
                raise RuntimeError("reservation invariant broken")
            t.reserved = want

    def free(self, rid: str) -> None:
        t = self.tables.pop(rid, None)
        if t is None:
            return
        self.pool.free(t.private())
        self.pool.unreserve(t.reserved)

    def slots(self, rid: str, lo: int, end: int) -> torch.Tensor:
        """Pool slots [end - lo] int64 of positions ``lo .. end-1`` (all within held pages)."""
        t = self.tables[rid]
        first = t.base * self.page_size
        if lo < first or end > t.end_page * self.page_size or lo > end:
            raise RuntimeError(f"request {rid}: positions [{lo}, {end}) outside held pages (internal error)")
        if t.slot_cache is None:
            pages = torch.tensor(t.pages, dtype=torch.int64)
            t.slot_cache = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        return t.slot_cache[lo - first : end - first]

    def held(self, rid: str) -> int:
        return len(self.tables[rid].pages)


class KVCacheManager:
    """The two pools (full, SWA), their page tables and the prefix cache, managed together.

    Args:
        plan: pool sizes and per-page bytes.
        page_size: tokens per page.
        window: previous tokens a SWA query sees.
        layout: "hybrid" frees SWA pages outside the window; "full" keeps them (SWA-unaware baseline).
        num_full_layers, num_swa_layers: for accounting only.
        prefix_caching: keep finished requests' KV in a ``PrefixCache`` and reuse it.
        host_pages: (full, swa) pages of the host tier; None = no host tier.
        mover: copies pages between device and host (``HostKVStorage``; default: accounting only).
        write_policy: when pages get a host copy ("on_evict" | "second_hit").
    """

    def __init__(
        self,
        plan: PoolPlan,
        page_size: int,
        window: int,
        layout: str,
        num_full_layers: int,
        num_swa_layers: int,
        prefix_caching: bool = False,
        host_pages: tuple[int, int] | None = None,
        mover: PageMover | None = None,
        write_policy: WritePolicy = "on_evict",
    ) -> None:
        if layout not in ("hybrid", "full"):
            raise ValueError(f"kv layout must be 'hybrid' or 'full', got {layout!r}")
        self.plan, self.page_size, self.window, self.layout = plan, page_size, window, layout
        self.full = KindManager(
            PagePool(plan.full_pages, plan.full_page_bytes, num_full_layers), page_size, None
        )
        self.swa = KindManager(
            PagePool(plan.swa_pages, plan.swa_page_bytes, num_swa_layers),
            page_size,
            window if layout == "hybrid" else None,
        )
        self.has_swa = num_swa_layers > 0
        self.cache: PrefixCache | None = None
        if prefix_caching:
            host_full = host_swa = None
            if host_pages is not None:
                host_full = PagePool(host_pages[0], plan.full_page_bytes, num_full_layers)
                host_swa = PagePool(max(1, host_pages[1]), plan.swa_page_bytes, num_swa_layers)
            self.cache = PrefixCache(
                page_size,
                self.swa.window,
                self.full.pool,
                self.swa.pool if self.has_swa else None,
                host_full,
                host_swa if self.has_swa else None,
                mover,
                write_policy,
            )
            self.swa.keep_boundary_window = True
        self.locks: dict[str, CacheLock | None] = {}
        self.hits: dict[str, tuple[int, int]] = {}  # rid -> (cached tokens, of which from host)
        self.diverge: dict[str, int] = {}  # rid -> where its prompt leaves the tree, past its hit

    def _kinds(self) -> list[KindManager]:
        return [self.full, self.swa] if self.has_swa else [self.full]

    def fits_ever(self, max_total_tokens: int) -> bool:
        """Could this request be admitted into empty pools?"""
        return all(k.guarantee_for(max_total_tokens) <= k.pool.num_pages for k in self._kinds())

    def can_admit(self, max_total_tokens: int) -> bool:
        return all(k.can_admit(max_total_tokens) for k in self._kinds())

    def admit(self, rid: str, max_total_tokens: int, prompt: list[int] | None = None) -> bool:
        """Reserve the request's guaranteed pages in both pools, or nothing.

        With a prefix cache and ``prompt``, the longest window-safe cached prefix (page-aligned, at
        most ``len(prompt) - 1`` tokens) is locked and becomes the start of the request's page
        tables; ``hit_tokens(rid)`` says how long it is. Cache pages are evicted to make room.
        """
        P = self.page_size
        acq: Acquired | None = None
        if self.cache is not None and prompt:
            limit = (len(prompt) - 1) // P * P
            acq = self.cache.acquire(prompt, limit) or self.cache.acquire(prompt, limit, use_host=False)
            assert acq is not None  # without host loads nothing can fail
        n = acq.length // P if acq is not None else 0
        gs = [k.guarantee_for(max_total_tokens, n) for k in self._kinds()]
        if self.cache is not None:
            for k, g in zip(self._kinds(), gs, strict=True):
                self.cache.make_room(FULL if k is self.full else SWA, g)
        if not all(k.pool.can_reserve(g) for k, g in zip(self._kinds(), gs, strict=True)):
            if acq is not None and self.cache is not None:
                self.cache.release(acq.lock)
            return False
        if acq is None or n == 0:
            for k in self._kinds():
                k.admit(rid, max_total_tokens)
        else:
            assert self.cache is not None
            self.full.admit(rid, max_total_tokens, 0, acq.full, n)
            if self.has_swa:
                base = self.swa.first_needed_page(acq.length)
                shared = acq.swa[base:]
                if any(p is None for p in shared):
                    raise RuntimeError("prefix hit without live SWA in its window (internal error)")
                self.swa.admit(rid, max_total_tokens, base, shared, n)  # type: ignore[arg-type]
        if acq is not None and self.cache is not None:
            self.cache.record(len(prompt or []), acq)
        self.locks[rid] = acq.lock if acq is not None else None
        self.hits[rid] = (acq.length, acq.host_tokens) if acq is not None else (0, 0)
        if acq is not None and acq.diverge > acq.length and self.swa.window is not None and self.has_swa:
            self.diverge[rid] = acq.diverge
        return True

    def hit_tokens(self, rid: str) -> int:
        """Prompt tokens the request reuses from the prefix cache (0 if none or not admitted)."""
        return self.hits.get(rid, (0, 0))[0]

    def max_chunk(self, rid: str, start: int, end: int) -> int:
        """Largest n <= end - start such that chunk [start, start + n) can be allocated now
        (evicting unlocked cache pages if that makes the whole chunk fit).

        A chunk also ends where the prompt leaves the cached tree without a SWA window there
        (``diverge``): ``cache_partial`` after it keeps that window, so the next prompt branching
        at the same point gets a window-safe hit (a branch point found by traffic, not guessed).
        """
        d = self.diverge.get(rid, 0)
        if start < d < end:
            end = d
        if self.cache is not None:
            for k in self._kinds():
                t = k.tables[rid]
                _, new = k.pages_to_add(rid, start, end)
                if new > t.reserved:
                    self.cache.make_room(FULL if k is self.full else SWA, new - t.reserved)
        lo, hi = 0, end - start
        if all(self._fits(k, rid, start, end) for k in self._kinds()):
            return hi  # the common case: the whole chunk fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if all(self._fits(k, rid, start, start + mid) for k in self._kinds()):
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _fits(k: KindManager, rid: str, start: int, end: int) -> bool:
        t = k.tables[rid]
        freed, new = k.pages_to_add(rid, start, end)
        freed = max(0, freed - max(0, t.shared_end - t.base))  # cache pages leave without freeing
        held = len(t.private()) - freed
        reserved_after = max(t.reserved, t.guarantee - held)  # reservation after rebalance
        extra_available = k.pool.num_available + freed - (reserved_after - t.reserved)
        return new <= reserved_after + max(0, extra_available)

    def allocate(self, rid: str, start: int, end: int) -> bool:
        ok = all(k.allocate(rid, start, end) for k in self._kinds())
        lock = self.locks.get(rid)
        if ok and lock is not None and lock.swa_nodes and self.cache is not None:
            t = self.swa.tables[rid]
            if self.swa.window is not None and t.base >= t.shared_end:
                self.cache.tree.unlock_swa(lock)  # the window has moved past the cached prefix
        return ok

    def cache_partial(self, rid: str, tokens: list[int]) -> bool:
        """Chunked prefill: insert the request's computed prefix ``tokens`` (its whole pages) into
        the prefix cache while it keeps running, with the SWA KV it already freed marked as such.

        Skipped (False) when there is no new whole page, the SWA of the new prefix end is no
        longer held, or the SWA pool cannot top the request's reservation back up.
        """
        if self.cache is None:
            return False
        P = self.page_size
        K = len(tokens) // P
        ft = self.full.tables[rid]
        if ft.shared_end >= K:
            return False
        swa_list: list[int | None] = [None] * K
        moved_swa = 0
        if self.has_swa:
            st = self.swa.tables[rid]
            win_first = self.swa.first_needed_page(K * P)
            if st.base > win_first or st.end_page < K:
                return False
            for i in range(st.base, K):
                swa_list[i] = st.pages[i - st.base]
            moved_swa = K - max(st.base, st.shared_end)
            if self.swa.window is not None and not self.cache.make_room(SWA, moved_swa):
                return False
        self._insert(rid, tokens[: K * P], ft.pages[:K], swa_list, keep=True, tokens_done=len(tokens))
        return True

    def _insert(
        self,
        rid: str,
        tokens: list[int],
        full: list[int],
        swa: list[int | None],
        keep: bool,
        tokens_done: int = 0,
    ) -> None:
        """Give the request's pages for ``tokens`` to the tree; with ``keep`` the request goes on
        with the tree's pages and a lock on the new path."""
        assert self.cache is not None
        K = len(full)
        ft = self.full.tables[rid]
        lock = self.locks.get(rid)
        shared = ft.shared_end
        after = (lock.node, shared) if lock is not None and shared > 0 else None
        if after is None:
            shared = 0
        node, tree_full, tree_swa = self.cache.tree.insert(tokens, full, swa, after)
        if not keep:
            return
        new_lock = self.cache.tree.lock(node)
        self.cache.release(lock)
        self.locks[rid] = new_lock
        ft.guarantee -= K - ft.shared_end
        ft.pages[shared:K] = tree_full
        ft.shared_end = K
        ft.slot_cache = None
        if self.has_swa:
            st = self.swa.tables[rid]
            for i in range(max(st.base, shared), K):
                page = tree_swa[i - shared]
                assert page is not None, "window page of a cached prefix is a tombstone"
                st.pages[i - st.base] = page
            if self.swa.window is None:
                st.guarantee -= K - st.shared_end
            st.shared_end = K
            # cache pages before the next chunk's window leave the table now: the new lock does
            # not cover them, so the tree may evict them
            first = min(self.swa.first_needed_page(tokens_done), K)
            if first > st.base:
                st.pages = st.pages[first - st.base :]
                st.base = first
            st.slot_cache = None
            self.swa._rebalance(st)

    def free(self, rid: str, tokens: list[int] | None = None) -> None:
        """Release a request (finished or aborted). With a prefix cache and ``tokens`` (the tokens
        whose KV it computed), its whole pages go into the tree; the rest go back to the pools."""
        P = self.page_size
        if self.cache is not None and tokens and rid in self.full.tables:
            K = len(tokens) // P
            ft = self.full.tables[rid]
            if self.has_swa and self.swa.window is not None:
                st = self.swa.tables[rid]
                if st.base > self.swa.first_needed_page(K * P) or st.end_page < K:
                    K = 0  # the window before K is gone: no window-safe point to cache (defensive)
            if ft.shared_end < K:
                swa_list: list[int | None] = [None] * K
                if self.has_swa:
                    st = self.swa.tables[rid]
                    for i in range(st.base, min(K, st.end_page)):
                        swa_list[i] = st.pages[i - st.base]
                self._insert(rid, tokens[: K * P], ft.pages[:K], swa_list, keep=False)
                # pages [shared_end, K) now belong to the tree (adopted, or freed as duplicates)
                ft.pages = ft.pages[:0] + ft.pages[K:]
                ft.base, ft.shared_end = K, K
                if self.has_swa:
                    st = self.swa.tables[rid]
                    cut = max(0, min(K, st.end_page) - st.base)
                    st.pages = st.pages[cut:]
                    st.base = st.base + cut
                    st.shared_end = st.base
        for k in (self.full, self.swa):
            k.free(rid)
        if self.cache is not None:
            self.cache.release(self.locks.pop(rid, None))
        self.hits.pop(rid, None)
        self.diverge.pop(rid, None)

    def enable_cache_events(self, block_tokens: int) -> None:
        """Log the prefix cache's stored / removed blocks of ``block_tokens`` tokens
        (``kvcache.block_events``). Raises ValueError without a prefix cache or unless
        ``block_tokens`` is a multiple of the page size."""
        if self.cache is None:
            raise ValueError("cache events need prefix caching")
        self.cache.enable_events(block_tokens)

    def drain_cache_events(self, now: float | None = None, resync: bool = False) -> list[BlockEvent]:
        """The prefix cache's block events since the last drain, oldest first (empty if off).
        ``now``: the caller's clock in seconds (``BlockEventLog.drain``; None keeps the log's).
        ``resync``: a snapshot of the whole cache instead (``BlockEventLog.snapshot``)."""
        if self.cache is None or self.cache.events is None:
            return []
        log = self.cache.events
        return log.snapshot(self.cache.tree.root, now) if resync else log.drain(now)

    def flush_cache(self) -> None:
        """Drop every unlocked page the prefix cache holds (device and host)."""
        if self.cache is not None:
            self.cache.flush()

    def stats(self) -> dict[str, PoolStats]:
        out = {"full": self.full.pool.stats(), "swa": self.swa.pool.stats()}
        if self.cache is not None:
            cached = self.cached_pages()
            for name in out:
                out[name] = dataclasses.replace(out[name], cached_pages=cached[name])
        return out

    def cached_pages(self) -> dict[str, int]:
        """Pages the prefix cache holds per pool (full, swa, host_full, host_swa), from the pools'
        counts minus the requests' own pages: O(requests), cheap enough for every scrape."""
        out = {
            "full": self.full.pool.num_used - sum(len(t.private()) for t in self.full.tables.values()),
            "swa": self.swa.pool.num_used - sum(len(t.private()) for t in self.swa.tables.values()),
            "host_full": 0,
            "host_swa": 0,
        }
        if self.cache is not None and self.cache.host_full is not None:
            out["host_full"] = self.cache.host_full.num_used
            out["host_swa"] = self.cache.host_swa.num_used if self.cache.host_swa is not None else 0
        return out

    def held_bytes(self, rid: str) -> int:
        """Bytes of KV a request holds right now, both pools (cache pages it shares included)."""
        total = self.full.held(rid) * self.plan.full_page_bytes
        if self.has_swa:
            total += self.swa.held(rid) * self.plan.swa_page_bytes
        return total
