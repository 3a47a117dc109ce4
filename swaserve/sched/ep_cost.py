"""Prefill seconds per token of an expert-parallel instance of N GPUs (EP N, DP attention), for the
simulator's cost model (``with_ep``)::

    t(N) = F_dense / (N x F x mfu) + F_exp / (N x F x mfu x b(N)) + (1 - overlap) x a2a(N) / N
    a2a(N) = max(bytes_nvl / B_nvl, bytes_rdma / B_rdma)      per token per rank, both links at once
    bytes_nvl  = 2 x L_moe x H x a x k x (g - 1) / N          g = min(N, gpus_per_node)
    bytes_rdma = 2 x L_moe x H x a x k x (N - g) / N          0 while the instance fits one node

``F_dense``: FLOPs per prompt token outside the routed experts (projections, dense MLP, router, SWA
scores over the window); ``F_exp``: the k active experts' SwiGLU FLOPs; ``b(N)``: expert load
balance, mean / max tokens per rank (``default_balance``: the research note's lognormal-skew table;
a measured value replaces it); ``a``: bytes per dispatched element; 2x: dispatch and combine. An
instance is one server with the throughput of its N GPUs, as the presets' 8-GPU instance.
Sources and assumptions: docs/DESIGN.md#schedep_costpy"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

from swaserve.config import ModelConfig
from swaserve.sched.cost import CostModel
from swaserve.sched.ep_plan import param_counts

# mean/max tokens per rank by EP size: a simulated lognormal expert popularity (sigma 0.3), top-8 of
# 256, contiguous placement (research note mtp_ep_ray.md 2.4; production reports ~0.85 at large EP)
BALANCE = ((1, 1.0), (4, 0.97), (8, 0.92), (16, 0.86), (32, 0.84))


def default_balance(ep: int) -> float:
    """``BALANCE`` at ``ep``, linear in log2(ep) between its points, held past the last one."""
    if ep < 1:
        raise ValueError(f"EP size must be >= 1, got {ep}")
    x = math.log2(ep)
    for (e0, b0), (e1, b1) in itertools.pairwise(BALANCE):
        if ep <= e1:
            x0, x1 = math.log2(e0), math.log2(e1)
            return b0 + (b1 - b0) * (x - x0) / (x1 - x0)
    return BALANCE[-1][1]


@dataclass(frozen=True)
class EPHardware:
    """The GPUs and links of an EP instance (defaults: H200 nodes, DeepEP V1 normal kernels).

    Attributes:
        gpu_flops: dense BF16 FLOP/s per GPU (H200: 989e12). mfu: the share prefill reaches (0.5,
            as the ``mimo-v2-flash-h200`` preset). gpus_per_node: GPUs on one NVLink domain.
        nvlink_bytes_per_s, rdma_bytes_per_s: per-rank all-to-all bandwidth (DeepEP V1 on H800,
            4096 tokens, hidden 7168, top-8: intranode EP8 153 GB/s, internode EP16 43 GB/s).
        a2a_bytes: bytes per element dispatched and combined (2: bf16 both ways).
        a2a_overlap: the share of all-to-all time hidden behind compute (0: none, no two-batch overlap).
    """

    gpu_flops: float = 989e12
    mfu: float = 0.5
    gpus_per_node: int = 8
    nvlink_bytes_per_s: float = 153e9
    rdma_bytes_per_s: float = 43e9
    a2a_bytes: int = 2
    a2a_overlap: float = 0.0


class TokenFlops(NamedTuple):
    """FLOPs per prompt token: ``dense`` (everything but the routed experts), ``experts``."""

    dense: float
    experts: float


def token_flops(cfg: ModelConfig) -> TokenFlops:
    """2 FLOPs per weight a token passes (lm_head: last token only, left out; MTP: left out) plus
    SWA scores, W keys per SWA layer at 2 x heads x (qk + v) FLOPs each. Flash: 9.67e9 + 18.92e9."""
    p = param_counts(cfg, 0)
    a = cfg.swa
    swa_scores = len(cfg.swa_layers) * cfg.window * 2 * a.num_heads * (a.head_dim + a.v_head_dim)
    active = p.experts * cfg.num_experts_per_tok / cfg.n_routed_experts
    return TokenFlops(2 * (p.attention + p.dense_mlp + p.router) + swa_scores, 2 * active)


class EPPrefill(NamedTuple):
    """One EP size's prefill seconds per token of the whole instance, by term."""

    ep: int
    balance: float
    dense_s: float
    expert_s: float
    a2a_s: float
    nvlink_bytes: float  # per token, leaving the rank over NVLink
    rdma_bytes: float  # per token, leaving the node over RDMA

    @property
    def token_s(self) -> float:
        return self.dense_s + self.expert_s + self.a2a_s

    def describe(self) -> str:
        """One line: the terms in microseconds per token."""
        return (
            f"EP {self.ep}: {self.token_s * 1e6:.3f} us/token = dense {self.dense_s * 1e6:.3f} + experts "
            f"{self.expert_s * 1e6:.3f} (balance {self.balance:.3f}) + all-to-all {self.a2a_s * 1e6:.3f} "
            f"({self.nvlink_bytes / 1e6:.2f} MB NVLink, {self.rdma_bytes / 1e6:.2f} MB RDMA per token)"
        )


def ep_prefill(cfg: ModelConfig, ep: int, hw: EPHardware, balance: float | None = None) -> EPPrefill:
    """The module formula at ``ep`` ranks (``balance`` default: ``default_balance(ep)``).

    Raises:
        ValueError: ``ep`` does not divide the routed experts, or a balance/overlap out of (0, 1].
    """
    e = cfg.n_routed_experts
    if ep < 1 or e % ep:
        raise ValueError(f"EP size {ep} must divide the {e} routed experts")
    b = default_balance(ep) if balance is None else balance
    if not 0 < b <= 1 or not 0 <= hw.a2a_overlap <= 1:
        raise ValueError(f"balance must be in (0, 1] and overlap in [0, 1], got {b}, {hw.a2a_overlap}")
    f = token_flops(cfg)
    rate = ep * hw.gpu_flops * hw.mfu
    per_copy = 2 * cfg.mlp_types.count("sparse") * cfg.hidden_size * hw.a2a_bytes * cfg.num_experts_per_tok
    g = min(ep, hw.gpus_per_node)
    nvl, rdma = per_copy * (g - 1) / ep, per_copy * (ep - g) / ep
    a2a = max(nvl / hw.nvlink_bytes_per_s, rdma / hw.rdma_bytes_per_s)
    return EPPrefill(
        ep, b, f.dense / rate, f.experts / (rate * b), (1 - hw.a2a_overlap) * a2a / ep, nvl, rdma
    )


def with_ep(base: CostModel, ep: EPPrefill, base_gpus: int) -> CostModel:
    """``base`` (a preset for instances of ``base_gpus`` GPUs) as an instance of ``ep.ep`` GPUs:
    ``prefill_token_s`` from ``ep``; the full-attention term and the instance's KV link (a NIC per
    GPU) scale with the GPUs; per-prefill base and decode terms unchanged."""
    scale = ep.ep / base_gpus
    return replace(
        base,
        name=f"{base.name}@ep{ep.ep}",
        prefill_token_s=ep.token_s,
        prefill_attn_s=base.prefill_attn_s / scale,
        link_bytes_per_s=base.link_bytes_per_s * scale,
        source=f"{base.source}; prefill at EP {ep.ep} (sched.ep_cost)",
    )
