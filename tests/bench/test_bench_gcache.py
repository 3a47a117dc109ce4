"""``swaserve bench gcache`` with tiny settings: every cell measured and read back intact, the
baseline present (or reported missing), the simulator's hit rates in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.gcache import baseline_settings
from services.gcache import ucx
from swaserve.cli import app

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # starts GCache nodes and ucx_perftest

SIZES = (64 << 10, 256 << 10)
EPS = 0.01  # hit-rate slack: the runs route (and so cache) a little differently


def test_bench_gcache_tiny(tmp_path: Path) -> None:
    out = tmp_path / "gcache.json"
    args = ["bench", "gcache", "--json", str(out), "--sizes", "64KiB,256KiB", "--iters", "8"]
    args += ["--perftest-bytes", "2MiB", "--limit", "120", "--copies", "1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert "Targets (issue 17)" in res.output

    transports = ["ucx", "grpc"] if ucx.available() else ["grpc"]
    rows = data["rows"]
    cells = {(r["tier"], r["transport"], r["size_bytes"]) for r in rows}
    assert cells == {(t, x, s) for t in ("dram", "nvme") for x in transports for s in SIZES}
    assert len(rows) == len(cells)
    for r in rows:
        n = r["objects"]
        assert n == 8 and r["stored"] == n
        assert r["mismatches"] == 0
        assert r["bytes_put"] == r["bytes_got"] == n * r["size_bytes"]  # objects are exactly the size
        assert r["digest_got"] == r["digest_put"]  # every object the client returned, byte for byte
        assert r["batch"] == 2 and r["batch_calls"] == 4  # n // BATCH_CALLS objects per call
        assert r["bytes_batch_got"] == r["batch_calls"] * r["batch"] * r["size_bytes"]
        assert r["pages_in_tier"] == n  # the NVMe node's pages really are on NVMe
        assert r["held_after_get"].get(r["tier"]) == n
        for op in ("put", "get", "batch_get", "lookup"):
            assert 0 < r[f"{op}_p50_ms"] <= r[f"{op}_p99_ms"]
        for op in ("put", "get", "batch_get"):
            assert r[f"{op}_mib_s"] > 0

    base = data["baseline"]
    if base["rows"]:
        assert [b["size_bytes"] for b in base["rows"]] == list(SIZES)
        assert all(b["mb_per_s"] > 0 for b in base["rows"])
        # UCX's defaults and the node's settings, before and after the cells
        assert [r["label"] for r in base["runs"]] == ["ucx defaults", "node settings"] * 2
        node = baseline_settings()["node settings"]
        assert node["UCX_RNDV_SCHEME"] == "put_zcopy" and "UCX_TLS" not in node
        assert all(b["ucx_env"] in ({}, node) for b in base["rows"])  # the settings each best run had
    else:
        assert base.get("missing") or base.get("error")

    sims = {s["workload"]: s for s in data["sessions"]}
    assert set(sims) == {"conversation", "agent"}
    for s in sims.values():
        runs = {r["mode"]: r for r in s["runs"]}
        assert set(runs) == {"without_l3", "with_l3", "ideal"}
        assert all(r["requests"] == s["requests"] > 0 for r in runs.values())
        off, l3, ideal = (runs[m]["hit_rate"] for m in ("without_l3", "with_l3", "ideal"))
        bound = s["bound_hit_rate"]
        # the ideal's caches are per instance, L3 is shared: with L3 may beat the ideal, never
        # one infinite cache shared by all instances (the bound)
        assert 0 <= off <= l3 + EPS and off <= ideal + EPS
        assert l3 <= bound + EPS and ideal <= bound + EPS
        assert runs["without_l3"]["l3_hit_rate"] == runs["ideal"]["l3_hit_rate"] == 0
        assert 0 <= runs["with_l3"]["l3_hit_rate"] <= l3
        for r in runs.values():
            assert 0 < r["ttft_p50"] <= r["ttft_p90"]
    names = {t["name"] for t in data["targets"]}
    assert {"ucx_get_p50_ms_64KiB", "agent_hit_with_l3_over_ideal"} <= names
    assert all(t["status"] in ("PASS", "MISS", "N/A") for t in data["targets"])
