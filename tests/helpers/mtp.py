"""Dense references for the MTP layers and the target (no cache, positions 0..T-1), written from
the raw tensors by hub key names: what paged, chunked, cached computation must equal."""

from __future__ import annotations

import math

import torch

from swaserve.config import SWA, ModelConfig
from swaserve.model.attention import KindMeta, SeqAttn
from swaserve.model.mimo_v2 import ForwardBatch, MiMoV2ForCausalLM


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


def one_sequence_batch(model: MiMoV2ForCausalLM, tokens: torch.Tensor) -> ForwardBatch:
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
