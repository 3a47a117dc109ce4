"""MiMo-V2 (Xiaomi MiMo-V2-Flash / V2.5) decoder over a flat token batch and paged KV.

Architecture (MiMo-V2-Flash technical report; hub config.json): pre-norm decoder; attention is
full in a few layers and sliding-window (SWA) in the rest. SWA layers have their own KV-head count
(2x the full layers' in MiMo-V2-Flash), per-head attention sinks and their own RoPE theta; q/k head
dim (192) differs from v head dim (128); values are scaled by ``attention_value_scale``; RoPE covers
a leading fraction of each head. MLP is dense in the first layer(s) and a sigmoid-routed MoE
elsewhere. ``model.mtp.*`` weights load into ``mtp`` (``swaserve.model.mtp``: the draft layers of
speculative decoding), which reads the target's pre-final-norm hidden states (``forward_hidden``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.model.attention import Attention, AttentionBackend, KindMeta, SinkTokens, TorchPagedAttention
from swaserve.model.layers import DenseMLP, MoE, PartialRope, RMSNorm
from swaserve.model.mtp import MTPLayer

if TYPE_CHECKING:
    from swaserve.model.ep import EPShard


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
    residual: list[int] | None = None
    """KIVI full layers (``swaserve.kvformat``): each full layer's residual, by its index among
    the SWA layers of ``kv``; None: no KIVI."""
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    """Rows whose input is not a token embedding: (rows [k] int64, values [k, hidden]), media
    encoder outputs at placeholder positions (``input_ids`` holds 0 there)."""
    sink_tokens: SinkTokens | None = None
    """The full layers' sink tokens in full precision (``engine.sinks``); None: none."""


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, cfg.layer_types[layer])
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
        self.mtp = nn.ModuleList(MTPLayer(cfg) for _ in range(cfg.num_mtp_layers))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns final-norm hidden states [T, hidden] for every scheduled token."""
        out: torch.Tensor = self.norm(self.forward_hidden(batch))
        return out

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The decoder's output before its final norm, [T, hidden] (what the MTP layers read)."""
        return self.hidden_states(batch)

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """``forward_hidden`` outside inference mode (training: ``model.train``)."""
        h = self.embed(batch.input_ids, batch.embeds)
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
            residual = None
            if batch.residual is not None and kind == FULL:
                r = batch.residual[j]
                if batch.before_layer is not None:
                    batch.before_layer(SWA, r)
                residual = (batch.kv[SWA][0][r], batch.kv[SWA][1][r], batch.groups[SWA][r])
            a = layer.self_attn(
                layer.input_layernorm(h),
                cos_sin[kind],
                kc[j],
                vc[j],
                batch.meta[kind][batch.groups[kind][j]],
                self.backend,
                residual,
                batch.sink_tokens.layer(j) if batch.sink_tokens is not None and kind == FULL else None,
            )
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def moe_layers(self) -> list[MoE]:
        """The sparse MLPs, in layer order."""
        return [m.mlp for m in cast(list[DecoderLayer], list(self.layers)) if isinstance(m.mlp, MoE)]

    def shard_experts(self, ep: EPShard) -> None:
        """Expert parallelism: every MoE layer keeps only ``ep``'s experts (before loading)."""
        for i, moe in enumerate(self.moe_layers()):
            moe.shard(ep, i)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """Expert parallelism, a step with no tokens on this rank: join every MoE layer's
        dispatch and combine with zero rows, in layer order, as a forward would."""
        for moe in self.moe_layers():
            moe.idle()

    @torch.inference_mode()
    def embed(
        self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Token embeddings [T, hidden] of ``input_ids`` [T], with ``embeds`` (rows [k], values
        [k, hidden]) written over their rows: media placeholders take the encoder's outputs."""
        h: torch.Tensor = self.embed_tokens(input_ids)
        if embeds is not None:
            rows, values = embeds
            h = h.index_copy(0, rows, values.to(h.dtype))
        return h

    def mtp_forward(
        self,
        k: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: KindMeta,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """MTP layer ``k`` over T rows: input_ids [T] the shifted tokens (row t: token t+1+k),
        positions [T], hidden [T, H] the target's ``forward_hidden`` at those positions; its own
        SWA caches and metadata; ``embeds`` as in ``embed`` (media rows). Returns final-normed [T, H] (``logits`` of it: the drafts').

        Raises:
            IndexError: no MTP layer ``k`` in this checkpoint."""
        rope = cast(PartialRope, self.rope[SWA])
        cos_sin = rope.cos_sin(positions, hidden.dtype)
        layer = cast(MTPLayer, self.mtp[k])
        out: torch.Tensor = layer(
            self.embed(input_ids, embeds), hidden, cos_sin, k_cache, v_cache, meta, self.backend
        )
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return self.lm_head(hidden).float()
