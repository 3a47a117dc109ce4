"""Page pools: free lists of fixed-size KV pages with reservations and exact accounting.

A ``PagePool`` knows nothing about tensors; it hands out page ids. ``reserve`` sets pages aside for a
request at admission so that later ``allocate`` calls for it cannot fail; unreserved allocations
(e.g. a prefill chunk larger than the reservation) succeed only if unreserved pages are free.
"""

from __future__ import annotations

from collections import deque

from swaserve.kvcache.stats import PoolStats


class PagePool:
    """Free list of ``num_pages`` page ids.

    Invariants: every page id is either free or held by exactly one owner; ``reserved`` never exceeds
    the free pages, so a reserved allocation always succeeds.
    """

    def __init__(self, num_pages: int, page_bytes: int, num_layers: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.num_layers = num_layers
        self._free: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages
        self.reserved = 0  # pages promised to admitted requests, not yet allocated
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages not promised to anyone."""
        return len(self._free) - self.reserved

    def can_reserve(self, n: int) -> bool:
        return self.num_available >= n

    def reserve(self, n: int) -> bool:
        """Promise ``n`` pages; False (nothing changed) if not enough unpromised free pages."""
        if n < 0 or not self.can_reserve(n):
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if n < 0 or n > self.reserved:
            raise ValueError(f"unreserve({n}) with {self.reserved} reserved")
        self.reserved -= n

    def allocate(self, n: int, from_reserved: int = 0) -> list[int] | None:
        """Take ``n`` pages, ``from_reserved`` of them out of the caller's reservation.

        Returns the page ids, or None (nothing changed) if there is no room.
        """
        if not 0 <= from_reserved <= min(n, self.reserved):
            raise ValueError(f"from_reserved={from_reserved} invalid for n={n}, reserved={self.reserved}")
        if n - from_reserved > self.num_available:
            return None
        self.reserved -= from_reserved
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the free list. Raises ValueError on a double free."""
        for p in pages:
            if self._is_free[p]:
                raise ValueError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_used, self.peak_used, self.page_bytes, self.num_layers)
