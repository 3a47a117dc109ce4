"""Exactness of prefix hits from L3 (GCache) in the real engine (tiny checkpoint, W = 8).

Engine A runs the multi-turn workload with a host tier and an L3 store, then flushes its device
and host caches (every host copy is written back to L3). Engine B, a fresh engine on the same L3
store, runs the workload again: its first turns hit L3, and greedy outputs and log-probabilities
equal the cache-off run's (tests/engine/test_prefix_cache_engine.py's workload and tolerances).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.gcache.l3 import local_store
from swaserve.kvcache import invariants
from tests.engine.test_prefix_cache_engine import CONFIGS, workload
from tests.model.test_kv_quant_exact import TOL_FLIP

_names = itertools.count()


def l3_config(**kw) -> EngineConfig:  # type: ignore[no-untyped-def]
    url = f"local://l3-engine-{next(_names)}"
    return dataclasses.replace(CONFIGS["host-tier"], l3_url=url, l3_min_tokens=8, weights_id="tiny", **kw)


def assert_same(got, base) -> None:  # type: ignore[no-untyped-def]
    for rid, r in got.items():
        b = base[rid]
        assert r.tokens == b.tokens, f"{rid} differs with L3"
        for (lp, top), (blp, btop) in zip(r.logprobs, b.logprobs, strict=True):
            assert abs(lp - blp) <= 1e-4
            assert [t for t, _ in top] == [t for t, _ in btop]


def test_engine_b_hits_what_engine_a_wrote(tiny_dir: Path) -> None:
    base = workload(LLMEngine(tiny_dir, EngineConfig(page_size=4, enable_prefix_caching=False)), seed=7)
    cfg = l3_config()
    a = LLMEngine(tiny_dir, cfg)
    assert a.core.l3 is not None
    assert_same(workload(a, seed=7), base)
    a.kv.flush_cache()
    a.core.l3.flush_puts()
    assert a.core.l3.stats["put_pages"] > 0
    store = local_store(cfg.l3_url.split("://")[1])  # type: ignore[union-attr]
    assert store.usage()["dram"]["pages"] > 0
    b = LLMEngine(tiny_dir, cfg)
    got = workload(b, seed=7)
    assert_same(got, base)
    st = b.kv.cache.stats  # type: ignore[union-attr]
    assert st.hits_l3 > 0, f"no L3 hit: {dict(b.core.l3.stats)}"  # type: ignore[union-attr]
    assert sum(r.cached for r in got.values()) == st.hits_device + st.hits_host + st.hits_l3
    # each request's output says where its hit came from (the router sums these per tier)
    assert sum(r.cached_l3 for r in got.values()) == st.hits_l3
    assert sum(r.cached_host for r in got.values()) == st.hits_host + st.hits_l3
    invariants.check(b.kv)
    b.kv.flush_cache()
    invariants.check(b.kv)
    for p in b.stats().pools.values():
        assert p.used_pages == 0


def test_another_salt_never_hits(tiny_dir: Path) -> None:
    """A different weights identity (a fine-tune) shares the store but never reads its pages."""
    cfg = l3_config()
    a = LLMEngine(tiny_dir, cfg)
    workload(a, seed=3)
    a.kv.flush_cache()
    a.core.l3.flush_puts()  # type: ignore[union-attr]
    b = LLMEngine(tiny_dir, dataclasses.replace(cfg, weights_id="tiny-finetune"))
    workload(b, seed=3)
    assert b.kv.cache.stats.hits_l3 == 0  # type: ignore[union-attr]
    assert b.core.l3.stats["lookup_misses"] > 0  # type: ignore[union-attr]


def test_puts_carry_the_routers_index_blocks(tiny_dir: Path) -> None:
    """With cache events on, each full page that completes an index block carries its key, so the
    node can publish the L3 copies for the routers (and removes them when it drops the page): the
    keys and depths are those of the engine's own cache events."""
    cfg = l3_config(index_block_tokens=8)
    a = LLMEngine(tiny_dir, cfg)
    workload(a, seed=5)
    depth: dict[int, int] = {}
    for ev in a.kv.drain_cache_events(0.0, resync=True):
        if ev.op == "stored":
            depth.update({h: ev.depth + j for j, h in enumerate(ev.hashes)})
    a.kv.flush_cache()
    a.core.l3.flush_puts()  # type: ignore[union-attr]
    store = local_store(cfg.l3_url.split("://")[1])  # type: ignore[union-attr]
    stored = {b.key: b for op, b in store.events if op == "stored"}
    assert len(stored) > 5 and {b.key for b in store.blocks()} == set(stored)
    for b in stored.values():
        assert depth[b.key] == b.depth
        assert (b.parent is None) == (b.depth == 0)
        if b.parent is not None:
            assert depth[b.parent] == b.depth - 1
    store.remove([next(pid for pid, e in store.index.items() if e.block is not None and e.block.depth == 0)])
    assert any(op == "removed" for op, _ in store.events)


@pytest.mark.parametrize(
    "quant",
    [
        pytest.param({"kv_cache_dtype": "int8", "kv_cache_dtype_swa": "fp8_e4m3"}, id="int8-fp8"),
        pytest.param({"kv_cache_dtype": "kivi4"}, id="kivi4", marks=pytest.mark.slow),
        pytest.param(
            {"kv_cache_dtype": "int8", "kv_sink_tokens": 3}, id="int8-sink3", marks=pytest.mark.slow
        ),
    ],
)
def test_quantized_pages_round_trip_through_l3_and_another_format_never_hits(
    tiny_dir: Path, quant: dict
) -> None:  # type: ignore[type-arg]
    """Packed int8 / fp8 rows go to L3 and come back byte for byte (engine B's outputs equal
    the cache-off run of the same format); an engine of another KV format on the same store never
    reads them (the format is in the salt), nor does an unquantized one."""
    off = EngineConfig(page_size=4, max_num_batched_tokens=64, enable_prefix_caching=False, **quant)  # type: ignore[arg-type]
    base = workload(LLMEngine(tiny_dir, off), seed=7)
    cfg = l3_config(**quant)
    a = LLMEngine(tiny_dir, cfg)
    workload(a, seed=7)
    a.kv.flush_cache()
    a.core.l3.flush_puts()  # type: ignore[union-attr]
    b = LLMEngine(tiny_dir, cfg)
    got = workload(b, seed=7)
    assert b.kv.cache.stats.hits_l3 > 0  # type: ignore[union-attr]
    for rid, r in got.items():  # chunk boundaries moved with the hits: one code flip allowed
        assert r.tokens == base[rid].tokens, rid
        assert all(
            abs(x - y) <= TOL_FLIP for (x, _), (y, _) in zip(r.logprobs, base[rid].logprobs, strict=True)
        )
    others: list[dict] = [{"kv_cache_dtype": "auto", "kv_cache_dtype_swa": None}, {"kv_quant_group": 8}]  # type: ignore[type-arg]
    others += (
        [{"kv_cache_dtype": "kivi2"}, {"kv_kivi_residual": 4}]
        if "kivi" in quant["kv_cache_dtype"]
        else [{"kv_cache_dtype_swa": "int8"}]
    )
    if quant.get("kv_sink_tokens"):  # another sink count reads other values: never a hit
        others = [{"kv_sink_tokens": 0}, {"kv_sink_tokens": 2}]
    for other in others:
        c = LLMEngine(tiny_dir, dataclasses.replace(cfg, **other))  # type: ignore[arg-type]
        workload(c, seed=7)
        assert c.kv.cache.stats.hits_l3 == 0, other  # type: ignore[union-attr]
