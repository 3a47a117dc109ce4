"""Snapshot of engine state (requests, pools, prefix cache), for metrics, benches and tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from swaserve.kvcache.prefix_cache import CacheStats  # at run time: msgspec decodes these (engine.ipc)
from swaserve.kvcache.stats import PoolStats


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    pools: dict[str, PoolStats] = field(default_factory=dict)
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache: CacheStats | None = None
    cache_pages: dict[str, int] = field(default_factory=dict)  # pages the prefix cache holds per tier
    outstanding_tokens: int = 0  # prompt tokens not computed yet + output tokens still allowed
    prefill_tokens: int = 0  # prompt tokens not computed yet
