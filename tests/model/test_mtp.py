"""MiMo-V2 MTP layers: checkpoint keys (hub layout), loading (count from the config or the
weights), and one layer over paged SWA KV, fed in chunks across the window, against an independent
dense implementation of the layer's math written here from the raw tensors by hub key names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from swaserve.config import SWA
from swaserve.model.attention import KindMeta, SeqAttn
from swaserve.model.checkpoint import make_checkpoint
from swaserve.model.loader import LoadError, iter_checkpoint, load_model
from tests.helpers.mtp import one_sequence_batch, reference_layer

LAYER_KEYS = {
    "enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight", "pre_mlp_layernorm.weight",
    "final_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.attention_sink_bias", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
}  # fmt: skip


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("tiny", tmp_path_factory.mktemp("mtp") / "tiny-mtp", mtp_layers=3)


def test_make_checkpoint_writes_hub_keys_and_leaves_the_target_alone(mtp_dir: Path, tiny_dir: Path) -> None:
    with safe_open(str(mtp_dir / "mtp.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys == {f"model.mtp.layers.{n}.{k}" for n in range(3) for k in LAYER_KEYS}
    assert json.loads((mtp_dir / "config.json").read_text())["num_nextn_predict_layers"] == 3
    target = {k: v for k, v in iter_checkpoint(mtp_dir) if not k.startswith("model.mtp.")}
    plain = dict(iter_checkpoint(tiny_dir))
    assert target.keys() == plain.keys() and all(torch.equal(target[k], plain[k]) for k in plain)


def test_the_layer_count_comes_from_the_config_else_the_weights(mtp_dir: Path, tmp_path: Path) -> None:
    assert len(load_model(mtp_dir).mtp) == 3
    import shutil

    d = shutil.copytree(mtp_dir, tmp_path / "no-count")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    assert len(load_model(d).mtp) == 3  # inferred from model.mtp.layers.{0,1,2}
    cfg["num_nextn_predict_layers"] = 4  # the config promises a layer the weights lack
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"model\.mtp\.layers\.3\."):
        load_model(d)


@pytest.mark.parametrize("chunks", [[40], [5, 1, 3, 1, 1, 9, 1, 2, 17]])
def test_a_layer_over_paged_kv_equals_the_dense_reference(mtp_dir: Path, chunks: list[int]) -> None:
    """Fed in chunks over a paged cache whose window the sequence crosses several times, every
    layer's output equals the dense reference (and so equals recomputing without a cache)."""
    model = load_model(mtp_dir)
    cfg, w = model.cfg, dict(iter_checkpoint(mtp_dir))
    g = torch.Generator().manual_seed(3)
    t, page = sum(chunks), 4
    assert t > 3 * (cfg.window + 1)
    tokens = torch.randint(0, cfg.vocab_size, (t,), generator=g)
    hidden = torch.randn(t, cfg.hidden_size, generator=g)
    s = cfg.swa
    for n in range(len(model.mtp)):
        k_cache = torch.zeros(t // page + 1, page, s.num_kv_heads, s.head_dim)
        v_cache = torch.zeros(t // page + 1, page, s.num_kv_heads, s.v_head_dim)
        outs, start = [], 0
        for c in chunks:  # one sequence; slot = position (page = slot // 4)
            end = start + c
            lo = max(0, start - cfg.window)
            q_pos, kv_pos = torch.arange(start, end), torch.arange(lo, end)
            mask = (kv_pos[None] <= q_pos[:, None]) & (kv_pos[None] >= q_pos[:, None] - cfg.window)
            meta = KindMeta(write_slots=q_pos, prefills=[SeqAttn(0, c, kv_pos, mask)])
            outs.append(
                model.mtp_forward(n, tokens[start:end], q_pos, hidden[start:end], k_cache, v_cache, meta)
            )
            start = end
        got = torch.cat(outs)
        want = reference_layer(w, n, cfg, tokens, hidden)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(got, reference_layer(w, (n + 1) % 3, cfg, tokens, hidden), atol=1e-3)
    assert SWA in cfg.layer_types


def test_forward_hidden_is_the_decoder_output_before_the_final_norm(mtp_dir: Path) -> None:
    model = load_model(mtp_dir)
    tokens = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    normed = model.forward(one_sequence_batch(model, tokens))
    before = model.forward_hidden(one_sequence_batch(model, tokens))
    torch.testing.assert_close(model.norm(before), normed)
    assert not torch.allclose(before, normed, atol=1e-2)
