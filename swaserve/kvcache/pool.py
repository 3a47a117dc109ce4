"""Page pools: free lists of fixed-size KV pages with reservations and exact accounting.

A ``PagePool`` knows nothing about tensors; it hands out page ids. ``reserve`` sets pages aside for a
request at admission so that later ``allocate`` calls for it cannot fail; unreserved allocations
(e.g. a prefill chunk larger than the reservation) succeed only if unreserved pages are free.
A pool bound to a ``ByteBudget`` shares its room with the other pools of that budget (its free and
available pages are the budget's bytes divided by its page size); page ids are then issued lazily,
lowest free id first in issue order, so ids stay below the most pages the pool ever held. On a budget with arena units each page also
takes ``page_bytes / unit_bytes`` units, recorded in ``units`` (the storage's page -> unit table).
"""

from __future__ import annotations

from array import array

from swaserve.kvcache.budget import ByteBudget
from swaserve.kvcache.idqueue import IdQueue
from swaserve.kvcache.stats import PoolStats


class PagePool:
    """Free list of ``num_pages`` page ids, or pages drawn from a shared ``budget``.

    Args:
        num_pages: pages of a pool of its own; ignored with ``budget`` (then the most pages the
            budget could hold, ``budget.total // page_bytes``).
        page_bytes: bytes of one page (all layers of the pool, K and V).
        budget: shared bytes (``kvcache.budget``); None = a pool of its own.

    Invariants: every page id is either free or held by exactly one owner; ``reserved`` never exceeds
    the free pages, so a reserved allocation always succeeds.
    """

    def __init__(
        self, num_pages: int, page_bytes: int, num_layers: int, budget: ByteBudget | None = None
    ) -> None:
        if budget is not None:
            if page_bytes < 1:
                raise ValueError("a pool on a shared budget needs page_bytes >= 1")
            num_pages = budget.total // page_bytes
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.num_layers = num_layers
        self.budget = budget
        self._issued = 0 if budget is not None else num_pages  # ids 0 .. issued-1 exist
        self._free = IdQueue(range(self._issued))
        self._held: set[int] = set()  # the ids in use
        self._used = 0
        self.reserved = 0  # pages promised to admitted requests, not yet allocated
        self.peak_used = 0
        # arena units of each page: units[p * m + g], -1 while p is free (never resized: its
        # buffer is shared with the storage's unit table, torch.frombuffer)
        self.units_per_page = 0
        self.units = array("q")
        unit = budget.unit_bytes if budget is not None else None
        if unit is not None:
            if page_bytes % unit:
                raise ValueError(f"page_bytes {page_bytes} is not a multiple of the arena unit {unit}")
            self.units_per_page = page_bytes // unit
            self.units = array("q", [-1]) * (num_pages * self.units_per_page)

    @property
    def issued(self) -> int:
        """Page ids handed out at least once (all of them for a pool of its own)."""
        return self._issued

    @property
    def num_free(self) -> int:
        if self.budget is not None:
            return self.budget.free // self.page_bytes
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def num_available(self) -> int:
        """Free pages not promised to anyone."""
        if self.budget is not None:
            return self.budget.available // self.page_bytes
        return len(self._free) - self.reserved

    def can_reserve(self, n: int) -> bool:
        return self.num_available >= n

    def reserve(self, n: int) -> bool:
        """Promise ``n`` pages; False (nothing changed) if not enough unpromised free pages."""
        if n < 0 or not self.can_reserve(n):
            return False
        self.reserved += n
        if self.budget is not None:
            self.budget.reserved += n * self.page_bytes
        return True

    def unreserve(self, n: int) -> None:
        if n < 0 or n > self.reserved:
            raise ValueError(f"unreserve({n}) with {self.reserved} reserved")
        self.reserved -= n
        if self.budget is not None:
            self.budget.reserved -= n * self.page_bytes

    def allocate(self, n: int, from_reserved: int = 0) -> list[int] | None:
        """Take ``n`` pages, ``from_reserved`` of them out of the caller's reservation.

        Returns the page ids, or None (nothing changed) if there is no room.
        """
        if not 0 <= from_reserved <= min(n, self.reserved):
            raise ValueError(f"from_reserved={from_reserved} invalid for n={n}, reserved={self.reserved}")
        if n - from_reserved > self.num_available:
            return None
        self.reserved -= from_reserved
        if self.budget is not None:
            self.budget.reserved -= from_reserved * self.page_bytes
            self.budget.used += n * self.page_bytes
            fresh = max(0, n - len(self._free))  # ids never issued before
            self._free.extend(range(self._issued, self._issued + fresh))
            self._issued += fresh
        pages = self._free.take(n)
        self._held.update(pages)
        if self.units_per_page:
            assert self.budget is not None
            m = self.units_per_page
            taken = self.budget.take_units(n * m)  # page i gets taken[i * m : (i + 1) * m]
            for i, p in enumerate(pages):
                self.units[p * m : (p + 1) * m] = array("q", taken[i * m : (i + 1) * m])
        self._used += n
        self.peak_used = max(self.peak_used, self._used)
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the free list. Raises ValueError on a double free (nothing changed)."""
        if not self._held.issuperset(pages):
            p = next(p for p in pages if p not in self._held)
            raise ValueError(f"page {p} freed twice (or never allocated)")
        if len(set(pages)) != len(pages):
            raise ValueError(f"a page is listed twice in {pages}")
        self._held.difference_update(pages)
        self._free.extend(pages)
        if self.units_per_page:
            assert self.budget is not None
            m = self.units_per_page
            back: list[int] = []
            gone = array("q", [-1]) * m
            for p in pages:
                back.extend(self.units[p * m : (p + 1) * m])
                self.units[p * m : (p + 1) * m] = gone
            self.budget.give_units(back)
        self._used -= len(pages)
        if self.budget is not None:
            self.budget.used -= len(pages) * self.page_bytes

    def is_free(self, page: int) -> bool:
        return page not in self._held

    def stats(self) -> PoolStats:
        """With a shared budget ``total_pages`` is what the pool could hold now: its pages and
        what the budget's free bytes would give it."""
        total = self.num_used + self.num_free if self.budget is not None else self.num_pages
        return PoolStats(total, self.num_used, self.peak_used, self.page_bytes, self.num_layers)
