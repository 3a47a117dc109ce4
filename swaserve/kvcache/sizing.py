"""Split one KV byte budget between the full-attention pool and the SWA pool (``plan_pools``).

Hybrid: the SWA pool gets what the running requests and one step's chunks need,
``max_num_seqs * (ceil((W + lookahead)/P) + 2) + ceil(C/P) + 1`` pages (lookahead: ``spec_lookahead``) (at most half the budget), the full pool
the rest; with prefix caching at least ``r`` SWA pages per full page (``swa_full_tokens_ratio``,
default 1/9), or, asked for ``shared``, one budget both pools draw from (``kvcache.adaptive``
moves the split). Full layout (SWA-unaware): equal page counts, ``budget // (full + SWA page bytes)``.
Notation and derivation: docs/DESIGN.md#kvcachesizingpy"""

from __future__ import annotations

from collections.abc import Mapping

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.kvcache.arena import ArenaLayout
from swaserve.kvcache.plan import PoolPlan, cdiv
from swaserve.kvformat import KVFormat

DEFAULT_SWA_FULL_TOKENS_RATIO = 1 / 9


def spec_lookahead(ecfg: EngineConfig) -> int:
    """Tokens a decode step holds past its new one with MTP on: k verified draft rows, then up to
    k - 1 provisional draft-layer rows past the accepted ones (``engine.drafter``)."""
    return 2 * ecfg.speculative_num_steps


def page_bytes(
    cfg: ModelConfig, page_size: int, dtype_bytes: int, formats: Mapping[str, KVFormat] | None = None
) -> tuple[int, int]:
    """(full, swa) bytes of one page across all layers of the pool, K and V, in each kind's page
    format (``formats``; default ``auto``: ``dtype_bytes`` per element)."""
    out = []
    for kind, layers, s in ((FULL, cfg.full_layers, cfg.full), (SWA, cfg.swa_layers, cfg.swa)):
        fmt = (formats or {}).get(kind, KVFormat())
        out.append(
            len(layers) * page_size * fmt.token_bytes(s.num_kv_heads, s.head_dim, s.v_head_dim, dtype_bytes)
        )
    return out[0], out[1]


def plan_pools(
    cfg: ModelConfig,
    ecfg: EngineConfig,
    dtype_bytes: int,
    budget: int | None = None,
    shared: bool = False,
    arena: ArenaLayout | None = None,
    formats: Mapping[str, KVFormat] | None = None,
) -> PoolPlan:
    """Pool sizes for ``budget`` bytes (default ``ecfg.kv_cache_memory``) as in the module formula.
    ``shared``: with prefix caching, a hybrid layout and no ``swa_full_tokens_ratio``, one byte
    budget both pools draw from, split by the traffic (``kvcache.adaptive``); ``arena``: that
    budget is the arena of this layout (whole units; page bytes with their padding), as the
    engine's storage holds it. Without ``arena`` a shared plan counts bytes only (simulation).
    ``formats``: each pool's page format (``page_bytes``).

    Raises:
        ValueError: the budget cannot hold one page in each pool.
    """
    budget = ecfg.kv_cache_memory if budget is None else budget
    p = ecfg.page_size
    pbf, pbs = page_bytes(cfg, p, dtype_bytes, formats)
    if not cfg.swa_layers:
        return PoolPlan(max(1, budget // pbf), 1, pbf, 0)
    if (
        shared
        and ecfg.kv_layout == "hybrid"
        and ecfg.enable_prefix_caching
        and ecfg.swa_full_tokens_ratio is None
    ):
        unit = None
        if arena is not None:
            unit, pbf, pbs = arena.unit_bytes, arena.page_bytes(FULL), arena.page_bytes(SWA)
            budget -= budget % unit
        if budget < pbf + pbs:
            raise ValueError(f"kv cache budget {budget} B is too small for one page per pool")
        return PoolPlan(budget // pbf, budget // pbs, pbf, pbs, shared_bytes=budget, unit_bytes=unit)
    if ecfg.kv_layout == "full":
        pages = budget // (pbf + pbs)
        if pages < 1:
            raise ValueError(f"kv cache budget {budget} B is smaller than one page ({pbf + pbs} B)")
        return PoolPlan(pages, pages, pbf, pbs)
    per_seq = cdiv(cfg.window + spec_lookahead(ecfg), p) + 2
    swa_pages = ecfg.max_num_seqs * per_seq + cdiv(ecfg.max_num_batched_tokens, p) + 1
    swa_pages = min(swa_pages, (budget // 2) // pbs)
    full_pages = (budget - swa_pages * pbs) // pbf
    if ecfg.enable_prefix_caching:
        r = ecfg.swa_full_tokens_ratio
        r = DEFAULT_SWA_FULL_TOKENS_RATIO if r is None else r
        if r < 0:
            raise ValueError(f"swa_full_tokens_ratio must be >= 0, got {r}")
        cached_full = int(budget / (pbf + r * pbs))
        if int(r * cached_full) > swa_pages:
            swa_pages = int(r * cached_full)
            full_pages = (budget - swa_pages * pbs) // pbf
    if swa_pages < 1 or full_pages < 1:
        raise ValueError(f"kv cache budget {budget} B is too small for one page per pool")
    return PoolPlan(full_pages, swa_pages, pbf, pbs)


def host_plan(plan: PoolPlan, budget: int) -> tuple[int, int]:
    """(full, swa) host-tier pages for ``budget`` bytes, split in the device pools' byte proportion.

    A shared plan (``plan.shared_bytes``) gets the most pages of each kind the host budget holds:
    the host pools then share that budget too (``KVCacheManager`` ``host_bytes``).

    Raises:
        ValueError: the budget cannot hold one page of each kind.
    """
    least = plan.full_page_bytes + plan.swa_page_bytes  # one page of each kind
    if budget < least:
        raise ValueError(
            f"host cache budget {budget} B is smaller than one full page and one SWA page ({least} B)"
        )
    if plan.shared_bytes is not None:
        return budget // plan.full_page_bytes, budget // plan.swa_page_bytes if plan.swa_page_bytes else 0
    dev_full = plan.full_pages * plan.full_page_bytes
    dev_swa = plan.swa_pages * plan.swa_page_bytes
    swa_share = dev_swa / (dev_full + dev_swa) if plan.swa_page_bytes else 0.0
    swa_pages = int(budget * swa_share) // plan.swa_page_bytes if plan.swa_page_bytes else 0
    if plan.swa_page_bytes:
        swa_pages = max(1, swa_pages)
    full_pages = (budget - swa_pages * plan.swa_page_bytes) // plan.full_page_bytes
    return full_pages, swa_pages
