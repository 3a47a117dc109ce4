"""``sched.ep_plan`` and ``swaserve plan-ep`` against hand-computed cases: parameter counts from the
public shapes, KV bytes per token, the smallest EP of each layout (hybrid halving it), no fit at
any EP, EP dividing the expert count, a checkpoint directory, the CLI and its JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from swaserve.cli import app
from swaserve.sched.ep_plan import Inputs, kv_per_token, param_counts, plan, resolve, smallest_ep
from swaserve.shapes import model_config, shape
from tests.helpers.moe_config import tiny_config

runner = CliRunner()
FLASH = model_config(shape("MiMo-V2-Flash"))


def test_flash_parameter_counts_by_hand() -> None:
    p = param_counts(FLASH)
    assert p.experts == 47 * 256 * 3 * 4096 * 2048  # 47 MoE layers x 256 experts x (gate, up, down)
    assert p.router == 47 * 256 * (4096 + 1)  # gate weight + score-correction bias
    full = 4096 * (64 * 192 + 4 * (192 + 128)) + 64 * 128 * 4096  # q,k,v + o; no sinks
    swa = 4096 * (64 * 192 + 8 * (192 + 128)) + 64 * 128 * 4096 + 64  # 8 KV heads, 64 sinks
    assert (full, swa) == (89_128_960, 94_371_904)
    assert p.attention == 9 * full + 39 * swa == 4_482_664_896
    assert p.dense_mlp == 3 * 4096 * 16384  # layer 0
    assert p.embeddings == 2 * 152576 * 4096  # embed_tokens + lm_head (untied)
    assert p.norms == (2 * 48 + 1) * 4096
    assert p.mtp == 3 * (2 * 4096 * 4096 + swa + 3 * 4096 * 16384 + 5 * 4096) == 3 * 329_273_408
    assert p.non_expert == 6_971_406_720
    assert abs(p.total - p.mtp - 309e9) / 309e9 < 0.001  # 308.78B vs the published 309B
    assert p.experts / (p.total - p.mtp) == pytest.approx(0.981, abs=0.001)


def test_kv_bytes_per_token_with_mtp_as_swa() -> None:
    kv = kv_per_token(FLASH, 3, 2)
    assert kv.full == 9 * 4 * (192 + 128) * 2 == 23_040
    assert kv.swa == (39 + 3) * 8 * (192 + 128) * 2 == 215_040  # the 3 MTP layers are SWA layers
    assert kv.full + kv.swa == 238_080 and kv.window == 128  # the research note's b_full with MTP
    pro = kv_per_token(model_config(shape("mimo-v2.5-pro")), 0, 2)
    assert (pro.full, pro.swa) == (10 * 5120, 60 * 5120)  # 51,200 / (51,200 + 307,200) = 1/7


def test_flash_hybrid_needs_half_the_ep_of_full() -> None:
    """8 requests x 32,768 tokens per GPU on 141 GB H200s at 0.9 (defaults)."""
    p = plan(*resolve("mimo-v2-flash"), Inputs())
    u = 0.9 * 141e9  # 126.9 GB
    w_ne = 6_971_406_720 * 2  # bf16 non-expert weights, replicated: 13.94 GB
    w_e = 47 * 256 * 3 * 4096 * 2048 * 1  # FP8 experts: 302.8 GB
    full_kv = 8 * 32768 * 238_080  # 62.41 GB
    hybrid_kv = 8 * (32768 * 23_040 + 128 * 215_040) + 8192 * 215_040  # 8.02 GB, the chunk's SWA rows
    assert (p.layouts["full"].kv_bytes, p.layouts["hybrid"].kv_bytes) == (full_kv, hybrid_kv)
    # full: W_e / (U - w_ne - 8 GB - KV) = 302.8 / 42.55 = 7.12 -> 8 (divides 256)
    assert w_e / (u - w_ne - 8e9 - full_kv) == pytest.approx(7.117, abs=1e-3)
    # hybrid: 302.8 / 96.94 = 3.12 -> 4
    assert w_e / (u - w_ne - 8e9 - hybrid_kv) == pytest.approx(3.124, abs=1e-3)
    assert (p.layouts["full"].ep_size, p.layouts["hybrid"].ep_size) == (8, 4)
    assert p.halving() == 2
    assert p.layouts["hybrid"].expert_bytes_per_gpu == w_e / 4
    assert p.layouts["full"].headroom_bytes == pytest.approx(u - w_ne - 8e9 - full_kv - w_e / 8)
    # capacity at the answer's EP: full at EP 8 holds (U - w_ne - 8 GB - W_e/8) / 238,080 tokens
    assert p.layouts["full"].capacity_tokens == int((u - w_ne - 8e9 - w_e / 8) / 238_080) == 281_870


def test_no_fit_at_any_ep() -> None:
    """8 x 65,536 tokens in the full layout: 124.8 GB of KV alone is almost U (126.9 GB); after
    13.9 GB of weights and 8 GB reserve nothing is left for even 1/256 of the experts."""
    p = plan(*resolve("mimo-v2-flash"), Inputs(context=65536))
    full = p.layouts["full"]
    assert full.kv_bytes == 8 * 65536 * 238_080 and full.ep_size is None
    assert full.free_bytes == pytest.approx(0.9 * 141e9 - 6_971_406_720 * 2 - 8e9 - 8 * 65536 * 238_080)
    assert full.free_bytes < 0
    assert p.layouts["hybrid"].ep_size == 4 and p.halving() is None


def test_ep_divides_the_expert_count() -> None:
    assert smallest_ep(12, 500.0, 100.0) == 6  # needs >= 5: 5 does not divide 12
    assert smallest_ep(12, 500.0, 500.0) == 1
    assert smallest_ep(12, 500.0, 41.0) is None  # 500 / 12 = 41.7 per rank at most ranks
    assert smallest_ep(384, 999.6, 70.0) == 16  # >= 14.3: 14, 15 do not divide 384
    assert smallest_ep(384, 999.6, 90.0) == 12  # >= 11.1


def test_pro_reproduces_the_research_notes_rows_with_its_assumptions() -> None:
    """mtp_ep_ray.md 2.3: W_e = 0.98 x 1.02T, w_ne 19.6B x 1.5 B, 64 requests' windows, no MTP and
    no chunk. C = 32K: full EP 16, hybrid 12; C = 128K: full 24, hybrid 16."""
    name, cfg, w = resolve("MiMo-V2.5-Pro", expert_params=999.6e9, total_params=999.6e9 + 19.6e9)
    assert w.non_expert_params == pytest.approx(19.6e9)
    eps = {}
    for tokens in (32768, 131072):
        i = Inputs(context=tokens // 64, concurrency=64, chunk=0, non_expert_bytes=1.5)
        p = plan(name, cfg, w, i, mtp_layers=0)
        eps[tokens] = (p.layouts["full"].ep_size, p.layouts["hybrid"].ep_size)
    assert eps == {32768: (16, 12), 131072: (24, 16)}
    # hybrid KV at C = 32K: 32,768 x 51,200 + 64 x 128 x 307,200 = 1.68 + 2.52 GB
    assert 64 * (512 * 51_200 + 128 * 307_200) == 4_194_304_000
    # the default assumption: 2% of 1.02T = 20.4B non-expert params (the note's 19.6B is 0.8B short)
    _, _, default = resolve("mimo-v2.5-pro")
    assert default.expert_params == pytest.approx(0.98 * 1.02e12)
    assert default.non_expert_params == pytest.approx(20.4e9) and default.parts is None
    assert "not public" in default.source
    # with 20.4B x 1.5 B = 30.6 GB the 128K full row needs EP 32: 999.6 / 41.3 = 24.2 > 24
    p = plan(name, cfg, default, Inputs(context=2048, concurrency=64, chunk=0, non_expert_bytes=1.5), 0)
    assert p.layouts["full"].ep_size == 32


def test_checkpoint_directory_by_hand(tmp_path: Path) -> None:
    name, cfg, w = resolve(str(tiny_config(tmp_path)))
    p = w.parts
    assert p is not None and name == str(tmp_path)
    assert p.experts == 3 * 8 * 3 * 64 * 32 == 147_456
    full_attn = 64 * (4 * 16 + 1 * (16 + 8)) + 4 * 8 * 64  # 7,680
    swa_attn = 64 * (4 * 16 + 2 * (16 + 8)) + 4 * 8 * 64 + 4  # 9,220 (4 sinks)
    assert p.attention == 2 * full_attn + 2 * swa_attn == 33_800
    assert p.mtp == 2 * 64 * 64 + swa_attn + 3 * 64 * 128 + 5 * 64 == 42_308
    assert (
        w.non_expert_params == 3 * 8 * 65 + 33_800 + 3 * 64 * 128 + 2 * 100 * 64 + 9 * 64 + 42_308 == 115_620
    )
    kv = kv_per_token(cfg, 1, 2)
    assert (kv.full, kv.swa, kv.window) == (2 * 1 * 24 * 2, 3 * 2 * 24 * 2, 8) == (96, 288, 8)
    i = Inputs(gpu_bytes=350_000, utilization=1.0, reserve_bytes=1000, context=100, concurrency=2, chunk=10)
    pl = plan(name, cfg, w, i)
    # full: 2 x 100 x 384 = 76,800; free = 350,000 - 231,240 - 1,000 - 76,800 = 40,960; 147,456 / 40,960 = 3.6 -> 4
    # hybrid: 2 x (100 x 96 + 8 x 288) + 10 x 288 = 26,688; free 91,072; 1.62 -> 2
    assert (pl.layouts["full"].kv_bytes, pl.layouts["hybrid"].kv_bytes) == (76_800, 26_688)
    assert (pl.layouts["full"].ep_size, pl.layouts["hybrid"].ep_size) == (4, 2)


def test_cli_plan_json_and_exit_codes(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = runner.invoke(
        app, ["plan-ep", "--shape", "mimo-v2-flash", "--gpu-memory", "141GB", "--json", str(out)]
    )
    assert r.exit_code == 0, r.output
    assert "ep_size = 4 (hybrid layout)" in r.output and "2x (hybrid: half the EP or less)" in r.output
    assert "262,144 tokens" in r.output and "U = 0.9 x 141.0 GB = 126.9 GB" in r.output
    doc = json.loads(out.read_text())
    assert doc["ep_size"] == 4 and doc["layouts"]["full"]["ep_size"] == 8
    assert doc["inputs"]["tokens_per_gpu"] == 262_144 and doc["inputs"]["gpu_bytes"] == 141e9
    assert doc["weights"]["parts"]["experts"] == 47 * 256 * 3 * 4096 * 2048
    assert doc["kv_bytes_per_token"] == {"full": 23_040, "swa": 215_040, "window": 128}
    assert doc["formula"] and doc["assumptions"] and len(doc["sweep"]) == 7
    assert {r["context"]: r["full_over_hybrid_ep"] for r in doc["sweep"]}[16384] == 2
    r = runner.invoke(app, ["plan-ep", "--kv-layout", "full", "--no-sweep", "--json", str(out)])
    assert r.exit_code == 0 and "ep_size = 8 (full layout)" in r.output
    assert json.loads(out.read_text())["ep_size"] == 8
    r = runner.invoke(app, ["plan-ep", "--kv-layout", "full", "--context", "65536", "--json", str(out)])
    assert r.exit_code == 1 and "does not fit at any EP" in r.output
    assert json.loads(out.read_text())["ep_size"] is None
    r = runner.invoke(app, ["plan-ep", "--shape", "mimo-v2.5-pro", "--no-sweep"])
    assert r.exit_code == 0 and "not public" in r.output
    args = ["--gpu-memory", "350000", "--gpu-utilization", "1", "--reserve", "1000", "--context", "100"]
    r = runner.invoke(
        app, ["plan-ep", "--shape", str(tiny_config(tmp_path)), *args, "--concurrency", "2", "--chunk", "10"]
    )
    assert r.exit_code == 0 and "ep_size = 2 (hybrid layout)" in r.output, r.output
    r = runner.invoke(app, ["plan-ep", "--shape", "mimo-v9"])
    assert r.exit_code == 2 and "neither a known shape" in r.output
