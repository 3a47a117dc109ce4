"""``swaserve bench ep --quick`` on the tiny model: every part runs and its JSON holds together (the
EP ranks' greedy first tokens equal EP 1's, every prompt token is computed on some rank, the
balance is a share in (0, 1] per MoE layer, the planner's and the simulator's rows are consistent)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swaserve.cli import app
from swaserve.config import ModelConfig

pytestmark = pytest.mark.cluster  # starts engine-core and EP rank processes


@pytest.mark.slow
def test_bench_ep_quick(tmp_path: Path, tiny_dir: Path) -> None:
    out = tmp_path / "ep.json"
    res = CliRunner().invoke(app, ["bench", "ep", "--quick", "--json", str(out), "--model", str(tiny_dir)])
    assert res.exit_code == 0, res.output
    assert "not a speedup" in res.output and "hybrid halves EP" in res.output
    data = json.loads(out.read_text())
    cfg = ModelConfig.from_pretrained(tiny_dir)
    moe_layers = cfg.mlp_types.count("sparse")

    pre, s = data["prefill"], data["settings"]
    w = pre["workload"]
    assert w["requests"] == s["requests"] and w["tokens_per_round"] == s["requests"] * s["prompt_tokens"]
    rows = pre["rows"]
    assert [(r["arrangement"], r["ep"]) for r in rows] == [
        (a, ep) for a in ("one-core", "all-cores") for ep in (1, 2)
    ]
    for r in rows:
        assert len(r["tok_s"]) == s["rounds"] and r["best_tok_s"] >= r["median_tok_s"] > 0
        assert r["first_tokens_equal_ep1"] == w["requests"] and r["mismatches"] == []
        assert len(r["rank_prompt_tokens"]) == r["ep"]
        assert sum(r["rank_prompt_tokens"]) == w["tokens_per_round"] * s["rounds"]  # warm-up excluded
        if r["ep"] == 1:
            assert r["vs_ep1_best"] == 1.0 and "balance" not in r
            continue
        assert min(r["rank_prompt_tokens"]) > 0  # data-parallel attention: both ranks got requests
        b = r["balance"]
        assert len(b["per_layer"]) == moe_layers and all(0 < x <= 1 for x in b["per_layer"])
        assert b["min_layer"] <= b["token_weighted_mean"] <= b["max_layer"]
        assert len(set(b["mean_rows_sum"])) == 1  # every MoE layer routes every token ...
        assert b["token_weighted_mean"] == pytest.approx(
            statistics.mean(b["per_layer"])
        )  # ... so equal weights
        # rows = tokens x top-k summed over the ranks: the mean per rank over the steps
        assert b["mean_rows_sum"][0] * r["ep"] == pytest.approx(
            w["tokens_per_round"] * s["rounds"] * cfg.num_experts_per_tok
        )
    one_core = [r for r in rows if r["arrangement"] == "one-core"]
    assert all(r["threads_per_rank"] == 1 and r["cpus"] is not None and len(r["cpus"]) == 1 for r in one_core)

    plan = data["plan"]
    assert {r["model"] for r in plan["rows"]} == {"MiMo-V2-Flash", "MiMo-V2.5-Pro"}
    for r in plan["rows"]:
        if r["full_ep"] is not None and r["hybrid_ep"] is not None:
            assert r["hybrid_ep"] <= r["full_ep"] and r["full_over_hybrid"] == r["full_ep"] / r["hybrid_ep"]
        assert r["hybrid_halves"] == (
            r["hybrid_ep"] is not None and (r["full_ep"] is None or r["full_ep"] >= 2 * r["hybrid_ep"])
        )
    flash = next(r for r in plan["rows"] if r["model"] == "MiMo-V2-Flash" and r["context"] == 32768)
    assert (flash["full_ep"], flash["hybrid_ep"]) == (8, 4)  # plan-ep's sweep, hand-checked in its tests

    sim = data["sim"]
    assert len(sim["pairs"]) == len(s["sim_eps"]) * len(s["sim_loads"])
    for p in sim["pairs"]:
        n, half = p["ep_n"], p["ep_half"]
        assert (n["prefill_ep"], half["prefill_ep"]) == (p["ep"], p["ep"] // 2)
        assert (
            n["prefill_gpus"] == half["prefill_gpus"] == sim["gpus"] and half["prefill"] == 2 * n["prefill"]
        )
        assert n["requests"] == half["requests"] == sim["requests"] and n["time_scale"] == half["time_scale"]
        assert p["prompt_tok_s_ratio"] == pytest.approx(half["prompt_tok_s"] / n["prompt_tok_s"])


def test_bench_ep_refuses_an_ep_that_does_not_divide(tiny_dir: Path) -> None:
    res = CliRunner().invoke(app, ["bench", "ep", "--ep", "3", "--model", str(tiny_dir)])
    assert res.exit_code == 2 and "do not divide" in res.output
