"""The split of a KV byte budget into the full and SWA pools: ``PoolPlan`` (pages and bytes per page
of each pool; ``kvcache.sizing.plan_pools`` computes it; the storage, the host tier and the manager
read it), and ``cdiv``."""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True)
class PoolPlan:
    """Pages and bytes per page (all layers of the pool, K and V) of the full and SWA pools.

    ``shared_bytes``: both pools draw from one byte budget of this size (``kvcache.budget``; the
    page counts are then the most each pool could hold alone); None = pools of their own.
    ``unit_bytes``: with ``shared_bytes``, the budget is an arena of units of this size
    (``kvcache.arena``; the page bytes are then whole units, padding included); None = bytes only.
    """

    full_pages: int
    swa_pages: int
    full_page_bytes: int
    swa_page_bytes: int
    shared_bytes: int | None = None
    unit_bytes: int | None = None
