"""Part 1 of ``swaserve bench kv-quant``: KV bytes per request and requests per 80 GB for each page
format in the hybrid and full layouts (its setup: the docstring of ``bench.kv_quant``), and the
format names of the rows (``full+swa`` for two pool formats)."""

from __future__ import annotations

from typing import Any

from bench.prefix_workload import PAGE
from bench.targets import target
from swaserve.config import FULL, SWA, EngineConfig, ModelConfig, kv_config
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.plan import PoolPlan
from swaserve.kvcache.sizing import page_bytes, plan_pools
from swaserve.kvformat import AUTO, KIVI_FORMATS, ROW_FORMATS, KVFormat, engine_formats, residual_layers
from swaserve.shapes import SHAPES, model_config

FORMATS = (AUTO, *ROW_FORMATS, *KIVI_FORMATS)
# KIVI over an 8-bit SWA pool (``--kv-cache-dtype-swa fp8_e4m3``: SWA layers and the residual at 8
# bits): capacity and hit-rate rows, "<full>+<swa>"
KIVI_8BIT_SWA = ("kivi2+fp8_e4m3", "kivi4+fp8_e4m3")
POOL_FORMATS = (*FORMATS, *KIVI_8BIT_SWA)
GB80 = 80 * 10**9
BF16 = 2  # bytes per element of the capacity and hit-rate rows (the real models' KV dtype)
CAP_CHUNK = 8192
TARGET_RATIO_32K = 13.0  # hybrid + FP8 vs bf16 full, MiMo-V2.5-Pro at 32K


def split(name: str) -> tuple[str, str | None]:
    """A row's format name -> (``--kv-cache-dtype``, ``--kv-cache-dtype-swa`` or None)."""
    full, _, swa = name.partition("+")
    return full, swa or None


def is_kivi(name: str) -> bool:
    return split(name)[0] in KIVI_FORMATS


def formats_of(name: str, cfg: ModelConfig, group: int = 0) -> dict[str, KVFormat]:
    """Both pools' formats for ``--kv-cache-dtype name`` (or ``full+swa``) at page 16 (KIVI: the
    engine's defaults)."""
    full, swa = split(name)
    if full in KIVI_FORMATS:
        ecfg = EngineConfig(page_size=PAGE, kv_cache_dtype=full, kv_cache_dtype_swa=swa, kv_quant_group=group)
        return engine_formats(ecfg, cfg)
    return {FULL: KVFormat(full, group), SWA: KVFormat(swa or full, group)}


def pool_config(cfg: ModelConfig, fmts: dict[str, KVFormat]) -> ModelConfig:
    """``cfg`` as the pools see it: KIVI adds a residual SWA layer per full layer."""
    return kv_config(cfg, 0, residual_layers(fmts, cfg))


def layouts(fmt: str) -> tuple[str, ...]:
    return ("hybrid",) if is_kivi(fmt) else ("full", "hybrid")


# -- 1. capacity ----------------------------------------------------------------------------------
def admitted(
    cfg: ModelConfig, layout: str, context: int, seqs: int, fmt: str, cache: bool = False
) -> tuple[int, int, PoolPlan]:
    """Requests of ``context`` tokens admitted, prefilled and stepped once in 80 GB with pools planned
    for ``seqs`` of them (``cache``: with the prefix cache's SWA reserve, ``swa_full_tokens_ratio``
    1/9 of the full pages); (how many fit, bytes the first holds, the plan)."""
    ecfg = EngineConfig(page_size=PAGE, kv_cache_memory=GB80, kv_layout=layout, max_num_seqs=seqs,  # type: ignore[arg-type]
                        max_num_batched_tokens=CAP_CHUNK, kv_cache_dtype=split(fmt)[0],
                        kv_cache_dtype_swa=split(fmt)[1], enable_prefix_caching=cache)  # fmt: skip
    fmts = formats_of(fmt, cfg)
    kcfg = pool_config(cfg, fmts)
    plan = plan_pools(kcfg, ecfg, BF16, formats=fmts)
    kv = KVCacheManager(plan, PAGE, cfg.window, layout, len(kcfg.full_layers), len(kcfg.swa_layers))
    first = 0
    for n in range(seqs):
        rid = str(n)
        if kv.admit(rid, context + 1) is None:
            return n, first, plan
        pos = 0
        while pos < context:
            step = kv.max_chunk(rid, pos, min(context, pos + CAP_CHUNK))
            if step == 0 or not kv.allocate(rid, pos, pos + step):
                return n, first, plan
            pos += step
        kv.allocate(rid, context, context + 1)
        if n == 0:
            first = kv.held_bytes(rid)
            pages = kv.full.held(rid) * plan.full_page_bytes + kv.swa.held(rid) * plan.swa_page_bytes
            assert first == pages
    return seqs, first, plan


