"""The KV stack of one engine: each pool's page format, the pool plan (one shared arena or two),
the device tensors (``KVStorage``), the host tier (``HostKVStorage``) and the ``KVCacheManager``
over them, bound together. Its sizing rules: ``kvcache.sizing`` (docs/DESIGN.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig, kv_config
from swaserve.kvcache.arena import arena_layout
from swaserve.kvcache.host import HostKVStorage
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.sizing import host_plan, page_bytes, plan_pools, spec_lookahead
from swaserve.kvcache.storage import KVStorage
from swaserve.kvformat import KVFormat, engine_formats, residual_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVStack:
    """formats: each pool kind's page format (``FULL``, ``SWA``); storage: the device pages;
    host: the host tier's pages (None: no host tier); kv: the page and prefix-cache manager."""

    formats: dict[str, KVFormat]
    storage: KVStorage
    host: HostKVStorage | None
    kv: KVCacheManager


def build_kv_stack(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> KVStack:
    """Plan, allocate and bind the KV pools of ``config`` for model ``cfg`` (pages in ``dtype`` on
    ``device``; the MTP layers' KV and KIVI's full-precision residuals as extra SWA layers).

    Raises:
        ValueError: a bad host write policy, or a plan the budget cannot hold (``plan_pools``).
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    formats = engine_formats(config, cfg)
    # the MTP layers' KV and KIVI's full-precision residuals: extra SWA layers
    kcfg = kv_config(cfg, config.speculative_num_steps, residual_layers(formats, cfg))
    arena = (
        arena_layout(kcfg, config.page_size, elem, formats) if cfg.full_layers and cfg.swa_layers else None
    )
    # with prefix caching and no --swa-full-tokens-ratio: one arena both pools draw from
    plan = plan_pools(kcfg, config, elem, shared=arena is not None, arena=arena, formats=formats)
    if plan.unit_bytes is not None and arena is not None:
        full = page_bytes(kcfg, config.page_size, elem, formats)[0]
        if full < 0.8 * arena.unit_bytes:  # a full page is one arena unit: the rest is padding
            log.warning(
                "a %s full page (%d B) fills %.0f%% of a shared KV arena unit (%d B, one SWA layer's "
                "page): the rest is padding; --swa-full-tokens-ratio gives the pools arenas of their own",
                formats[FULL].describe(),
                full,
                100 * full / arena.unit_bytes,
                arena.unit_bytes,
            )
    storage = KVStorage(kcfg, plan, config.page_size, dtype, device, formats)
    host: HostKVStorage | None = None
    host_pages = host_bytes = host_units = None
    if config.enable_prefix_caching and config.host_cache_memory > 0:
        host_pages = host_plan(plan, config.host_cache_memory)
        if plan.unit_bytes is not None:
            host_bytes = config.host_cache_memory
            host_units = host_bytes // plan.unit_bytes
        host = HostKVStorage(storage, {FULL: host_pages[0], SWA: host_pages[1]}, config.page_size, host_units)
    if config.host_write_policy not in ("on_evict", "second_hit"):
        raise ValueError(
            f"host write policy must be on_evict or second_hit, got {config.host_write_policy!r}"
        )
    kv = KVCacheManager(
        plan,
        config.page_size,
        cfg.window,
        config.kv_layout,
        len(kcfg.full_layers),
        len(kcfg.swa_layers),
        prefix_caching=config.enable_prefix_caching,
        host_pages=host_pages,
        host_bytes=host_bytes,
        mover=host,
        write_policy=config.host_write_policy,  # type: ignore[arg-type]
        lookahead=spec_lookahead(config),
    )
    storage.bind(FULL, kv.full.pool)
    storage.bind(SWA, kv.swa.pool)
    if host is not None and kv.cache is not None and kv.cache.host_full is not None:
        host.bind(FULL, kv.cache.host_full)
        if kv.cache.host_swa is not None:
            host.bind(SWA, kv.cache.host_swa)
    if config.index_block_tokens is not None:
        kv.enable_cache_events(config.index_block_tokens)
    return KVStack(formats, storage, host, kv)
