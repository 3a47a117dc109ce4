"""``sched.ep_cost``: prefill seconds per token at EP N and N/2 by hand on a small shape (NVLink
inside a node, RDMA across), the balance table, and the presets untouched without EP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swaserve.config import ModelConfig
from swaserve.sched.cost import MIMO_V2_FLASH_H200
from swaserve.sched.ep_cost import EPHardware, default_balance, ep_prefill, token_flops, with_ep
from swaserve.shapes import model_config, shape
from tests.helpers.moe_config import tiny_config

# 1 MFLOP/s GPUs at 50%, 2 GPUs a node, 1 kB/s NVLink and 100 B/s RDMA per rank
HW = EPHardware(gpu_flops=1e6, mfu=0.5, gpus_per_node=2, nvlink_bytes_per_s=1e3, rdma_bytes_per_s=1e2)


def test_token_flops_by_hand(tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_config(tmp_path))
    f = token_flops(cfg)
    # 2 x (attention 33,800 + dense MLP 24,576 + router 1,560) + SWA scores: 2 layers x 8 keys x
    # 2 x 4 heads x (16 + 8)
    assert f.dense == 2 * (33_800 + 24_576 + 1_560) + 2 * 8 * 2 * 4 * 24 == 122_944
    assert f.experts == 2 * 147_456 * 2 / 8 == 73_728  # top-2 of 8 experts' weights, 2 FLOP each
    flash = token_flops(model_config(shape("MiMo-V2-Flash")))
    assert flash.experts == 2 * 47 * 8 * 3 * 4096 * 2048  # 18.9 GFLOP
    assert flash.dense == pytest.approx(9.671e9, rel=1e-3)


def test_prefill_seconds_per_token_at_ep_n_and_half(tmp_path: Path) -> None:
    cfg = ModelConfig.from_pretrained(tiny_config(tmp_path))
    # all-to-all bytes per token: 2 (dispatch + combine) x 3 MoE layers x 64 hidden x 2 B x top-2
    copy = 2 * 3 * 64 * 2 * 2  # 1,536 B if every copy left the rank
    # EP 4 over 2 nodes of 2: a copy stays on its rank 1/4, on the other GPU of the node 1/4,
    # leaves the node 2/4; per rank the slower link rules: max(384 / 1e3, 768 / 1e2) = 7.68 s, and
    # 4 ranks run in parallel -> 1.92 s per token of the instance
    four = ep_prefill(cfg, 4, HW, balance=0.8)
    assert (four.nvlink_bytes, four.rdma_bytes) == (copy / 4, copy * 2 / 4)
    assert four.dense_s == pytest.approx(122_944 / (4 * 1e6 * 0.5))  # 0.061472
    assert four.expert_s == pytest.approx(73_728 / (4 * 1e6 * 0.5 * 0.8))  # 1/balance
    assert four.a2a_s == pytest.approx(max(384 / 1e3, 768 / 1e2) / 4)
    assert four.token_s == pytest.approx(0.061472 + 0.04608 + 1.92)
    # EP 2 inside one node: 1/2 of the copies over NVLink, none over RDMA: 0.768 s per rank / 2
    two = ep_prefill(cfg, 2, HW, balance=0.9)
    assert (two.nvlink_bytes, two.rdma_bytes) == (copy / 2, 0)
    assert two.token_s == pytest.approx(122_944 / 1e6 + 73_728 / (1e6 * 0.9) + 0.768 / 2)
    # per GPU: EP 2 is 6.9x more efficient here (RDMA dominates the EP 4 instance)
    assert (4 * four.token_s) / (2 * two.token_s) == pytest.approx(4 * 2.027552 / (2 * 0.588864), rel=1e-5)
    # a2a overlap hides part of the all-to-all
    hidden = ep_prefill(cfg, 2, EPHardware(**{**HW.__dict__, "a2a_overlap": 0.5}), balance=0.9)
    assert hidden.a2a_s == pytest.approx(0.768 / 2 / 2)
    with pytest.raises(ValueError, match="divide"):
        ep_prefill(cfg, 3, HW)
    with pytest.raises(ValueError, match="balance"):
        ep_prefill(cfg, 2, HW, balance=1.5)


def test_default_balance_follows_the_research_table() -> None:
    assert [default_balance(n) for n in (1, 4, 8, 16, 32, 64)] == [1.0, 0.97, 0.92, 0.86, 0.84, 0.84]
    assert default_balance(2) == pytest.approx(0.985)  # halfway in log2 between EP 1 and 4
    assert default_balance(12) == pytest.approx(0.92 + (0.86 - 0.92) * 0.5849625, rel=1e-6)
    with pytest.raises(ValueError):
        default_balance(0)


def test_flash_on_h200_ep_16_to_8_crosses_from_rdma_to_nvlink() -> None:
    """Defaults: 989 TFLOP/s at 50%, 153 GB/s NVLink, 43 GB/s RDMA, 8 GPUs a node, bf16 copies."""
    cfg = model_config(shape("MiMo-V2-Flash"))
    e8, e16 = ep_prefill(cfg, 8, EPHardware()), ep_prefill(cfg, 16, EPHardware())
    copy = 2 * 47 * 4096 * 2 * 8  # 6.16 MB per token if every copy left
    assert e8.a2a_s == pytest.approx(copy * 7 / 8 / 153e9 / 8)  # 4.40 us
    assert e16.a2a_s == pytest.approx(copy * 8 / 16 / 43e9 / 16)  # RDMA half: 4.48 us
    assert e8.token_s == pytest.approx(12.048e-6, rel=1e-3)
    assert e16.token_s == pytest.approx(8.481e-6, rel=1e-3)
    # two EP 8 instances vs one EP 16 on the same 16 GPUs: 1.41x the prefill tokens per second
    assert 2 * e16.token_s / e8.token_s == pytest.approx(1.408, abs=1e-3)


def test_with_ep_scales_the_instance_and_leaves_the_preset_alone() -> None:
    before = json.dumps(MIMO_V2_FLASH_H200.__dict__)
    e4 = ep_prefill(model_config(shape("MiMo-V2-Flash")), 4, EPHardware())
    c = with_ep(MIMO_V2_FLASH_H200, e4, 8)
    assert c.prefill_token_s == e4.token_s and c.name == "mimo-v2-flash-h200@ep4"
    assert c.prefill_attn_s == pytest.approx(1.16e-10 * 2)  # half the GPUs for full attention
    assert c.link_bytes_per_s == pytest.approx(25e9)  # half the NICs
    assert (c.prefill_base_s, c.decode_base_s, c.decode_seq_s) == (0.010, 0.005, 5e-5)
    assert json.dumps(MIMO_V2_FLASH_H200.__dict__) == before and MIMO_V2_FLASH_H200.prefill_token_s == 7.6e-6
