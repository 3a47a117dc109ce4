"""MiMo-V2 (Xiaomi MiMo-V2-Flash / V2.5) decoder over a flat token batch and paged KV.

Architecture (MiMo-V2-Flash technical report; hub config.json): pre-norm decoder; attention is
full in a few layers and sliding-window (SWA) in the rest. SWA layers have their own KV-head count
(2x the full layers' in MiMo-V2-Flash), per-head attention sinks and their own RoPE theta; q/k head
dim (192) differs from v head dim (128); values are scaled by ``attention_value_scale``; RoPE covers
a leading fraction of each head. MLP is dense in the first layer(s) and a sigmoid-routed MoE
elsewhere. ``model.mtp.*`` weights (multi-token prediction) are loaded and kept aside for MTP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from swaserve.config import FULL, ModelConfig
from swaserve.model.attention import AttentionBackend, KindMeta, TorchPagedAttention
from swaserve.model.layers import DenseMLP, MoE, PartialRope, RMSNorm


@dataclass
class ForwardBatch:
    """One engine step's input.

    Attributes:
        input_ids: [T] int64 token ids of every scheduled token, sequences back to back.
        positions: [T] int64 absolute positions.
        meta: attention metadata per kind ("full_attention" / "sliding_attention"), one per unit group
            of a shared KV arena (a single one with pools of their own; ``kvcache.storage``).
        kv: per kind, (k_caches, v_caches) lists indexed by the layer's index within its kind.
        groups: per kind, each layer's group (its ``meta`` entry), by the index within its kind.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: dict[str, list[KindMeta]]
    kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]
    groups: dict[str, list[int]]
    before_layer: Callable[[str, int], None] | None = None
    """Called with (kind, index within kind) before a layer reads its KV cache: waits for that
    layer's pages loaded back from the host tier (layer-by-layer overlap on a GPU)."""


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        shape = cfg.attn(layer)
        self.kind = cfg.layer_types[layer]
        self.nh, self.nkv = shape.num_heads, shape.num_kv_heads
        self.dk, self.dv = shape.head_dim, shape.v_head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.dk, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.dk, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.dv, bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, h, bias=False)
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.nh)) if shape.has_sinks else None
        self.scale = self.dk**-0.5
        self.v_scale = cfg.value_scale

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: KindMeta,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.nh, self.dk)
        k = self.k_proj(x).view(t, self.nkv, self.dk)
        v = self.v_proj(x).view(t, self.nkv, self.dv) * self.v_scale
        cos, sin = cos_sin
        q, k = PartialRope.rotate(q, cos, sin), PartialRope.rotate(k, cos, sin)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.attention_sink_bias, self.scale)
        return self.o_proj(out.reshape(t, self.nh * self.dv))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp: nn.Module
        if cfg.mlp_types[layer] == "sparse":
            self.mlp = MoE(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.n_routed_experts,
                cfg.num_experts_per_tok,
                cfg.n_group,
                cfg.topk_group,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MiMoV2ForCausalLM(nn.Module):
    """The MiMo-V2 target model. ``forward`` runs one step over paged KV; ``logits`` projects rows."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = nn.ModuleDict(
            {
                FULL: PartialRope(cfg.full.rotary_dim, cfg.full.rope_theta),
                "sliding_attention": PartialRope(cfg.swa.rotary_dim, cfg.swa.rope_theta),
            }
        )
        self.backend = backend or TorchPagedAttention()
        # index of each layer within its kind's cache list
        counters: dict[str, int] = {}
        self.kind_index: list[int] = []
        for kind in cfg.layer_types:
            self.kind_index.append(counters.get(kind, 0))
            counters[kind] = counters.get(kind, 0) + 1
        self.mtp_state: dict[str, torch.Tensor] = {}  # model.mtp.* tensors, kept for MTP

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns final-norm hidden states [T, hidden] for every scheduled token."""
        h = self.embed_tokens(batch.input_ids)
        cos_sin = {
            kind: cast(PartialRope, rope).cos_sin(batch.positions, h.dtype)
            for kind, rope in self.rope.items()
            if kind in batch.meta
        }
        for i, mod in enumerate(self.layers):
            layer = cast(DecoderLayer, mod)
            kind = self.cfg.layer_types[i]
            kc, vc = batch.kv[kind]
            j = self.kind_index[i]
            if batch.before_layer is not None:
                batch.before_layer(kind, j)
            a = layer.self_attn(
                layer.input_layernorm(h),
                cos_sin[kind],
                kc[j],
                vc[j],
                batch.meta[kind][batch.groups[kind][j]],
                self.backend,
            )
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
