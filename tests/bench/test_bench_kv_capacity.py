"""bench kv-capacity on V2.5-Pro at 32K: bytes per request from the real allocator, and the requests
that fit with and without the prefix cache's SWA reserve."""

from __future__ import annotations

from bench.kv_capacity import capacity
from swaserve.shapes import SHAPES, model_config


def test_pro_at_32k_holds_the_hybrid_bytes_and_the_cache_reserve_costs_requests() -> None:
    cfg = model_config(next(s for s in SHAPES if s.name == "MiMo-V2.5-Pro"))
    n_h, b_h = capacity(cfg, "hybrid", 32768)
    n_c, b_c = capacity(cfg, "hybrid", 32768, cache=True)
    n_f, b_f = capacity(cfg, "full", 32768)
    full_tok = len(cfg.full_layers) * cfg.full.kv_bytes_per_token(2)
    swa_tok = len(cfg.swa_layers) * cfg.swa.kv_bytes_per_token(2)
    # a request holds its 32,769 tokens in full pages of 16 and 9 SWA pages (ceil(128 / 16) + 1)
    assert b_h == b_c == full_tok * 16 * 2049 + swa_tok * 16 * 9
    assert b_f == (full_tok + swa_tok) * 16 * 2049
    assert (n_h, n_f) == (44, 6)  # 80 GB / bytes per request, less the planner's margins
    assert n_f < n_c < n_h  # the reserve's SWA pages come out of the running requests' bytes
