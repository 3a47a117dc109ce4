"""Physical layout of a shared KV byte budget: one arena of equal-byte units that full and SWA pages
are both cut from (``ArenaLayout``, ``arena_layout``).

A unit holds one page (``page_size`` tokens) of several layers, K then V of each. A full page is one
unit holding every full layer; a SWA page is ``m`` units, its layers packed in order into units of
the same size (layer group ``g`` of the page in its ``g``-th unit). Page ids of the two pools map to
units through the pools' unit tables (``PagePool.units``), so either kind can take any free unit and
the split needs no contiguous ranges (vLLM's hybrid allocator shares one block pool the same way,
with equal-byte blocks per attention group). Unit size: the full page, or a larger SWA layer page;
what a kind's page leaves empty in its last unit is padding, counted in its page bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from swaserve.config import FULL, SWA, AttnShape, ModelConfig
from swaserve.kvformat import KVFormat

# a quantized kind's rows are packed bytes: units are rounded up to this many bytes so every
# view of the arena (fp32 scales, a model-dtype kind) stays aligned
QUANT_ALIGN = 16


@dataclass(frozen=True)
class LayerPlace:
    """Where one layer's page lies in its page's units: unit ``group`` of the page, K at byte
    ``k_offset`` of the unit ([page_size, num_kv_heads, head_dim]), V at ``v_offset``."""

    group: int
    k_offset: int
    v_offset: int


@dataclass(frozen=True)
class ArenaLayout:
    """``unit_bytes`` per unit; per kind, ``units_per_page`` and each layer's ``LayerPlace`` (by the
    layer's index within its kind)."""

    unit_bytes: int
    units_per_page: dict[str, int]
    places: dict[str, tuple[LayerPlace, ...]]

    def page_bytes(self, kind: str) -> int:
        """Bytes of one page of ``kind``, padding included."""
        return self.units_per_page[kind] * self.unit_bytes


def _layer_bytes(shape: AttnShape, page_size: int, dtype_bytes: int, fmt: KVFormat) -> tuple[int, int]:
    h = page_size * shape.num_kv_heads
    return h * fmt.row_bytes(shape.head_dim, dtype_bytes, key=True), h * fmt.row_bytes(
        shape.v_head_dim, dtype_bytes
    )


def arena_layout(
    cfg: ModelConfig, page_size: int, dtype_bytes: int, formats: Mapping[str, KVFormat] | None = None
) -> ArenaLayout:
    """The arena layout of ``cfg``'s hybrid KV (module docstring); ``formats``: each kind's page
    format (``swaserve.kvformat``; default ``auto``).

    Raises:
        ValueError: the model has no full or no SWA layers (nothing to share).
    """
    if not cfg.full_layers or not cfg.swa_layers:
        raise ValueError("a shared KV arena needs both full and SWA layers")
    formats = formats or {}
    ff, sf = formats.get(FULL, KVFormat()), formats.get(SWA, KVFormat())
    fk, fv = _layer_bytes(cfg.full, page_size, dtype_bytes, ff)
    sk, sv = _layer_bytes(cfg.swa, page_size, dtype_bytes, sf)
    unit = max(len(cfg.full_layers) * (fk + fv), sk + sv)
    if ff.quantized or sf.quantized:
        unit += -unit % QUANT_ALIGN
    places: dict[str, tuple[LayerPlace, ...]] = {}
    per_page: dict[str, int] = {}
    for kind, n, (kb, vb) in ((FULL, len(cfg.full_layers), (fk, fv)), (SWA, len(cfg.swa_layers), (sk, sv))):
        out: list[LayerPlace] = []
        group, fill = 0, 0
        for _ in range(n):
            if fill + kb + vb > unit:
                group, fill = group + 1, 0
            out.append(LayerPlace(group, fill, fill + kb))
            fill += kb + vb
        places[kind], per_page[kind] = tuple(out), group + 1
    return ArenaLayout(unit, per_page, places)
