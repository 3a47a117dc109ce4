"""Snapshots of engine and KV-pool state, for metrics, benches and tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolStats:
    """Exact page accounting of one KV pool ("full" or "swa").

    Attributes:
        total_pages: Pages in the pool.
        used_pages: Pages held by requests now.
        peak_used_pages: Most pages held at once since start.
        page_bytes: Bytes of one page across all layers of the pool (K and V).
        num_layers: Layers whose KV lives in this pool.
    """

    total_pages: int
    used_pages: int
    peak_used_pages: int
    page_bytes: int
    num_layers: int

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


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    pools: dict[str, PoolStats] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
