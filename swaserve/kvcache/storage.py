"""KV tensors behind the page pools: one K and one V tensor per layer, grouped by attention kind.

Layout per layer: ``k [num_pages * page_size, num_kv_heads, head_dim]``,
``v [num_pages * page_size, num_kv_heads, v_head_dim]``; slot = page * page_size + offset.
"""

from __future__ import annotations

import torch

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.kvcache.plan import PoolPlan


class KVStorage:
    """Allocates the pools' tensors on ``device`` in ``dtype``."""

    def __init__(
        self, cfg: ModelConfig, plan: PoolPlan, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for kind, layers, pages in (
            (FULL, cfg.full_layers, plan.full_pages),
            (SWA, cfg.swa_layers, plan.swa_pages),
        ):
            shape = cfg.full if kind == FULL else cfg.swa
            n = pages * page_size
            ks = [
                torch.zeros(n, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=device) for _ in layers
            ]
            vs = [
                torch.zeros(n, shape.num_kv_heads, shape.v_head_dim, dtype=dtype, device=device)
                for _ in layers
            ]
            self.kv[kind] = (ks, vs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ks, vs in self.kv.values() for t in ks + vs)
