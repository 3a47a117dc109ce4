"""``ByteBudget``: one pool of bytes that several ``PagePool``s (full and SWA pages) draw from.

A page pool bound to a budget owns no fixed page count: it takes ``page_bytes`` of the budget per
page it hands out and gives them back on free, so the split between full and SWA pages is decided by
who allocates and by the prefix cache's eviction (``kvcache.adaptive``), not at start-up.
Reservations (``PagePool.reserve``) are kept in bytes here too, so a promised page of one kind
cannot be taken by the other kind.
"""

from __future__ import annotations


class ByteBudget:
    """``total`` bytes; ``used`` by allocated pages, ``reserved`` promised to admitted requests.

    Invariant: ``used + reserved <= total``.
    """

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a byte budget needs at least one byte, got {total}")
        self.total = total
        self.used = 0
        self.reserved = 0

    @property
    def free(self) -> int:
        """Bytes not held by any page (promised or not)."""
        return self.total - self.used

    @property
    def available(self) -> int:
        """Bytes neither held nor promised."""
        return self.total - self.used - self.reserved

    def __repr__(self) -> str:
        return f"ByteBudget(total={self.total}, used={self.used}, reserved={self.reserved})"