def most_requests(
    cfg: ModelConfig, layout: str, context: int, fmt: str, cache: bool = False
) -> tuple[int, int, PoolPlan]:
    """The largest m such that m requests fit when the pools are planned for m, with its bytes per
    request and plan: from 80 GB over one request's bytes, galloping, then bisection (a few
    simulations of about m requests each, not the ~12 of doubling from 1); ``admitted`` is
    monotone in m, so the answer is the one doubling would find."""
    fits = {}

    def ok(m: int) -> bool:
        fits[m] = admitted(cfg, layout, context, m, fmt, cache)
        return fits[m][0] >= m

    if not ok(1):
        return fits[1]
    # candidates: 80 GB over one request's bytes, then how many fit where m did not
    lo, m = 1, max(2, GB80 // max(1, fits[1][1]))
    hi: int | None = None
    while lo < m and (hi is None or m < hi):
        if ok(m):  # gallop up from m
            lo, step = m, 1
            while (hi is None or lo + step < hi) and ok(lo + step):
                lo, step = lo + step, step * 2
            hi = lo + step if hi is None else min(hi, lo + step)
            break
        hi, m = m, fits[m][0]
    assert hi is not None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if lo not in fits:
        ok(lo)
    return fits[lo]


def token_bytes(cfg: ModelConfig, fmt: KVFormat | dict[str, KVFormat], elem: int = BF16) -> tuple[int, int]:
    """(full-attention, SWA) KV bytes of one token over all layers of each kind (``fmt``: one for
    both pools, or each pool's; KIVI's residual layers counted in SWA)."""
    fmts = fmt if isinstance(fmt, dict) else {FULL: fmt, SWA: fmt}
    kcfg, f, s = pool_config(cfg, fmts), cfg.full, cfg.swa
    return (len(kcfg.full_layers) * fmts[FULL].token_bytes(f.num_kv_heads, f.head_dim, f.v_head_dim, elem),
            len(kcfg.swa_layers) * fmts[SWA].token_bytes(s.num_kv_heads, s.head_dim, s.v_head_dim, elem))  # fmt: skip


def scale_overhead(cfg: ModelConfig) -> list[dict[str, Any]]:
    """Bytes the fp32 scales add to a 1-byte format's token (both kinds), per group size."""
    out = []
    for g in (0, 64, 32):
        fmt = KVFormat("fp8_e4m3", g)
        f, s = token_bytes(cfg, fmt)
        data = sum(len(layers) * a.num_kv_heads * (a.head_dim + a.v_head_dim)
                   for layers, a in ((cfg.full_layers, cfg.full), (cfg.swa_layers, cfg.swa)))  # fmt: skip
        out.append({"group": g, "token_bytes": f + s, "data_bytes": data, "overhead": r4((f + s) / data - 1)})
    return out


def capacity(shape_names: tuple[str, ...], contexts: tuple[int, ...]) -> dict[str, Any]:
    """Part 1 over the model shapes named ``shape_names`` at each of ``contexts`` (tokens)."""
    rows: list[dict[str, Any]] = []
    shapes = {s.name: s for s in SHAPES}
    for name in shape_names:
        cfg = model_config(shapes[name])
        base_f, base_s = token_bytes(cfg, KVFormat())
        for ctx in contexts:
            base: int | None = None
            for layout in ("full", "hybrid"):
                for fmt in (f for f in POOL_FORMATS if layout in layouts(f)):
                    n, per_req, plan = most_requests(cfg, layout, ctx, fmt)
                    n_cache, per_req_cache, _ = most_requests(cfg, layout, ctx, fmt, cache=True)
                    assert per_req_cache == per_req
                    fmts = formats_of(fmt, cfg)
                    want = page_bytes(pool_config(cfg, fmts), PAGE, BF16, fmts)
                    assert (plan.full_page_bytes, plan.swa_page_bytes) == want, "plan ignores the format"
                    base = per_req if base is None else base  # first row: full layout, auto
                    f, s = token_bytes(cfg, fmts)
                    swa_tokens = ctx + 1 if layout == "full" else min(ctx + 1, cfg.window + 1)
                    theory = (base_f + base_s) * (ctx + 1) / (f * (ctx + 1) + s * swa_tokens)
                    ratio = base / per_req
                    rows.append({
                        "shape": name, "context_tokens": ctx, "layout": layout, "format": fmt,
                        "full_page_bytes": plan.full_page_bytes, "swa_page_bytes": plan.swa_page_bytes,
                        "bytes_per_request": per_req, "requests_in_80GB": n,
                        "requests_in_80GB_cache_plan": n_cache, "ratio_vs_bf16_full": r4(ratio),
                        "theoretical_ratio": r4(theory), "achieved_vs_theory": r4(ratio / theory),
                    })  # fmt: skip
    pro32 = [r for r in rows if r["shape"] == "MiMo-V2.5-Pro" and r["context_tokens"] == 32768
             and r["layout"] == "hybrid" and r["format"].startswith(("fp8", "kivi"))]  # fmt: skip
    targets = by_name(
        [target(f"{r['format']}: hybrid >= {TARGET_RATIO_32K}x less KV than bf16 full (V2.5-Pro, 32K)",
                r["ratio_vs_bf16_full"], ">=", TARGET_RATIO_32K) for r in pro32]
        + [target(f"{r['format']}: achieved >= 0.95x theory (V2.5-Pro, 32K)", r["achieved_vs_theory"], ">=", 0.95)
           for r in pro32]
    )  # fmt: skip
    overhead = {name: scale_overhead(model_config(shapes[name])) for name in shape_names}
    return {"budget_bytes": GB80, "page_size": PAGE, "kv_dtype_bytes": BF16, "rows": rows,
            "scale_overhead": overhead, "targets": targets}  # fmt: skip


def r4(x: float) -> float:
    return round(x, 4)


def by_name(targets: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``bench.targets.target`` records keyed by their names (the JSON's ``targets`` maps)."""
    return {t["name"]: t for t in targets}
