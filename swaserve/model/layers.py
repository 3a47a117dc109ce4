"""MiMo-V2 building blocks: RMSNorm, partial NeoX RoPE, dense MLP and the sigmoid-routed MoE.

All take a flat token batch ``x: [T, hidden]`` (no batch/sequence axes): the engine packs every
request's tokens of one step into one row block.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ExpertRunner(Protocol):
    """What replaces ``run_experts`` under expert parallelism (``model.ep.EPShard``)."""

    experts: tuple[int, ...]  # this rank's experts, in local order

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, scaled in the input dtype (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class PartialRope(nn.Module):
    """Rotary position embedding on the first ``rotary_dim`` dims of each head, NeoX (half-split) style.

    RoFormer (Su et al. 2021); MiMo-V2 rotates ``int(head_dim * partial_rotary_factor)`` dims and leaves
    the rest unrotated, with a separate theta for full and sliding-window layers. Frequencies are
    ``theta ** (-2i / rotary_dim)`` for ``i < ceil(rotary_dim / 2)``, so an odd ``rotary_dim`` rotates
    ``rotary_dim + 1`` dims, exactly like the transformers reference.
    """

    inv_freq: torch.Tensor

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # on the CPU even when built on the meta device (``model.meta``): the table is computed, not
        # loaded, and ``Module.to`` moves it
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, rotary_dim] in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim]; cos/sin [T, rotary_dim] -> rotated x, same shape."""
        rd = cos.shape[-1]
        rot, rest = x[..., :rd], x[..., rd:]
        c, s = cos[:, None, :], sin[:, None, :]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * c + rotated * s, rest), dim=-1)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route_sigmoid_topk(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 style router (DeepSeek-V3 report, sec. 2.1.2 "auxiliary-loss-free balancing").

    Scores are sigmoid(x W^T) in fp32. ``correction_bias`` is added for *selection only*: groups are
    ranked by the sum of their two best biased scores, the best ``topk_group`` groups are kept, and the
    ``top_k`` best biased experts among them are chosen; their weights are the unbiased scores,
    optionally renormalized to sum to 1, times ``scaling``.

    Args:
        x: [T, hidden] activations (any float dtype; cast to fp32).
        gate_weight: [E, hidden] fp32 router weight.
        correction_bias: [E] fp32.

    Returns:
        (weights [T, top_k] fp32, expert ids [T, top_k] int64).
    """
    logits = F.linear(x.float(), gate_weight.float())
    scores = logits.sigmoid()
    biased = scores + correction_bias
    n_exp = scores.shape[-1]
    if n_group > 1:
        grouped = biased.view(-1, n_group, n_exp // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, n_group, n_exp // n_group).reshape(-1, n_exp)
        biased = biased.masked_fill(expert_mask == 0, float("-inf"))
    ids = torch.topk(biased, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_experts(
    rows: torch.Tensor, counts: list[int], w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: rows [N, hidden], the first ``counts[0]`` for
    expert 0, then ``counts[1]`` for expert 1, ... (sum = N); weights as ``run_experts``'.
    Returns [N, hidden]."""
    outs = []
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = rows[start : start + n]
        h = F.silu(F.linear(h, w_gate[e])) * F.linear(h, w_up[e])
        outs.append(F.linear(h, w_down[e]))
        start += n
    return torch.cat(outs) if outs else rows.new_zeros(0, w_down.shape[1])


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """Apply the chosen SwiGLU experts and sum them with their router weights.

    The single place where expert compute happens on one rank (``model.ep.EPShard.run`` replaces
    it under expert parallelism).

    Args:
        x: [T, hidden].
        weights: [T, k] fp32 router weights; ids: [T, k] expert ids.
        w_gate, w_up: [E, inter, hidden]; w_down: [E, hidden, inter].

    Returns:
        [T, hidden] in x's dtype.
    """
    k = ids.shape[1]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w_gate.shape[0]).tolist()
    rows = x[order // k]  # [T*k, hidden], grouped by expert
    w_sorted = weights.reshape(-1)[order].to(x.dtype)
    expert_out = grouped_experts(rows, counts, w_gate, w_up, w_down) * w_sorted[:, None]
    per_choice = torch.empty_like(expert_out)
    per_choice[order] = expert_out  # back to (token, choice) order
    out = per_choice.view(-1, k, x.shape[-1]).sum(dim=1)
    return out


class MoE(nn.Module):
    """MiMo-V2 sparse MLP: sigmoid router with correction bias, no shared experts."""

    e_score_correction_bias: torch.Tensor

    def __init__(
        self,
        hidden: int,
        inter: int,
        n_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        scaling: float,
    ) -> None:
        super().__init__()
        self.gate_weight = nn.Parameter(torch.zeros(n_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.w_gate = nn.Parameter(torch.empty(n_experts, inter, hidden))
        self.w_up = nn.Parameter(torch.empty(n_experts, inter, hidden))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, inter))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.ep: ExpertRunner | None = None  # expert parallel: this rank's experts only
        self.ep_layer = 0

    def shard(self, ep: ExpertRunner, index: int) -> None:
        """Hold only ``ep``'s experts (weights become [E_local, ...] meta tensors until loaded);
        ``index``: this layer's position among the MoE layers (the EP counters')."""
        n = len(ep.experts)
        for name in ("w_gate", "w_up", "w_down"):
            w = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(n, *w.shape[1:], dtype=w.dtype, device="meta")))
        self.ep, self.ep_layer = ep, index

    def idle(self) -> None:
        """Expert parallel: join this layer's dispatch and combine with no tokens of this rank's
        (its experts still compute the other ranks' rows)."""
        assert self.ep is not None
        dev, k = self.w_gate.device, self.top_k
        x = torch.empty(0, self.gate_weight.shape[1], dtype=self.w_gate.dtype, device=dev)
        w = torch.empty(0, k, dtype=torch.float32, device=dev)
        ids = torch.empty(0, k, dtype=torch.int64, device=dev)
        self.ep.run(self.ep_layer, x, w, ids, self.w_gate, self.w_up, self.w_down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_sigmoid_topk(
            x,
            self.gate_weight,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scaling,
        )
        if self.ep is not None:
            return self.ep.run(self.ep_layer, x, weights, ids, self.w_gate, self.w_up, self.w_down)
        return run_experts(x, weights, ids, self.w_gate, self.w_up, self.w_down)
