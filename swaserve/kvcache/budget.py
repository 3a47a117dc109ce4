"""``ByteBudget``: one pool of bytes that several ``PagePool``s (full and SWA pages) draw from.

A page pool bound to a budget owns no fixed page count: it takes ``page_bytes`` of the budget per
page it hands out and gives them back on free, so the split between full and SWA pages is decided by
who allocates and by the prefix cache's eviction (``kvcache.adaptive``), not at start-up.
Reservations (``PagePool.reserve``) are kept in bytes here too, so a promised page of one kind
cannot be taken by the other kind.
"""

from __future__ import annotations

from swaserve.kvcache.idqueue import IdQueue


class ByteBudget:
    """``total`` bytes; ``used`` by allocated pages, ``reserved`` promised to admitted requests.

    With ``unit_bytes`` the bytes are ``total // unit_bytes`` units of an arena (``kvcache.arena``;
    ``total`` is rounded down to whole units): pools on it take units for each page they hand out
    (``take_units``) and give them back on free, so their pages map to distinct arena memory.

    Invariant: ``used + reserved <= total``; with units, ``used`` is the bytes of the units taken.

    Raises:
        ValueError: less than one byte (or unit).
    """

    def __init__(self, total: int, unit_bytes: int | None = None) -> None:
        self.unit_bytes = unit_bytes
        self.num_units = 0
        self._free_units = IdQueue()
        if unit_bytes is not None:
            if unit_bytes < 1:
                raise ValueError(f"unit_bytes must be at least 1, got {unit_bytes}")
            self.num_units = total // unit_bytes
            total = self.num_units * unit_bytes
            self._free_units.extend(range(self.num_units))
        if total < 1:
            raise ValueError(f"a byte budget needs at least one byte (or unit), got {total}")
        self.total = total
        self.used = 0
        self.reserved = 0

    @property
    def free_units(self) -> int:
        return len(self._free_units)

    def take_units(self, n: int) -> list[int]:
        """``n`` free arena units (the caller accounted their bytes in ``used``).

        Raises:
            ValueError: fewer than ``n`` free units (a broken accounting invariant).
        """
        if n > self.free_units:
            raise ValueError(f"take_units({n}) with {self.free_units} free units")
        return self._free_units.take(n)

    def give_units(self, units: list[int]) -> None:
        self._free_units.extend(units)

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
