"""``swaserve bench kv-quant --quick`` on the tiny model: every part runs in this process (``--jobs 1``) and its JSON
holds together (exact byte ratios of the formats, auto vs auto KL 0 and full agreement, one hit
rate per page size; KIVI in the hybrid layout, its residual SWA layers counted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.kv_quant import ABLATIONS, QUICK, ROUNDINGS
from bench.kv_quant_capacity import FORMATS, KIVI_8BIT_SWA, formats_of, is_kivi, pool_config
from swaserve.cli import app
from swaserve.config import FULL, SWA, ModelConfig
from swaserve.kvformat import KIVI_FORMATS, ROW_FORMATS, KVFormat
from swaserve.shapes import SHAPES, model_config


@pytest.mark.slow
def test_bench_kv_quant_quick(tmp_path: Path, tiny_dir: Path) -> None:
    out = tmp_path / "kv_quant.json"
    res = CliRunner().invoke(
        app, ["bench", "kv-quant", "--quick", "--jobs", "1", "--json", str(out), "--model", str(tiny_dir)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())

    cap = data["capacity"]
    shapes = {s.name: model_config(s) for s in SHAPES}
    rows = {(r["shape"], r["context_tokens"], r["layout"], r["format"]): r for r in cap["rows"]}
    # KIVI only in the hybrid layout (its residual would keep every token in the full one)
    per_ctx = 2 * len(FORMATS) - len(KIVI_FORMATS) + len(KIVI_8BIT_SWA)  # KIVI+FP8 SWA: hybrid too
    assert len(rows) == len(QUICK.shapes) * len(QUICK.contexts) * per_ctx
    for (shape, ctx, layout, fmt), r in rows.items():
        cfg = shapes[shape]
        auto = rows[shape, ctx, layout, "auto"]
        f, s = cfg.full, cfg.swa
        fmts = formats_of(fmt, cfg)
        # one page's bytes: the format's bytes per token exactly, KIVI's residuals as SWA layers
        assert r["full_page_bytes"] == len(cfg.full_layers) * 16 * fmts[FULL].token_bytes(
            f.num_kv_heads, f.head_dim, f.v_head_dim, 2
        )
        n_swa = len(cfg.swa_layers) + (len(cfg.full_layers) if is_kivi(fmt) else 0)
        assert len(pool_config(cfg, fmts).swa_layers) == n_swa
        assert r["swa_page_bytes"] == n_swa * 16 * fmts[SWA].token_bytes(
            s.num_kv_heads, s.head_dim, s.v_head_dim, 2
        )
        if is_kivi(fmt):  # 2/4-bit full pages: fewer bytes than any 1-byte format's
            assert r["bytes_per_request"] < rows[shape, ctx, layout, "int8"]["bytes_per_request"]
        if fmt in KIVI_8BIT_SWA:  # an 8-bit SWA pool: fewer bytes than the same KIVI's bf16 one
            assert fmts[SWA] == KVFormat("fp8_e4m3")
            assert r["bytes_per_request"] < rows[shape, ctx, layout, fmt.split("+")[0]]["bytes_per_request"]
        if fmt in ROW_FORMATS:
            # head dims 192 / 128: a 1-byte row + one fp32 scale, (192 + 4 + 128 + 4) / (2 * 320)
            assert r["bytes_per_request"] * 640 == auto["bytes_per_request"] * 328
            assert r["requests_in_80GB"] > auto["requests_in_80GB"]
        assert 0.95 <= r["achieved_vs_theory"] <= 1.0
        assert r["ratio_vs_bf16_full"] >= 1.0
    assert rows["MiMo-V2.5-Pro", 32768, "full", "auto"]["ratio_vs_bf16_full"] == 1.0
    pro = rows["MiMo-V2.5-Pro", 32768, "hybrid", "fp8_e4m3"]
    hyb_auto = rows["MiMo-V2.5-Pro", 32768, "hybrid", "auto"]
    assert pro["ratio_vs_bf16_full"] >= 13.0 and pro["requests_in_80GB"] >= 2 * hyb_auto["requests_in_80GB"]
    assert cap["targets"] and all(t["status"] == "PASS" for t in cap["targets"].values())
    # a target carries the figure it judges, measured in this run
    for t in cap["targets"].values():
        assert t["op"] == ">=" and t["value"] >= t["threshold"]
    assert (
        cap["targets"]["fp8_e4m3: hybrid >= 13.0x less KV than bf16 full (V2.5-Pro, 32K)"]["value"]
        == (pro["ratio_vs_bf16_full"])
    )
    for r in rows.values():  # the prefix cache's SWA reserve only costs the hybrid layout requests
        assert r["requests_in_80GB_cache_plan"] <= r["requests_in_80GB"]
    for over in cap["scale_overhead"].values():
        assert [o["overhead"] for o in over] == [0.025, 0.0625, 0.125]  # 8 / 320, 4 / 64, 4 / 32

    m = data["model"]
    q = {r["format"]: r for r in m["quality"]}
    assert set(q) == set(FORMATS)
    assert q["auto"]["mean_kl"] == 0.0 and q["auto"]["max_kl"] == 0.0
    assert q["auto"]["rows_with_expert_flip"] == 0.0  # same KV, same routing
    # reference rows: auto pages rounded through bf16 / fp16 (the tiny model's KV is fp32) move
    # the logits, where auto vs auto does not; the wrapped pack is put back afterwards
    ref = {r["rounded_through"]: r for r in m["reference"]}
    assert list(ref) == list(ROUNDINGS)
    for name, r in ref.items():
        assert r["format"] == f"auto rounded via {name}" and r["formats"] == {"full": "auto", "swa": "auto"}
        assert 0 < r["mean_kl"] <= r["max_kl"]
    assert KVFormat.pack.__name__ == "pack"
    for r in m["quality"] + m["ablations"] + m["reference"]:
        assert 0 <= r["rows_with_expert_flip"] <= 1 and 0 <= r["kl_share_at_expert_flips"] <= 1
        assert r["median_kl"] <= r["max_kl"]
        if r["rows_with_expert_flip"] == 0:  # no flip: every row counts in the "without" mean
            assert (
                r["mean_kl_without_flips"] == pytest.approx(r["mean_kl"])
                and r["kl_share_at_expert_flips"] == 0
            )
    assert q["auto"]["agreement"] == [QUICK.new_tokens] * QUICK.prompts
    tiny = ModelConfig.from_pretrained(tiny_dir)
    for f in FORMATS:  # the engine's pages in the format, fp32 model: 4-byte auto elements
        assert q[f]["storage_bytes_match_plan"] is True
        # KIVI on the tiny model (W = 8): key group 8, residual 8
        fmt = KVFormat(f, 0, 8, 8) if f in KIVI_FORMATS else KVFormat(f)
        assert q[f]["formats"]["full"] == fmt.describe()
        assert q[f]["page_bytes"][0] == len(tiny.full_layers) * 16 * fmt.token_bytes(
            tiny.full.num_kv_heads, tiny.full.head_dim, tiny.full.v_head_dim, 4
        )
    assert QUICK.ablations is not None  # quick runs one ablation of each kind, each by its label
    assert [a["format"] for a in m["ablations"]] == [
        label for label, *_ in ABLATIONS if label in QUICK.ablations
    ]
    assert len(m["ablations"]) == len(QUICK.ablations)
    for a in m["ablations"]:  # sink tokens: another KV identity, and other logits than without
        if a["sink_tokens"]:
            assert a["formats"]["full"].endswith(f"/sink{a['sink_tokens']}")
            assert a["mean_kl"] != q[a["full_pool"]]["mean_kl"]
    for f in FORMATS[1:]:
        assert 0 < q[f]["mean_kl"] <= q[f]["max_kl"]
        assert all(0 <= a <= QUICK.new_tokens for a in q[f]["agreement"])
    assert m["timed_outputs_equal_greedy"] is True
    dec = {(d["batch"], d["format"]): d for d in m["decode"]}
    assert set(dec) == {(b, f) for b in QUICK.batches for f in FORMATS}
    for (b, _), d in dec.items():
        assert len(d["tok_s"]) == QUICK.rounds and d["median_tok_s"] > 0
        # vs_auto comes from the medians before they were rounded to 0.1 tok/s (then to 4 digits)
        med, auto_med = d["median_tok_s"], dec[b, "auto"]["median_tok_s"]
        assert (
            (med - 0.05) / (auto_med + 0.05) - 5e-5 <= d["vs_auto"] <= (med + 0.05) / (auto_med - 0.05) + 5e-5
        )

    h = data["hit_rate"]
    hits = {(r["layout"], r["format"]): r for r in h["rows"]}
    assert set(hits) == {(lay, f) for lay in ("hybrid", "full") for f in FORMATS} - {
        ("full", k) for k in KIVI_FORMATS
    } | {("hybrid", k) for k in KIVI_8BIT_SWA}
    for layout in ("hybrid", "full"):
        auto = hits[layout, "auto"]
        for f in ROW_FORMATS:  # same page bytes -> one replay; smaller pages -> more of them
            assert hits[layout, f]["hit_rate"] == hits[layout, "fp8_e4m3"]["hit_rate"]
            assert hits[layout, f]["full_pages"] > auto["full_pages"]
        for r in (hits[k] for k in hits if k[0] == layout):
            assert 0 <= r["hit_rate"] <= h["ideal_hit_rate"] and r["rejected"] == 0
    assert hits["hybrid", "fp8_e4m3"]["hit_rate"] >= hits["hybrid", "auto"]["hit_rate"]
    # 2-bit full pages: more of them than the 1-byte formats' in the same bytes
    assert (
        hits["hybrid", "kivi2"]["full_pages"]
        > hits["hybrid", "kivi4"]["full_pages"]
        > hits["hybrid", "int8"]["full_pages"]
    )
    assert list(h["targets"]) == [
        f"{k} hit rate at 5% budget above fp8_e4m3's (hybrid)" for k in ("kivi2", "kivi2+fp8_e4m3")
    ]
    hyb = {r["format"]: r["hit_rate"] for r in h["rows"] if r["layout"] == "hybrid"}
    for k, t in h["targets"].items():
        assert (t["value"], t["op"], t["threshold"]) == (hyb[k.split()[0]], ">", hyb["fp8_e4m3"])
        assert t["status"] == ("PASS" if t["value"] > t["threshold"] else "MISS")
    for f in ROW_FORMATS:  # the KL target: the format's mean KL, the bf16 / fp16 references named
        t = m["targets"][f"{f}: mean KL < 0.001"]
        assert t["value"] == q[f]["mean_kl"] and (t["status"] == "PASS") == q[f]["kl_target_met"]
        assert all(f"auto rounded via {name}" in t["note"] for name in ROUNDINGS)
    # every part's targets, together at the top
    assert data["targets"] == {**cap["targets"], **m["targets"], **h["targets"]}
    # an 8-bit SWA pool: more SWA pages than the bf16 one in the same bytes
    assert hits["hybrid", "kivi2+fp8_e4m3"]["swa_pages"] > hits["hybrid", "kivi2"]["swa_pages"]
