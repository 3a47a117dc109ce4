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

from dataclasses import dataclass, field

import torch

from swaserve.engine.stats import PoolStats
from swaserve.kvcache.pool import PagePool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PageTable:
    """A request's pages in one pool: ``pages[i]`` holds logical page ``base + i``."""

    base: int = 0
    pages: list[int] = field(default_factory=list)
    guarantee: int = 0  # pages this request is promised it can hold at once
    reserved: int = 0  # part of the guarantee not allocated yet (held in the pool's reservation)
    slot_cache: torch.Tensor | None = None  # slots of every held position, rebuilt when pages change

    @property
    def end_page(self) -> int:
        return self.base + len(self.pages)


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

    def guarantee_for(self, max_total_tokens: int) -> int:
        total = cdiv(max_total_tokens, self.page_size)
        if self.window is None:
            return total
        return min(total, cdiv(self.window, self.page_size) + 2)

    def can_admit(self, max_total_tokens: int) -> bool:
        return self.pool.can_reserve(self.guarantee_for(max_total_tokens))

    def admit(self, rid: str, max_total_tokens: int) -> bool:
        if rid in self.tables:
            raise ValueError(f"request {rid} already admitted")
        g = self.guarantee_for(max_total_tokens)
        if not self.pool.reserve(g):
            return False
        self.tables[rid] = PageTable(guarantee=g, reserved=g)
        return True

    def first_needed_page(self, start: int) -> int:
        """Lowest logical page a chunk starting at ``start`` reads."""
        if self.window is None:
            return 0
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
            t.base = t.base + k if t.pages else first
            self.pool.free(dropped)
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
        want = max(0, t.guarantee - len(t.pages))
        if want > t.reserved:
            if not self.pool.reserve(want - t.reserved):  # cannot fail: the freed pages are free
                raise RuntimeError("reservation invariant broken")
            t.reserved = want

    def free(self, rid: str) -> None:
        t = self.tables.pop(rid, None)
        if t is None:
            return
        self.pool.free(t.pages)
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


@dataclass(frozen=True)
class PoolPlan:
    """How a KV byte budget splits into the two pools (see ``plan_pools``)."""

    full_pages: int
    swa_pages: int
    full_page_bytes: int
    swa_page_bytes: int


class KVCacheManager:
    """The two pools (full, SWA) and their page tables, managed together.

    Args:
        plan: pool sizes and per-page bytes.
        page_size: tokens per page.
        window: previous tokens a SWA query sees.
        layout: "hybrid" frees SWA pages outside the window; "full" keeps them (SWA-unaware baseline).
        num_full_layers, num_swa_layers: for accounting only.
    """

    def __init__(
        self,
        plan: PoolPlan,
        page_size: int,
        window: int,
        layout: str,
        num_full_layers: int,
        num_swa_layers: int,
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

    def _kinds(self) -> list[KindManager]:
        return [self.full, self.swa] if self.has_swa else [self.full]

    def fits_ever(self, max_total_tokens: int) -> bool:
        """Could this request be admitted into empty pools?"""
        return all(k.guarantee_for(max_total_tokens) <= k.pool.num_pages for k in self._kinds())

    def can_admit(self, max_total_tokens: int) -> bool:
        return all(k.can_admit(max_total_tokens) for k in self._kinds())

    def admit(self, rid: str, max_total_tokens: int) -> bool:
        """Reserve the request's guaranteed pages in both pools, or nothing."""
        if not self.can_admit(max_total_tokens):
            return False
        for k in self._kinds():
            if not k.admit(rid, max_total_tokens):  # cannot happen after can_admit
                raise RuntimeError("admission raced")
        return True

    def max_chunk(self, rid: str, start: int, end: int) -> int:
        """Largest n <= end - start such that chunk [start, start + n) can be allocated now."""
        lo, hi = 0, end - start
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
        held = len(t.pages) - freed
        reserved_after = max(t.reserved, t.guarantee - held)  # reservation after rebalance
        extra_available = k.pool.num_available + freed - (reserved_after - t.reserved)
        return new <= reserved_after + max(0, extra_available)

    def allocate(self, rid: str, start: int, end: int) -> bool:
        return all(k.allocate(rid, start, end) for k in self._kinds())

    def free(self, rid: str) -> None:
        for k in (self.full, self.swa):
            k.free(rid)

    def stats(self) -> dict[str, PoolStats]:
        return {"full": self.full.pool.stats(), "swa": self.swa.pool.stats()}

    def held_bytes(self, rid: str) -> int:
        """Bytes of KV a request holds right now, both pools."""
        total = self.full.held(rid) * self.plan.full_page_bytes
        if self.has_swa:
            total += self.swa.held(rid) * self.plan.swa_page_bytes
        return total
