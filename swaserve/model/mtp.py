"""MiMo-V2 multi-token-prediction (MTP) layers: the draft model of speculative decoding.

One layer (hub keys ``model.mtp.layers.N.*``; MiMo-V2-Flash report; SGLang
``models/mimo_v2_flash_nextn.py``, vLLM ``models/mimo_v2_mtp.py``)::

    x = eh_proj(cat([enorm(embed(token)), hnorm(h)]))      # embedding half first; [T, 2H] -> [T, H]
    x = x + SWA_attention(input_layernorm(x))              # a main SWA layer's geometry: sinks,
                                                           #   value scale, the SWA RoPE, window W
    x = x + dense_MLP(pre_mlp_layernorm(x))                # dense SwiGLU (intermediate_size), no MoE
    out = final_layernorm(x)                               # logits = the target's lm_head(out)

Chaining (SGLang's multi-layer EAGLE worker, Xiaomi's own path; vLLM differs, see
docs/DESIGN.md#modelmtppy): every layer k takes the TARGET's hidden state before its final norm,
``h_t``, at the same positions, with the token ids shifted left by one per layer, so layer k at
position t sees ``(h_t, x_{t+1+k})`` and predicts ``x_{t+2+k}``. The layers share the target's
``embed_tokens`` and ``lm_head``; each has its own SWA KV (in the engine, extra layers of the SWA
pool)."""

from __future__ import annotations

import torch
from torch import nn

from swaserve.config import SWA, ModelConfig
from swaserve.model.attention import Attention, AttentionBackend, KindMeta
from swaserve.model.layers import DenseMLP, RMSNorm

# hub key suffix -> this module's parameter name, per layer (SGLang's loader renames
# pre_mlp_layernorm to post_attention_layernorm; vLLM's does the same)
HUB_RENAMES = {"pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}


class MTPLayer(nn.Module):
    """One MTP layer (module docstring). ``forward`` runs over paged SWA KV like a target layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, SWA)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = DenseMLP(h, cfg.intermediate_size)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: KindMeta,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """embeds [T, H]: the target's embeddings of the shifted tokens; hidden [T, H]: the target's
        pre-final-norm hidden states at the same positions; cos_sin: the SWA RoPE at those
        positions; caches and ``meta`` as for a target SWA layer. Returns [T, H], final-normed
        (``lm_head`` of it gives the draft logits)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, k_cache, v_cache, meta, backend)
        x = x + self.mlp(self.post_attention_layernorm(x))
        out: torch.Tensor = self.final_layernorm(x)
        return out


def count_mtp_layers(names: list[str] | set[str]) -> int:
    """MTP layers present in a checkpoint's tensor names (``model.mtp.layers.N.*``): max N + 1."""
    ns = [
        int(n.split(".")[3]) for n in names if n.startswith("model.mtp.layers.") and n.split(".")[3].isdigit()
    ]
    return max(ns) + 1 if ns else 0
