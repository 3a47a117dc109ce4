"""MiMo-V2 MTP layers: checkpoint keys (hub layout), loading (count from the config or the
weights), and one layer over paged SWA KV, fed in chunks across the window, against an independent
dense implementation of the layer's math written here from the raw tensors by hub key names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from swaserve.config import SWA, ModelConfig
from swaserve.model.attention import KindMeta, SeqAttn
from swaserve.model.checkpoint import make_checkpoint
from swaserve.model.loader import LoadError, iter_checkpoint, load_model
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM

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


# -- the layer's math, independently ---------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, pos: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """NeoX rotation of the first 2 * ceil(rotary_dim / 2) dims of each head. x [T, heads, D]."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
    d = cos.shape[-1]
    a, rest = x[..., :d], x[..., d:]
    half = d // 2
    return torch.cat((a * cos + torch.cat((-a[..., half:], a[..., :half]), -1) * sin, rest), -1)


def reference_layer(
    w: dict[str, torch.Tensor], n: int, cfg: ModelConfig, tokens: torch.Tensor, hidden: torch.Tensor
) -> torch.Tensor:
    """MTP layer ``n`` over a whole sequence, dense (positions 0..T-1): final-normed [T, H]."""
    p, eps, s = f"model.mtp.layers.{n}.", cfg.rms_norm_eps, cfg.swa
    t = tokens.shape[0]
    e = _rms(w["model.embed_tokens.weight"][tokens], w[p + "enorm.weight"], eps)
    x = torch.cat((e, _rms(hidden, w[p + "hnorm.weight"], eps)), -1) @ w[p + "eh_proj.weight"].T
    a = _rms(x, w[p + "input_layernorm.weight"], eps)
    pos = torch.arange(t)
    q = _rope(
        (a @ w[p + "self_attn.q_proj.weight"].T).view(t, s.num_heads, s.head_dim),
        pos,
        s.rotary_dim,
        s.rope_theta,
    )
    k = _rope(
        (a @ w[p + "self_attn.k_proj.weight"].T).view(t, s.num_kv_heads, s.head_dim),
        pos,
        s.rotary_dim,
        s.rope_theta,
    )
    v = (a @ w[p + "self_attn.v_proj.weight"].T).view(t, s.num_kv_heads, s.v_head_dim) * cfg.value_scale
    group = s.num_heads // s.num_kv_heads
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - cfg.window)
    heads = []
    for h in range(s.num_heads):
        scores = (q[:, h] @ k[:, h // group].T) / math.sqrt(s.head_dim)
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = w[p + "self_attn.attention_sink_bias"][h].expand(t, 1)
        probs = torch.softmax(torch.cat((scores, sink), -1), -1)[:, :-1]  # the sink: denominator only
        heads.append(probs @ v[:, h // group])
    x = x + torch.cat(heads, -1) @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "pre_mlp_layernorm.weight"], eps)
    gate = torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T)
    x = x + (gate * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w[p + "final_layernorm.weight"], eps)


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


def _one_sequence_batch(model: MiMoV2ForCausalLM, tokens: torch.Tensor) -> ForwardBatch:
    """A whole sequence as one prefill chunk over fresh caches (slot = position)."""
    cfg, t = model.cfg, tokens.shape[0]
    pos = torch.arange(t)
    meta, kv, groups = {}, {}, {}
    for kind in set(cfg.layer_types):
        shape = cfg.attn(cfg.layer_types.index(kind))
        window = cfg.window if kind == SWA else t
        mask = (pos[None] <= pos[:, None]) & (pos[None] >= pos[:, None] - window)
        meta[kind] = [KindMeta(write_slots=pos, prefills=[SeqAttn(0, t, pos, mask)])]
        n = cfg.layer_types.count(kind)
        kv[kind] = (
            [torch.zeros(t, 1, shape.num_kv_heads, shape.head_dim) for _ in range(n)],
            [torch.zeros(t, 1, shape.num_kv_heads, shape.v_head_dim) for _ in range(n)],
        )
        groups[kind] = [0] * n
    return ForwardBatch(tokens, pos, meta, kv, groups)


def test_forward_hidden_is_the_decoder_output_before_the_final_norm(mtp_dir: Path) -> None:
    model = load_model(mtp_dir)
    tokens = torch.randint(0, model.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    normed = model.forward(_one_sequence_batch(model, tokens))
    before = model.forward_hidden(_one_sequence_batch(model, tokens))
    torch.testing.assert_close(model.norm(before), normed)
    assert not torch.allclose(before, normed, atol=1e-2)
