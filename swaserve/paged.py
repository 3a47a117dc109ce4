"""Indexing paged KV tensors by slot: ``cache [rows, page_size, num_kv_heads, dim]`` (a row is a page
of a pool of its own, or a unit of a shared arena, then a strided view: ``kvcache.storage``), slot =
``row * page_size + offset``. Shared by the KV storage and the attention backends."""

from __future__ import annotations

import torch


def at(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``cache`` at int64 ``slots`` [n]: [n, H, D]."""
    slots = slots.to(cache.device)
    if cache.is_contiguous():
        return cache.view(-1, *cache.shape[2:])[slots]
    P = cache.shape[1]
    return cache[slots // P, slots % P]


def put(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x [n, H, D]`` into ``cache`` at int64 ``slots`` [n] (distinct)."""
    slots = slots.to(cache.device)
    x = x.to(device=cache.device, dtype=cache.dtype)
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x)
        return
    P = cache.shape[1]
    cache[slots // P, slots % P] = x
