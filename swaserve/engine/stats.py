"""Snapshot of engine state, for metrics, benches and tests: ``EngineStats`` (running and waiting
requests, token totals, each pool's ``PoolStats``, the prefix cache's ``CacheStats`` and pages,
outstanding and prefill tokens, steps and tokens computed). Its kvcache types are imported at run time: msgspec decodes them."""

from __future__ import annotations

from dataclasses import dataclass, field

from swaserve.engine.spec import SpecStats  # at run time: msgspec decodes these (engine.ipc)
from swaserve.kvcache.prefix_cache import CacheStats
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
    steps_total: int = 0  # engine steps (forwards) run since start: its progress
    computed_tokens_total: int = 0  # tokens run through the model since start (prefill chunks + decode)
    spec: SpecStats | None = None  # MTP speculative decoding's counters (None: off)
