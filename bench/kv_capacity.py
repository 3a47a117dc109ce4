"""KV capacity of the hybrid layout vs an SWA-unaware (full) layout, by the real allocator.

For each public MiMo-V2 shape (``swaserve.shapes``) and context length, requests are admitted into an
80 GB KV budget (``plan_pools``), prefilled in chunks through ``KVCacheManager`` (no tensors) and take
one decode step; bf16 KV, page 16. ``ratio`` = full-layout / hybrid bytes per request;
``theoretical_ratio`` the same with exactly W SWA tokens (no paging). docs/DESIGN.md#benchkv_capacitypy"""

from __future__ import annotations

import json
from pathlib import Path

from swaserve.config import EngineConfig, ModelConfig
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.sizing import plan_pools
from swaserve.shapes import SHAPES, model_config

GB80 = 80 * 10**9
CONTEXTS = (4096, 32768, 131072)
PAGE = 16
CHUNK = 8192
DTYPE_BYTES = 2


def _fill(
    cfg: ModelConfig, layout: str, context: int, max_num_seqs: int, cache: bool = False
) -> tuple[int, int]:
    """Admit+prefill requests of ``context`` tokens until one does not fit (``cache``: pools planned
    with the prefix cache's SWA reserve).

    Returns (requests that fit, bytes the first one holds after its first decode step).
    """
    ecfg = EngineConfig(
        page_size=PAGE,
        kv_cache_memory=GB80,
        kv_layout=layout,  # type: ignore[arg-type]
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=CHUNK,
        enable_prefix_caching=cache,
    )
    kv = KVCacheManager(
        plan_pools(cfg, ecfg, DTYPE_BYTES),
        PAGE,
        cfg.window,
        layout,
        len(cfg.full_layers),
        len(cfg.swa_layers),
    )
    n, per_req = 0, 0
    while n < max_num_seqs:
        rid = f"r{n}"
        if kv.admit(rid, context + 1) is None:
            break
        done = 0
        while done < context:
            step = kv.max_chunk(rid, done, min(context, done + CHUNK))
            if step == 0 or not kv.allocate(rid, done, done + step):
                return n, per_req
            done += step
        kv.allocate(rid, context, context + 1)  # first decode step: the window slides past the chunk
        if n == 0:
            per_req = kv.held_bytes(rid)
        n += 1
    return n, per_req


def capacity(cfg: ModelConfig, layout: str, context: int, cache: bool = False) -> tuple[int, int]:
    """Most requests that fit (searching the expected-concurrency knob) and bytes per request."""
    lo, hi = 1, 1
    while _fill(cfg, layout, context, hi, cache)[0] >= hi:
        lo, hi = hi, hi * 2
    best = _fill(cfg, layout, context, lo, cache)
    while lo < hi:  # largest m such that m requests fit when the pools are planned for m
        mid = (lo + hi + 1) // 2
        got = _fill(cfg, layout, context, mid, cache)
        if got[0] >= mid:
            lo, best = mid, got
        else:
            hi = mid - 1
    return best


def rows() -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for s in SHAPES:
        cfg = model_config(s)
        full_tok = len(cfg.full_layers) * cfg.full.kv_bytes_per_token(DTYPE_BYTES)
        swa_tok = len(cfg.swa_layers) * cfg.swa.kv_bytes_per_token(DTYPE_BYTES)
        for ctx in CONTEXTS:
            n_h, b_h = capacity(cfg, "hybrid", ctx)
            n_f, b_f = capacity(cfg, "full", ctx)
            n_c = capacity(cfg, "hybrid", ctx, cache=True)[0]
            theory = (
                (full_tok + swa_tok)
                * (ctx + 1)
                / (full_tok * (ctx + 1) + swa_tok * min(ctx + 1, cfg.window + 1))
            )
            ratio = b_f / b_h
            out.append(
                {
                    "shape": s.name,
                    "context_tokens": ctx,
                    "hybrid_bytes_per_request": b_h,
                    "full_bytes_per_request": b_f,
                    "hybrid_requests_in_80GB": n_h,
                    "hybrid_requests_in_80GB_cache_plan": n_c,
                    "full_requests_in_80GB": n_f,
                    "ratio": round(ratio, 4),
                    "theoretical_ratio": round(theory, 4),
                    "ratio_vs_theoretical": round(ratio / theory, 4),
                }
            )
    return out


def main(json_path: str | None = None) -> list[dict[str, object]]:
    table = rows()
    hdr = (
        f"{'shape':<15}{'context':>9}{'hybrid MB/req':>15}{'full MB/req':>13}{'hyb reqs':>10}{'(cache)':>8}{'full reqs':>10}"
        f"{'ratio':>8}{'theory':>8}{'r/theory':>10}"
    )
    print("KV capacity in 80 GB (bf16 KV, page 16; real allocator); reqs: pools planned without the prefix")
    print("cache, (cache): with its SWA reserve (1/9 of the full pages; the engine's default)")
    print(hdr)
    for r in table:
        print(
            f"{r['shape']:<15}{r['context_tokens']:>9}{r['hybrid_bytes_per_request'] / 1e6:>15.1f}"  # type: ignore[operator]
            f"{r['full_bytes_per_request'] / 1e6:>13.1f}{r['hybrid_requests_in_80GB']:>10}"  # type: ignore[operator]
            f"{r['hybrid_requests_in_80GB_cache_plan']:>8}"
            f"{r['full_requests_in_80GB']:>10}{r['ratio']:>8}{r['theoretical_ratio']:>8}{r['ratio_vs_theoretical']:>10}"
        )
    at32 = [r for r in table if r["context_tokens"] == 32768]
    ok = all(float(r["ratio_vs_theoretical"]) >= 0.95 for r in at32)  # type: ignore[arg-type]
    print(f"target ratio >= 0.95 x theoretical at 32K: {'met' if ok else 'NOT met'}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"rows": table, "target_met_32k": ok}, indent=2))
    return table


if __name__ == "__main__":
    main()
