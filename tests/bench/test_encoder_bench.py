"""``swaserve bench encoder --quick``: both encoders serve every request, every optimized embedding
is compared with the baseline's (and equal within the tolerance), the baseline encodes every
request while the optimized one encodes each distinct image once, the video decodes are equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swaserve.cli import app

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # starts two encoder processes


def test_bench_encoder_quick(tmp_path: Path, tiny_dir: Path) -> None:
    out = tmp_path / "encoder.json"
    args = ["bench", "encoder", "--quick", "--json", str(out), "--model", str(tiny_dir)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Targets (issue 18)" in res.output
    data = json.loads(out.read_text())

    svc, w = data["service"], data["service"]["workload"]
    sizes = {"closed": w["closed_requests"], "open": w["open_requests"]}
    distinct = {"closed": w["closed_distinct_items"], "open": w["open_distinct_items"]}
    assert w["closed_popular_requests"] > 0 and distinct["closed"] < sizes["closed"]  # some repeat
    for phase, n in sizes.items():
        base, opt = svc["baseline"][phase], svc["optimized"][phase]
        for r in (base, opt):
            assert r["requests"] == r["done"] == n and r["errors"] == 0, r["error_samples"]
            assert r["items_per_s"] > 0 and 0 < r["p50_ms"] <= r["p90_ms"]
        # baseline: one item per forward, nothing cached or joined (a key per request)
        be = base["encoder"]
        assert be["items_cached"] == 0 and be["items_encoded"] == n + base["resubmits"]
        assert be["forwards"] == be["items_encoded"] and be["mean_batch_items"] == 1.0
        # optimized: each distinct image encoded once, the repeats served from cache or in flight
        oe = opt["encoder"]
        assert oe["items_encoded"] == distinct[phase] and oe["items_cached"] == n - distinct[phase]
        assert opt["resubmits"] == 0
    assert (
        svc["optimized"]["open"]["offered_items_per_s"] == svc["baseline"]["open"]["offered_items_per_s"] > 0
    )

    hits = svc["optimized"]["hits"]  # the closed loop's requests again: all cached
    assert hits["done"] == sizes["closed"] and hits["errors"] == 0
    assert hits["encoder"]["items_encoded"] == 0 and hits["encoder"]["items_cached"] == sizes["closed"]

    check = svc["outputs_check"]  # every optimized fetch against the baseline's output
    assert check["compared"] == sum(sizes.values()) + sizes["closed"]
    assert check["over_tolerance"] == 0 and check["bad"] == 0 and check["max_abs_diff"] <= 1e-5
    base_check = svc["baseline_self_check"]
    assert base_check["recorded"] == sum(distinct.values()) and base_check["bad"] == 0
    assert base_check["max_abs_diff"] == 0.0  # alone, the same item gives the same rows

    prof = svc["profile"]
    assert (
        prof["items"] > 0
        and min(prof[k] for k in ("decode_preprocess_ms", "encode_alone_ms", "encode_batched_ms")) > 0
    )

    assert set(data["ratios"]) == {"closed_items_per_s", "closed_p50", "closed_p90", "open_p50", "open_p90"}
    assert all(v is not None and v > 0 for v in data["ratios"].values())

    video = data["video_decode"]
    assert [r["threads"] for r in video["rows"]] == [1, 2, 4]
    assert all(r["equal_to_1_thread"] and r["best_s"] > 0 for r in video["rows"])
    assert video["sampled_frames"] == video["output_shape"][0] > 0 and video["cpus"] >= 1

    names = {t["name"] for t in data["targets"]}
    assert {"throughput_optimized_over_baseline", "p50_optimized_over_baseline"} <= names
    assert {"video_decode_speedup_2_threads", "video_decode_speedup_4_threads"} <= names
    assert all(t["status"] in ("PASS", "MISS", "N/A") for t in data["targets"])
