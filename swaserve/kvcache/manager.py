"""``KVCacheManager``: the full and SWA pools, a ``KindManager`` each (``kvcache.kind``), and the
prefix cache, managed together.

Admission (``admit`` -> one ``Admission`` per request, or None: no room now) reserves, in each
pool, the most pages the request can hold at once that it must be guaranteed (full: prompt +
max_tokens; SWA: window + one token, i.e. ceil(window / page) + 2), so a running request never
fails for lack of pages. Prefill chunks bigger than that draw on unreserved free pages; the
scheduler sizes chunks with ``max_chunk``. With a shared plan (``PoolPlan.shared_bytes``) both pools
draw from one ``ByteBudget`` and the prefix cache's ``AdaptiveSplit`` decides what it evicts; the
checks above then add both kinds' bytes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from swaserve.config import FULL, SWA
from swaserve.kvcache.adaptive import AdaptiveSplit
from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.budget import ByteBudget
from swaserve.kvcache.kind import FullAttentionManager, KindManager, SlidingWindowManager
from swaserve.kvcache.mover import PageMover
from swaserve.kvcache.plan import PoolPlan, cdiv
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.prefix_cache import Acquired, PrefixCache, WritePolicy
from swaserve.kvcache.radix import CacheLock
from swaserve.kvcache.stats import PoolStats


@dataclass(slots=True)
class Admission:
    """What an admitted request got (``KVCacheManager.admit``); one record per admitted request.

    Attributes:
        hit_tokens: prompt tokens whose KV the prefix cache gave it (page-aligned; 0: none).
        host_tokens: of ``hit_tokens``, those loaded from the host tier.
        diverge: where its prompt leaves the cached tree past the hit without a SWA window there
            (its first chunk ends there, see ``max_chunk``); None: nowhere worth a stop.
        lock: its hold on the prefix cache (None: none); replaced when its own prefix is inserted.
    """

    hit_tokens: int = 0
    host_tokens: int = 0
    diverge: int | None = None
    lock: CacheLock | None = None


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
        host_bytes: with a shared plan, the host tier's byte budget, shared by its two pools
            (``host_pages`` then ignored); None = ``host_pages`` as given.
        lookahead: tokens a speculative decode step holds past its new token (SWA guarantee).
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
        host_bytes: int | None = None,
        lookahead: int = 0,
    ) -> None:
        if layout not in ("hybrid", "full"):
            raise ValueError(f"kv layout must be 'hybrid' or 'full', got {layout!r}")
        self.plan, self.page_size, self.window, self.layout = plan, page_size, window, layout
        shared, unit = plan.shared_bytes, plan.unit_bytes
        self.budget = ByteBudget(shared, unit) if shared is not None else None
        self.full: KindManager = FullAttentionManager(
            PagePool(plan.full_pages, plan.full_page_bytes, num_full_layers, self.budget), page_size
        )
        swa_pool = PagePool(plan.swa_pages, plan.swa_page_bytes, num_swa_layers, self.budget)
        self.swa: KindManager = (
            SlidingWindowManager(
                swa_pool, page_size, window, keep_boundary_window=prefix_caching, lookahead=lookahead
            )
            if layout == "hybrid"
            else FullAttentionManager(swa_pool, page_size)  # the SWA-unaware baseline keeps every page
        )
        self.has_swa = num_swa_layers > 0
        self.cache: PrefixCache | None = None
        if prefix_caching:
            host_full = host_swa = None
            self.host_budget = None
            if self.budget is not None and host_bytes:
                self.host_budget = ByteBudget(host_bytes, unit)
                host_full = PagePool(1, plan.full_page_bytes, num_full_layers, self.host_budget)
                host_swa = PagePool(1, plan.swa_page_bytes, num_swa_layers, self.host_budget)
            elif host_pages is not None:
                host_full = PagePool(host_pages[0], plan.full_page_bytes, num_full_layers)
                host_swa = PagePool(max(1, host_pages[1]), plan.swa_page_bytes, num_swa_layers)
            split = host_split = None
            if self.budget is not None and self.has_swa and layout == "hybrid" and window:
                split = self._split(
                    self.budget.total, (self.budget.total + (host_bytes or 0)) / self.budget.total
                )
                if self.host_budget is not None:
                    host_split = self._split(self.host_budget.total, 1.0)
            self.cache = PrefixCache(
                page_size,
                self.swa.window,
                self.full.pool,
                self.swa.pool if self.has_swa else None,
                host_full,
                host_swa if self.has_swa else None,
                mover,
                write_policy,
                split,
                host_split,
            )
        self.admitted: dict[str, Admission] = {}  # rid -> what it got at admission

    def _split(self, total: int, horizon: float) -> AdaptiveSplit:
        """The adaptive split of ``total`` shared bytes (defaults: ``kvcache.adaptive``)."""
        pbf, pbs = self.plan.full_page_bytes, self.plan.swa_page_bytes
        return AdaptiveSplit(
            total, pbf, pbs, self.page_size, cdiv(self.window, self.page_size), horizon=horizon
        )

    def _kinds(self) -> list[KindManager]:
        return [self.full, self.swa] if self.has_swa else [self.full]

    def _bytes(self, pages: list[int]) -> int:
        """Bytes of ``pages[i]`` pages of kind ``_kinds()[i]``."""
        return sum(n * k.pool.page_bytes for k, n in zip(self._kinds(), pages, strict=True))

    def fits_ever(self, max_total_tokens: int) -> bool:
        """Could this request be admitted into empty pools?"""
        gs = [k.guarantee_for(max_total_tokens) for k in self._kinds()]
        if self.budget is not None:
            return self._bytes(gs) <= self.budget.total
        return all(g <= k.pool.num_pages for k, g in zip(self._kinds(), gs, strict=True))

    def can_admit(self, max_total_tokens: int) -> bool:
        if self.budget is not None:
            return (
                self._bytes([k.guarantee_for(max_total_tokens) for k in self._kinds()])
                <= self.budget.available
            )
        return all(k.can_admit(max_total_tokens) for k in self._kinds())

    def admit(
        self, rid: str, max_total_tokens: int, prompt: list[int] | None = None, l3_tokens: int = 0
    ) -> Admission | None:
        """Reserve the request's guaranteed pages in both pools, or nothing (None: no room now).
        ``l3_tokens``: tokens an L3 fetch put in the host tier for it (hit accounting).

        With a prefix cache and ``prompt``, the longest window-safe cached prefix (page-aligned, at
        most ``len(prompt) - 1`` tokens) is locked and becomes the start of the request's page
        tables; the ``Admission`` says how long it is. Cache pages are evicted to make room.
        """
        P = self.page_size
        acq: Acquired | None = None
        if self.cache is not None and prompt:
            limit = (len(prompt) - 1) // P * P
            acq = self.cache.acquire(prompt, limit) or self.cache.acquire(
                prompt, limit, use_host=False, observe=False
            )
            assert acq is not None  # without host loads nothing can fail
        n = acq.length // P if acq is not None else 0
        if not self._room_for(max_total_tokens, n):
            if acq is None or self.cache is None:
                return None
            # the hit's locked pages come on top of the guarantee (its window is not part of it):
            # a request that fits without the hit must not wait on its own hit forever
            self.cache.release(acq.lock)
            if n == 0 or not self._room_for(max_total_tokens, 0):
                return None
            acq, n = Acquired(None, 0, 0), 0  # admitted without its hit: queried, nothing reused
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
            self.cache.record(len(prompt or []), acq, l3_tokens)
        adm = Admission()
        if acq is not None:
            adm.hit_tokens, adm.host_tokens, adm.lock = acq.length, acq.host_tokens, acq.lock
            if acq.diverge > acq.length and self.swa.window is not None and self.has_swa:
                adm.diverge = acq.diverge
        self.admitted[rid] = adm
        return adm

    def _room_for(self, max_total_tokens: int, n: int) -> bool:
        """Evict cache pages until a request of ``max_total_tokens`` with ``n`` hit pages (already
        locked) can reserve its guarantee; whether it can."""
        gs = [k.guarantee_for(max_total_tokens, n) for k in self._kinds()]
        if self.cache is not None and self.budget is not None:
            self.cache.make_room_bytes(self._bytes(gs))
        elif self.cache is not None:
            for k, g in zip(self._kinds(), gs, strict=True):
                self.cache.make_room(FULL if k is self.full else SWA, g)
        if self.budget is not None:
            return self._bytes(gs) <= self.budget.available
        return all(k.pool.can_reserve(g) for k, g in zip(self._kinds(), gs, strict=True))

    def max_chunk(self, rid: str, start: int, end: int) -> int:
        """Largest n <= end - start such that chunk [start, start + n) can be allocated now
        (evicting unlocked cache pages if that makes the whole chunk fit).

        A chunk also ends where the prompt leaves the cached tree without a SWA window there
        (``diverge``): ``cache_partial`` after it keeps that window, so the next prompt branching
        at the same point gets a window-safe hit (a branch point found by traffic, not guessed).
        """
        d = self.admitted[rid].diverge or 0
        if start < d < end:
            end = d
        if self.cache is not None:
            extra = []
            for k in self._kinds():
                t = k.tables[rid]
                _, new = k.pages_to_add(rid, start, end)
                extra.append(max(0, new - t.reserved))
                if new > t.reserved and self.budget is None:
                    self.cache.make_room(FULL if k is self.full else SWA, new - t.reserved)
            if self.budget is not None and any(extra):
                self.cache.make_room_bytes(self._bytes(extra))
        lo, hi = 0, end - start
        if self._fits_all(rid, start, end):
            return hi  # the common case: the whole chunk fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits_all(rid, start, start + mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _fits_all(self, rid: str, start: int, end: int) -> bool:
        if self.budget is None:
            return all(self._fits(k, rid, start, end) for k in self._kinds())
        # one budget: the kinds allocate in order (full, then SWA, which may free first), so each
        # running sum of unreserved bytes taken must fit what the budget has available
        taken = 0
        for k in self._kinds():
            taken += self._cost(k, rid, start, end) * k.pool.page_bytes
            if taken > self.budget.available:
                return False
        return True

    @staticmethod
    def _chunk(k: KindManager, rid: str, start: int, end: int) -> tuple[int, int, int]:
        """(pages chunk [start, end) adds, pages it frees, reservation after the rebalance)."""
        t = k.tables[rid]
        freed, new = k.pages_to_add(rid, start, end)
        freed = max(0, freed - max(0, t.shared_end - t.base))  # cache pages leave without freeing
        held = len(t.private()) - freed
        return new, freed, max(t.reserved, t.guarantee - held)

    @classmethod
    def _cost(cls, k: KindManager, rid: str, start: int, end: int) -> int:
        """Unpromised pages of ``k``'s pool chunk [start, end) takes, net of the pages it frees."""
        new, freed, reserved_after = cls._chunk(k, rid, start, end)
        return max(0, new - reserved_after) + (reserved_after - k.tables[rid].reserved) - freed

    @classmethod
    def _fits(cls, k: KindManager, rid: str, start: int, end: int) -> bool:
        new, freed, reserved_after = cls._chunk(k, rid, start, end)
        extra_available = k.pool.num_available + freed - (reserved_after - k.tables[rid].reserved)
        return new <= reserved_after + max(0, extra_available)

    def allocate(self, rid: str, start: int, end: int) -> bool:
        ok = all(k.allocate(rid, start, end) for k in self._kinds())
        lock = self.admitted[rid].lock
        if (
            ok
            and lock is not None
            and lock.swa_nodes
            and self.cache is not None
            and self.swa.window_past_cache(rid)
        ):
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
        adm = self.admitted[rid]
        lock = adm.lock
        shared = ft.shared_end
        after = (lock.node, shared) if lock is not None and shared > 0 else None
        if after is None:
            shared = 0
        node, tree_full, tree_swa = self.cache.tree.insert(tokens, full, swa, after)
        if not keep:
            self.cache.tree.demote_checkpoints(node, len(tokens), adm.hit_tokens)
            return
        new_lock = self.cache.tree.lock(node)
        self.cache.release(lock)
        adm.lock = new_lock
        ft.pages[shared:K] = tree_full
        self.full.share(ft, K)
        ft.slot_cache = None
        if self.has_swa:
            st = self.swa.tables[rid]
            for i in range(max(st.base, shared), K):
                page = tree_swa[i - shared]
                assert page is not None, "window page of a cached prefix is a tombstone"
                st.pages[i - st.base] = page
            self.swa.share(st, K)
            # cache pages before the next chunk's window leave the table now: the new lock does
            # not cover them, so the tree may evict them
            first = min(self.swa.first_needed_page(tokens_done), K)
            if first > st.base:
                st.pages = st.pages[first - st.base :]
                st.base = first
            st.slot_cache = None
            self.swa.rebalance(st)

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
        adm = self.admitted.pop(rid, None)
        if self.cache is not None:
            self.cache.release(adm.lock if adm is not None else None)

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
            staged = self.cache.staged  # L3 fetches' host pages are not the tree's yet
            out["host_full"] = self.cache.host_full.num_used - len(staged["host_full"])
            hs = self.cache.host_swa
            out["host_swa"] = hs.num_used - len(staged["host_swa"]) if hs is not None else 0
        return out

    def held_bytes(self, rid: str) -> int:
        """Bytes of KV a request holds right now, both pools (cache pages it shares included)."""
        total = self.full.held(rid) * self.plan.full_page_bytes
        if self.has_swa:
            total += self.swa.held(rid) * self.plan.swa_page_bytes
        return total
