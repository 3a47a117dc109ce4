"""``swaserve bench prefix-cache``: the trace replay through the real prefix cache (short slices)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bench.kv_capacity import model_config
from bench.prefix_cache import SHAPE, bench_trace, replay
from bench.prefix_workload import (
    AGENT_TRACE,
    CONVERSATION_TRACE,
    BenchInputError,
    footprint_bytes,
    full_plan,
    hybrid_plan,
    ideal_of,
    load_workload,
)
from swaserve.cli import app

CFG = model_config(SHAPE)


def _sane(rec: dict[str, Any]) -> None:
    for key in ("hit_rate", "ideal_hit_rate", "full_layout_hit_rate", "device_hit_rate", "host_hit_rate"):
        assert key in rec
    ideal = rec["ideal_hit_rate"]
    assert 0 < ideal <= 1
    for layout in ("hybrid", "full"):
        r = rec[layout]
        assert r["hits_device"] + r["hits_host"] <= rec["ideal_hit_tokens"]
        assert r["prompt_tokens"] == rec["prompt_tokens"]
        assert 0 <= r["device_hit_rate"] <= r["hit_rate"] <= ideal + 1e-4
        assert r["device_hit_rate"] + r["host_hit_rate"] == pytest.approx(r["hit_rate"], abs=2e-4)
        assert r["rejected"] == r["stalled"] == 0
    assert rec["hit_rate"] == rec["hybrid"]["hit_rate"]
    assert rec["full_layout_hit_rate"] == rec["full"]["hit_rate"]
    assert rec["device_hit_rate"] + rec["host_hit_rate"] == pytest.approx(rec["hit_rate"], abs=2e-4)


def test_conversation_slice_hybrid_beats_full_at_equal_bytes() -> None:
    rec = bench_trace(CONVERSATION_TRACE, limit=200, curve=False)
    _sane(rec)
    assert rec["kind"] == "mooncake" and rec["requests"] == 200
    assert rec["device_budget_share"] == 0.25 and rec["host_budget_bytes"] == 0
    assert rec["hybrid"]["device_bytes"] <= rec["device_budget_bytes"]
    assert rec["full"]["device_bytes"] <= rec["device_budget_bytes"]
    assert rec["full"]["full_pages"] == rec["full"]["swa_pages"]
    # a tight budget (on fewer requests the full layout still holds their whole working set):
    # the full layout keeps a quarter of the distinct pages, the hybrid most of them
    assert rec["hit_rate"] > rec["full_layout_hit_rate"]
    assert rec["swa_full_tokens_ratio"] is None  # no flag: one shared budget, adaptive split
    assert 0 < rec["hybrid_swa_byte_share"] <= 1
    assert rec["targets"] == {}  # the targets are over the curve (and the whole trace)


def test_fixed_ratio_is_an_explicit_override_and_the_sweep_finds_the_best() -> None:
    rec = bench_trace(CONVERSATION_TRACE, limit=40, curve=False, swa_ratio=0.2)
    assert rec["swa_full_tokens_ratio"] == 0.2 and rec["hybrid"]["swa_ratio"] == 0.2
    assert rec["hybrid_swa_byte_share"] == pytest.approx(0.545, abs=0.01)  # 0.2 x 6 / (1 + 0.2 x 6)


def test_mooncake_ideal_from_ids_matches_token_pages() -> None:
    work = load_workload(CONVERSATION_TRACE, 40)
    assert ideal_of(work.prompts()) == (work.ideal_hits, work.unique_pages)
    assert work.prompt_tokens == sum(len(p) for p in work.prompts())


@pytest.mark.parametrize("cache_partial", [False, True])
def test_infinite_budget(cache_partial: bool) -> None:
    """With room for everything, the full layout reaches the ideal; so does the hybrid when every
    chunk's SWA KV is cached (without ``cache_partial`` only each prompt's last chunk and the points
    where a prompt left the tree keep it, so the first request that branches off deep inside an
    earlier prompt misses; later ones at the same point hit)."""
    work = load_workload(CONVERSATION_TRACE, 40)
    big = 2 * footprint_bytes(CFG, work.unique_pages)
    full = replay(CFG, work, "full", full_plan(CFG, big), cache_partial=cache_partial)
    assert full.hits == work.ideal_hits and full.hits_host == 0
    hyb = replay(CFG, work, "hybrid", hybrid_plan(CFG, big, swa_ratio=1.0), cache_partial=cache_partial)
    assert hyb.hits <= work.ideal_hits
    if cache_partial:
        assert hyb.hits == work.ideal_hits
    else:
        assert hyb.hits > 0.9 * work.ideal_hits


def test_agent_slice_with_host_tier() -> None:
    rec = bench_trace(AGENT_TRACE, limit=60, curve=False)
    _sane(rec)
    assert rec["kind"] == "agent" and rec["requests"] == 60
    assert rec["host_budget_share"] == 1.0  # default: a host tier that holds the working set
    assert rec["hybrid"]["host_full_pages"] > 0 and rec["full"]["host_full_pages"] > 0
    # with the whole working set on host, the full layout misses nothing the ideal hits
    assert rec["full_layout_hit_rate"] == rec["ideal_hit_rate"]
    assert rec["ideal_hit_rate"] > 0.5  # consecutive calls of a session share their history


def test_request_larger_than_pools_is_counted_not_fatal() -> None:
    work = load_workload(CONVERSATION_TRACE, 10)
    longest = max(len(p) for p in work.prompts())
    pbf_pbs = footprint_bytes(CFG, 1)
    r = replay(CFG, work, "full", full_plan(CFG, pbf_pbs * (longest // 16 // 2)))
    assert r.rejected >= 1
    assert r.prompt_tokens == work.prompt_tokens
    with pytest.raises(BenchInputError):
        full_plan(CFG, 1000)


def _cli(*args: str) -> Any:
    base = ["bench", "prefix-cache", "--trace", str(CONVERSATION_TRACE), "--jobs", "1"]
    return CliRunner().invoke(app, [*base, *args])


@pytest.mark.slow
def test_cli_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "pc.json"
    res = _cli("--limit", "30", "--json", str(out))
    assert res.exit_code == 0, res.output
    assert "hit-rate curve" in res.output.lower() and "hybrid" in res.output
    rec = json.loads(out.read_text())
    _sane(rec)
    assert {(c["device_share"], c["host_share"]) for c in rec["curve"]} >= {(0.25, 0.0), (0.25, 1.0)}
    for c in rec["curve"]:
        for layout in ("adaptive", "full"):
            assert 0 <= c[layout]["device_hit_rate"] <= c[layout]["hit_rate"] <= rec["ideal_hit_rate"] + 1e-4
        if c["host_share"] == 0:  # the sweep of fixed ratios and the best of them in hindsight
            assert set(c["fixed"]) == {str(round(r, 4)) for r in rec["fixed_ratios"]}
            assert c["best_fixed_hit_rate"] == max(c["fixed"].values())
            assert c["fixed"][str(c["best_fixed_ratio"])] == c["best_fixed_hit_rate"]
    at = next(c for c in rec["curve"] if (c["device_share"], c["host_share"]) == (0.25, 0.0))
    assert at["adaptive"]["hit_rate"] == rec["hit_rate"]  # the same replay as the headline numbers
    assert any("best fixed ratio" in k for k in rec["targets"])
    share = _cli("--limit", "20", "--no-curve", "--budget-share", "0.05", "--json", str(out))
    assert share.exit_code == 0, share.output
    assert json.loads(out.read_text())["device_budget_share"] == 0.05
    bad = _cli("--limit", "5", "--budget", "1MB")
    assert bad.exit_code == 2 and "too small" in bad.output


@pytest.mark.slow
def test_reuse_takes_only_policy_independent_replays(tmp_path: Path) -> None:
    """--reuse: the full layout and the fixed ratios come from the earlier JSON, the adaptive
    split is replayed; a record of another slice is not used."""
    first, second, other = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    curve = ["--curve-share", "0.05", "--curve-share", "0.25"]  # two points of the curve: 1/3 of the replays
    assert _cli("--limit", "30", *curve, "--json", str(first)).exit_code == 0
    res = _cli("--limit", "30", *curve, "--json", str(second), "--reuse", str(first))
    assert res.exit_code == 0, res.output
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["reused"] == [] and b["reused"]
    assert all(t[0] == "full" or t[1] is not None for t in b["reused"])  # never an adaptive replay
    # every full-layout and fixed-ratio row of the curve (the main full replay is its 0.25 point)
    assert len(b["reused"]) == sum(1 + len(r.get("fixed", {})) for r in a["curve"] if "error" not in r)
    assert b["full"] == a["full"]
    for ra, rb in zip(a["curve"], b["curve"], strict=True):
        if "error" not in ra:
            assert rb["fixed"] == ra["fixed"] and rb["full"]["hit_rate"] == ra["full"]["hit_rate"]
            assert rb["adaptive"]["hit_rate"] == ra["adaptive"]["hit_rate"]  # replayed: deterministic
    res = _cli("--limit", "20", *curve, "--json", str(other), "--reuse", str(first))  # another slice
    assert res.exit_code == 0 and json.loads(other.read_text())["reused"] == []
    older = dict(a, eviction_rev=a["eviction_rev"] - 1)  # rows replayed with another eviction order
    first.write_text(json.dumps(older))
    res = _cli("--limit", "30", *curve, "--json", str(other), "--reuse", str(first))
    assert res.exit_code == 0 and json.loads(other.read_text())["reused"] == []
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert _cli("--limit", "20", "--reuse", str(bad)).exit_code != 0


def test_curve_share_replays_only_those_points(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    res = _cli("--limit", "20", "--curve-share", "0.05", "--curve-share", "0.1", "--json", str(out))
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["curve"]
    assert sorted({(r["device_share"], r["host_share"]) for r in rows}) == [
        (0.05, 0.0),
        (0.05, 1.0),
        (0.1, 0.0),
        (0.1, 1.0),
    ]
