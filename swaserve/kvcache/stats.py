"""Snapshot of one KV pool's page accounting (``PoolStats``: pages in use, peak, cached, page bytes) and
the prefix cache's token counters (``CacheStats``), for
engine stats, metrics, benches and tests. It lives in ``kvcache`` (the bottom layer) so that the
pools and the manager need nothing from ``engine``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolStats:
    """Exact page accounting of one KV pool ("full" or "swa").

    Attributes:
        total_pages: Pages in the pool (on a shared budget: its pages and what the free bytes hold).
        used_pages: Pages not free now: held by requests or by the prefix cache.
        peak_used_pages: Most pages not free at once since start.
        page_bytes: Bytes of one page across all layers of the pool (K and V).
        num_layers: Layers whose KV lives in this pool.
        cached_pages: Pages owned by the prefix cache (evictable unless a request locks them).
        kv_format: the pool's page format (``KVFormat.describe``; the engine fills it in).
        page_size: tokens per page (0: not known here).
    """

    total_pages: int
    used_pages: int
    peak_used_pages: int
    page_bytes: int
    num_layers: int
    cached_pages: int = 0
    kv_format: str = "auto"
    page_size: int = 0

    @property
    def token_bytes(self) -> float:
        """Bytes one token's K and V take over the pool's layers (0.0: page size not known)."""
        return self.page_bytes / self.page_size if self.page_size else 0.0

    @property
    def request_pages(self) -> int:
        """Pages requests own (not counting cache pages they share)."""
        return self.used_pages - self.cached_pages

    @property
    def free_pages(self) -> int:
        return self.total_pages - self.used_pages

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_pages * self.page_bytes

    @property
    def usage(self) -> float:
        """Fraction of pages in use, 0..1."""
        return self.used_pages / self.total_pages if self.total_pages else 0.0


@dataclass
class CacheStats:
    """Token counters since start: ``queries`` prompt tokens looked up; hits by tier."""

    queries: int = 0
    hits_device: int = 0
    hits_host: int = 0
    hits_l3: int = 0  # loaded from host pages an L3 fetch filled for the request
    loaded_pages: int = 0  # host -> device page copies (both kinds)
    saved_pages: int = 0  # device -> host page copies (both kinds)
