"""Page tables of one attention kind over one ``PagePool``: one manager class per kind behind the
``KindManager`` interface (as vLLM's ``SingleTypeKVCacheManager`` subclasses).

``FullAttentionManager`` keeps every token's pages; ``SlidingWindowManager`` holds the pages of
``[start - window, end)`` of the chunk being computed and frees older ones when the next chunk is
allocated. ``kv_layout="full"`` (the SWA-unaware baseline) manages the SWA pool as full.

Example: docs/DESIGN.md#kvcachekindpy"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from swaserve.kvcache.plan import cdiv
from swaserve.kvcache.pool import PagePool


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


class KindManager(ABC):
    """Page tables of one attention kind over one ``PagePool``.

    Args:
        pool: the page pool. page_size: tokens per page.

    Attributes:
        tables: request id -> its ``PageTable``.
    """

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.tables: dict[str, PageTable] = {}

    @property
    def window(self) -> int | None:
        """Previous tokens each query sees (None: every token, no page is freed early)."""
        return None

    @abstractmethod
    def guarantee_for(self, max_total_tokens: int, cached_pages: int = 0) -> int:
        """Own pages a request must be sure to get (``cached_pages`` come from the prefix cache)."""

    @abstractmethod
    def first_needed_page(self, start: int) -> int:
        """Lowest logical page a chunk starting at token ``start`` still needs."""

    @abstractmethod
    def share(self, t: PageTable, end: int) -> None:
        """Logical pages below ``end`` (>= ``t.shared_end``) now belong to the prefix cache."""

    @abstractmethod
    def window_past_cache(self, rid: str) -> bool:
        """Whether the request's window has left the cached prefix it holds (its SWA lock on the
        prefix may go)."""

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

    def pages_to_add(self, rid: str, start: int, end: int) -> tuple[int, int]:
        """(pages that would be freed, pages that must be allocated) for chunk [start, end)."""
        t = self.tables[rid]
        freed = max(0, min(self.first_needed_page(start), t.end_page) - t.base)
        new = max(0, cdiv(end, self.page_size) - t.end_page)
        return freed, new

    def allocate(self, rid: str, start: int, end: int) -> bool:
        """Free pages no longer needed by chunk [start, end) and add pages up to ``end``.

        Returns False (nothing allocated, but unneeded pages may have been freed) if the pool has
        no room for the pages beyond the request's guarantee.
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
            self.rebalance(t)
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

    def rebalance(self, t: PageTable) -> None:
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


class FullAttentionManager(KindManager):
    """Full attention: a request keeps every page (guarantee: all of its tokens not cached)."""

    def guarantee_for(self, max_total_tokens: int, cached_pages: int = 0) -> int:
        return cdiv(max_total_tokens, self.page_size) - cached_pages

    def first_needed_page(self, start: int) -> int:
        return 0

    def share(self, t: PageTable, end: int) -> None:
        t.guarantee -= end - t.shared_end  # the cache holds those pages now, not the request
        t.shared_end = end

    def window_past_cache(self, rid: str) -> bool:
        return False


class SlidingWindowManager(KindManager):
    """Sliding-window attention: a request holds the pages of ``[start - window, end)`` of its
    chunk; its guarantee is ``ceil(window / page) + 2`` pages (window + one token), at most its
    whole length.

    Args:
        window: previous tokens each query sees (>= 1).
        keep_boundary_window: set when a prefix cache takes the request's pages: also keep the
            window of the last page boundary before a chunk (``first_needed_page``).
        lookahead: tokens a decode step may hold past its one new token (speculative decoding:
            k draft rows verified, and the draft layers' rows after them); added to the guarantee.
    """

    def __init__(
        self,
        pool: PagePool,
        page_size: int,
        window: int,
        keep_boundary_window: bool = False,
        lookahead: int = 0,
    ) -> None:
        super().__init__(pool, page_size)
        self._window = window
        self.keep_boundary_window = keep_boundary_window
        self.lookahead = lookahead

    @property
    def window(self) -> int:
        return self._window

    def guarantee_for(self, max_total_tokens: int, cached_pages: int = 0) -> int:
        return min(
            cdiv(max_total_tokens, self.page_size),
            cdiv(self._window + self.lookahead, self.page_size) + 2,
        )

    def first_needed_page(self, start: int) -> int:
        """Lowest logical page a chunk starting at ``start`` reads (with ``keep_boundary_window``:
        or that the last page boundary ``b <= start`` needs, so the request can still be cached
        window-safely up to ``b``; at most one more page, within the guarantee)."""
        if self.keep_boundary_window:
            start = start // self.page_size * self.page_size
        return max(0, start - self._window) // self.page_size

    def share(self, t: PageTable, end: int) -> None:
        t.shared_end = end  # the guarantee is the window's, whoever owns the pages

    def window_past_cache(self, rid: str) -> bool:
        t = self.tables[rid]
        return t.base >= t.shared_end
