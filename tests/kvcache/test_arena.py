"""The shared KV arena: layouts of the real shapes, unit tables of pools on one budget, and the
storage's views: every (kind, layer, page) lands in its own bytes, whatever the mix of pages."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.kvcache import invariants
from swaserve.kvcache.arena import arena_layout
from swaserve.kvcache.budget import ByteBudget
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.sizing import host_plan, page_bytes, plan_pools
from swaserve.kvcache.storage import KVStorage
from swaserve.shapes import model_config, shape


def test_layouts_of_the_real_shapes() -> None:
    pro = model_config(shape("MiMo-V2.5-Pro"))  # 10 full + 60 SWA layers, 8 KV heads each
    a = arena_layout(pro, 64, 2)
    pbf, pbs = page_bytes(pro, 64, 2)
    assert (a.unit_bytes, a.page_bytes(FULL), a.page_bytes(SWA)) == (pbf, pbf, pbs)  # no padding
    assert a.units_per_page == {FULL: 1, SWA: 6} and [p.group for p in a.places[SWA]] == [
        g for g in range(6) for _ in range(10)
    ]
    flash = model_config(shape("MiMo-V2-Flash"))  # 9 full layers of 4 KV heads, 39 SWA of 8
    b = arena_layout(flash, 64, 2)
    pbf, pbs = page_bytes(flash, 64, 2)
    assert b.unit_bytes == pbf and b.units_per_page[SWA] == 10  # 4 SWA layers per unit: 39 -> 10
    assert pbs < b.page_bytes(SWA) < pbs * 1.16  # padding: the 9th layer slot of each unit
    with pytest.raises(ValueError):
        arena_layout(dataclasses.replace(pro, layer_types=(FULL,) * 70), 64, 2)  # nothing to share


def test_pools_on_one_budget_take_distinct_units() -> None:
    budget = ByteBudget(10 * 100 + 7, unit_bytes=100)  # 10 units; 7 bytes rounded away
    assert budget.total == 1000 and budget.num_units == 10
    full, swa = PagePool(0, 100, 1, budget), PagePool(0, 300, 3, budget)
    assert (full.num_pages, swa.num_pages, swa.units_per_page) == (10, 3, 3)
    rng = random.Random(0)
    held: dict[str, list[int]] = {"full": [], "swa": []}
    for _ in range(300):
        pool, name = (full, "full") if rng.random() < 0.5 else (swa, "swa")
        if held[name] and rng.random() < 0.5:
            p = held[name].pop(rng.randrange(len(held[name])))
            pool.free([p])
        else:
            room = budget.available >= pool.page_bytes
            got = pool.allocate(1)
            assert (got is not None) == room
            held[name] += got or []
        units = [
            u
            for q, n in ((full, "full"), (swa, "swa"))
            for p in held[n]
            for u in q.units[p * q.units_per_page : (p + 1) * q.units_per_page]
        ]
        assert len(units) == len(set(units)) and all(0 <= u < 10 for u in units)
        assert len(units) + budget.free_units == 10 and budget.used == 100 * len(units)
    with pytest.raises(ValueError):
        PagePool(0, 150, 1, budget)  # not whole units


def _arena_storage(tiny_dir: Path, page: int, budget: int) -> tuple[ModelConfig, KVCacheManager, KVStorage]:
    cfg = ModelConfig.from_pretrained(tiny_dir)
    ecfg = EngineConfig(page_size=page, kv_cache_memory=budget)
    plan = plan_pools(cfg, ecfg, 4, shared=True, arena=arena_layout(cfg, page, 4))
    kv = KVCacheManager(
        plan, page, cfg.window, "hybrid", len(cfg.full_layers), len(cfg.swa_layers), prefix_caching=True
    )
    st = KVStorage(cfg, plan, page, torch.float32, "cpu")
    st.bind(FULL, kv.full.pool)
    st.bind(SWA, kv.swa.pool)
    return cfg, kv, st


def test_arena_views_never_overlap(tiny_dir: Path) -> None:
    """Fill every layer of every held page with its own label, churning pages of both kinds; each
    read gives back its label, and the arena holds nothing else."""
    _, kv, st = _arena_storage(tiny_dir, 4, 40 * 1536)
    assert st.arena is not None and kv.budget is not None and st.nbytes() == kv.budget.total
    rng = random.Random(1)
    pools = {FULL: kv.full.pool, SWA: kv.swa.pool}
    held: dict[tuple[str, int], float] = {}
    label = 0.0
    for _ in range(200):
        kind = rng.choice((FULL, SWA))
        pages = [p for k, p in held if k == kind]
        if pages and rng.random() < 0.4:
            p = rng.choice(pages)
            slots = torch.arange(p * 4, p * 4 + 4)
            for j in range(len(st.kv[kind][0])):  # wiped, so stray writes show below
                k, v = st.read(kind, j, slots)
                st.write(kind, j, slots, torch.zeros_like(k), torch.zeros_like(v))
            pools[kind].free([p])
            del held[(kind, p)]
            continue
        got = pools[kind].allocate(1)
        if got is None:
            continue
        label += 1
        held[(kind, got[0])] = label
        slots = torch.arange(got[0] * 4, got[0] * 4 + 4)
        for j in range(len(st.kv[kind][0])):
            k, v = st.read(kind, j, slots)
            st.write(
                kind, j, slots, torch.full_like(k, label * 100 + j), torch.full_like(v, -label * 100 - j)
            )
    seen = 0
    for (kind, p), lab in held.items():
        slots = torch.arange(p * 4, p * 4 + 4)
        for j in range(len(st.kv[kind][0])):
            k, v = st.read(kind, j, slots)
            assert bool((k == lab * 100 + j).all()) and bool((v == -lab * 100 - j).all()), (kind, p, j)
            seen += k.numel() + v.numel()
    assert seen == int((st.arena != 0).sum())  # no stray writes, no padding written
    for kind, p in held:
        pools[kind].free([p])
    invariants.check(kv)  # the arena: every unit free again, no page maps to one


def test_host_plan_needs_one_page_of_each_kind() -> None:
    """A host budget between one full page and one full + one SWA page is refused with that
    reason (it used to pass the check and fail later: no SWA host page to copy to)."""
    pro = model_config(shape("MiMo-V2.5-Pro"))
    pbf, pbs = page_bytes(pro, 16, 2)
    for ratio in (None, 0.2):
        ecfg = EngineConfig(page_size=16, kv_cache_memory=1000 * pbs, swa_full_tokens_ratio=ratio)
        plan = plan_pools(pro, ecfg, 2, shared=True, arena=arena_layout(pro, 16, 2))
        assert (plan.shared_bytes is not None) == (ratio is None)
        with pytest.raises(ValueError, match="one full page and one SWA page"):
            host_plan(plan, pbf + pbs - 1)
        full, swa = host_plan(plan, pbf + pbs)
        assert full >= 1 and swa >= 1 and (ratio is not None or (full, swa) == ((pbf + pbs) // pbf, 1))
