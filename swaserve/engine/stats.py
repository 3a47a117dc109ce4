"""Snapshot of engine state, for metrics, benches and tests: ``EngineStats`` (running and waiting
requests, token totals, each pool's ``PoolStats``, the prefix cache's ``CacheStats`` and pages,
outstanding and prefill tokens, steps and tokens computed). Its kvcache types are imported at run time: msgspec decodes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

from swaserve.engine.spec import SpecStats  # at run time: msgspec decodes these (engine.ipc)
from swaserve.kvcache.prefix_cache import CacheStats
from swaserve.kvcache.stats import PoolStats
from swaserve.model.ep_stats import EPStats


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
    ep: EPStats | None = None  # expert load per MoE layer across the EP group (None: no EP)
    l3: dict[str, int] = field(default_factory=dict)  # the L3 tier's counters (empty: no L3)


def merge_stats(ranks: Sequence[EngineStats]) -> EngineStats:
    """One instance's stats from its EP ranks' (each with its own requests and pools): counts and
    pages summed (a pool's peak: the sum of the ranks' peaks, an upper bound), page sizes and
    layer counts, formats kept, the EP counters (the same on every rank) taken from the first."""
    total = cast(EngineStats, _sum([dataclasses.replace(r, ep=None) for r in ranks]))
    return dataclasses.replace(total, ep=ranks[0].ep)


_KEEP = {"page_bytes", "num_layers", "kv_format", "page_size"}


def _sum(values: Sequence[object]) -> object:
    """Field-wise sum of equal-typed dataclasses, dicts (by key), lists (by index) and numbers."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    v0 = present[0]
    if dataclasses.is_dataclass(v0) and not isinstance(v0, type):
        return dataclasses.replace(
            v0,  # type: ignore[arg-type]
            **{
                f.name: getattr(v0, f.name)
                if f.name in _KEEP
                else _sum([getattr(v, f.name) for v in present])
                for f in dataclasses.fields(v0)
            },
        )
    if isinstance(v0, dict):
        keys = list(dict.fromkeys(k for v in present for k in v))  # type: ignore[attr-defined]
        return {k: _sum([v[k] for v in present if k in v]) for k in keys}  # type: ignore[index,operator]
    if isinstance(v0, list):
        width = max(len(v) for v in present)  # type: ignore[arg-type]
        return [sum(v[i] for v in present if i < len(v)) for i in range(width)]  # type: ignore[index,arg-type]
    return sum(present)  # type: ignore[arg-type]
