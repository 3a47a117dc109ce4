"""KV tensors behind the page pools: one K and one V view per layer, grouped by attention kind.

Per layer ``k [rows, page_size, num_kv_heads, head_dim]`` and ``v [..., v_head_dim]``. With pools
of their own a row is a page of the kind's own tensor; with a shared budget (``plan.unit_bytes``)
every view is a strided window on one arena ``[units, unit_bytes / elem]`` (``kvcache.arena``) and
a row is a unit: layer ``j`` of a kind reads page ``p`` at unit ``table[p, group[j]]``, the pool's
unit table (``bind``). ``locate`` turns pool slots (``page * page_size + offset``) into row slots
(``row * page_size + offset``), which ``read`` / ``write`` and the attention backend index.

A quantized kind (``formats``, ``swaserve.kvformat``) stores packed rows: its views are uint8
``[rows, page_size, num_kv_heads, row_bytes]`` (data then scales per (token, head)); ``read`` and
``write`` move those bytes as they are (tiers and transfers copy pages byte for byte), the
attention backend packs and unpacks. A shared arena is then a byte arena with typed views.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.kvcache.arena import arena_layout
from swaserve.kvcache.plan import PoolPlan
from swaserve.kvcache.pool import PagePool
from swaserve.kvformat import KVFormat
from swaserve.paged import at, put

KVViews = tuple[list[torch.Tensor], list[torch.Tensor]]


class PagedKV:
    """K/V views per kind and layer (module docstring) over ``pages`` rows per kind, or an arena of
    ``units`` units shared by both kinds.

    Args:
        cfg: the model (its layers' KV shapes).
        page_size: tokens per page.
        dtype, device: the model dtype (of ``auto`` kinds' tensors) and the device; ``pin``: pinned
            host memory (a CUDA host tier).
        pages: {kind: pages} of pools of their own; ignored with ``units``.
        units: units of a shared arena (``arena_layout(cfg, page_size, dtype size, formats)``);
            None = own.
        formats: each kind's page format (default ``auto``).

    Attributes:
        kv: kind -> (K views, V views), by the layer's index within its kind.
        groups: kind -> each layer's unit group within a page (all 0 with pools of their own).
        formats: kind -> page format; model_dtype: ``dtype``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pages: dict[str, int] | None = None,
        units: int | None = None,
        pin: bool = False,
        formats: Mapping[str, KVFormat] | None = None,
    ) -> None:
        self.cfg, self.page_size, self.model_dtype = cfg, page_size, dtype
        self.formats = {kind: (formats or {}).get(kind, KVFormat()) for kind in (FULL, SWA)}
        elem = dtype.itemsize
        self.kv: dict[str, KVViews] = {}
        self.groups: dict[str, list[int]] = {}
        self._tables: dict[str, torch.Tensor] = {}
        self.arena: torch.Tensor | None = None
        kinds = ((FULL, cfg.full_layers, cfg.full), (SWA, cfg.swa_layers, cfg.swa))
        quantized = any(f.quantized for f in self.formats.values())
        if units is not None:
            layout = arena_layout(cfg, page_size, elem, self.formats)
            # a byte arena when a kind is quantized (typed views of each kind's rows)
            adt = torch.uint8 if quantized else dtype
            width = layout.unit_bytes // adt.itemsize
            self.arena = torch.zeros(units, width, dtype=adt, device=device, pin_memory=pin)
            arena = self.arena
            for kind, _layers, shape in kinds:
                h, fmt = shape.num_kv_heads, self.formats[kind]
                sdt = fmt.storage_dtype(dtype)

                def view(
                    offset: int, dim: int, key: bool, h: int = h, fmt: KVFormat = fmt, sdt: torch.dtype = sdt
                ) -> torch.Tensor:
                    w = fmt.row_bytes(dim, elem, key) // sdt.itemsize  # row width in the kind's dtype
                    lo, n = offset // adt.itemsize, page_size * h * w * sdt.itemsize // adt.itemsize
                    return arena[:, lo : lo + n].view(sdt).view(units, page_size, h, w)

                places = layout.places[kind]
                ks = [view(p.k_offset, shape.head_dim, True) for p in places]
                vs = [view(p.v_offset, shape.v_head_dim, False) for p in places]
                self.kv[kind] = (ks, vs)
                self.groups[kind] = [p.group for p in layout.places[kind]]
            return
        pages = pages or {}
        for kind, layers, shape in kinds:
            n, h, fmt = pages.get(kind, 0), shape.num_kv_heads, self.formats[kind]
            sdt = fmt.storage_dtype(dtype)

            def alloc(
                dim: int, key: bool, n: int = n, h: int = h, fmt: KVFormat = fmt, sdt: torch.dtype = sdt
            ) -> torch.Tensor:
                w = fmt.row_bytes(dim, elem, key) // sdt.itemsize
                return torch.zeros(n, page_size, h, w, dtype=sdt, device=device, pin_memory=pin)

            self.kv[kind] = (
                [alloc(shape.head_dim, True) for _ in layers],
                [alloc(shape.v_head_dim, False) for _ in layers],
            )
            self.groups[kind] = [0] * len(layers)

    def bind(self, kind: str, pool: PagePool) -> None:
        """Read ``kind``'s page -> unit map from ``pool`` (an arena only; shares its buffer).

        Raises:
            ValueError: storage and pool disagree on being an arena.
        """
        if (self.arena is None) != (pool.units_per_page == 0):
            raise ValueError("a shared KV arena needs pools on a budget with its units, and only those")
        if self.arena is not None:
            table = torch.frombuffer(pool.units, dtype=torch.int64) if len(pool.units) else torch.empty(0)
            self._tables[kind] = table.view(-1, pool.units_per_page)

    def num_groups(self, kind: str) -> int:
        return max(self.groups[kind], default=0) + 1

    def locate(self, kind: str, group: int, slots: torch.Tensor) -> torch.Tensor:
        """Row slots of pool ``slots`` (int64, CPU) for the layers of ``group``; the same tensor
        with pools of their own."""
        table = self._tables.get(kind)
        if table is None:
            if self.arena is not None:
                raise ValueError(f"no unit table bound for {kind}")
            return slots
        P = self.page_size
        return table[slots // P, group] * P + slots % P

    def read(self, kind: str, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K [n, H, Dk] and V [n, H, Dv] of layer ``layer`` of ``kind`` at pool ``slots`` (CPU), as
        stored (a quantized kind: packed rows [n, H, row_bytes] uint8)."""
        rows = self.locate(kind, self.groups[kind][layer], slots)
        ks, vs = self.kv[kind]
        return at(ks[layer], rows), at(vs[layer], rows)

    def write(self, kind: str, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K [n, H, Dk] and V [n, H, Dv] (as ``read`` returns them) at pool ``slots`` (CPU) of
        layer ``layer`` of ``kind``."""
        rows = self.locate(kind, self.groups[kind][layer], slots)
        ks, vs = self.kv[kind]
        put(ks[layer], rows, k)
        put(vs[layer], rows, v)

    def page_rows(self, kind: str, group: int, pages: list[int]) -> torch.Tensor:
        """Rows (CPU int64) of pool ``pages`` for the layers of ``group``."""
        p = torch.tensor(pages, dtype=torch.int64)
        table = self._tables.get(kind)
        return p if table is None else table[p, group]

    def nbytes(self) -> int:
        if self.arena is not None:
            return self.arena.numel() * self.arena.element_size()
        return sum(t.numel() * t.element_size() for ks, vs in self.kv.values() for t in ks + vs)


class KVStorage(PagedKV):
    """The device pools' tensors for ``plan`` (an arena when it is shared with units)."""

    def __init__(
        self,
        cfg: ModelConfig,
        plan: PoolPlan,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        formats: Mapping[str, KVFormat] | None = None,
    ) -> None:
        units = None
        if plan.unit_bytes is not None:
            assert plan.shared_bytes is not None
            if arena_layout(cfg, page_size, dtype.itemsize, formats).unit_bytes != plan.unit_bytes:
                raise ValueError("the plan's arena unit does not match the model's layout")
            units = plan.shared_bytes // plan.unit_bytes
        pages = {FULL: plan.full_pages, SWA: plan.swa_pages}
        super().__init__(cfg, page_size, dtype, device, pages, units, formats=formats)
