"""Host-memory KV tier (L2): page tensors in host memory and the copies between tiers.

Per kind and layer ``host_k [host_pages, page_size, num_kv_heads, head_dim]`` and ``host_v [...,
v_head_dim]``, or views on a host arena laid out as the device's (``kvcache.storage``; pinned when
CUDA is used). ``to_host`` copies device pages out; ``to_device`` copies
them back layer by layer, on a GPU on a side stream so layer ``i + 1`` loads while layer ``i``
computes (the layer-wise overlap of SGLang HiCache / Mooncake's store).

Design notes: docs/DESIGN.md#kvcachehostpy"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from swaserve.kvcache.storage import PagedKV

if TYPE_CHECKING:
    from swaserve.kvcache.pool import PagePool
    from swaserve.kvcache.storage import KVStorage


class HostKVStorage:
    """Host tensors for ``host_pages`` pages per kind (or an arena of ``units`` units, laid out as
    the device's), copying to/from a device ``KVStorage``.

    Args:
        device_storage: the device pools' tensors.
        host_pages: {kind: pages} of the host tier; ignored with ``units``.
        page_size: tokens per page.
        units: host arena units (a shared host budget, ``KVCacheManager`` ``host_bytes``); the
            host pools are then bound with ``bind`` as the device ones.
    """

    def __init__(
        self,
        device_storage: KVStorage,
        host_pages: dict[str, int],
        page_size: int,
        units: int | None = None,
    ) -> None:
        self.dev = device_storage
        self.page_size = page_size
        self.device = next(
            (t.device for ks, _ in device_storage.kv.values() for t in ks), torch.device("cpu")
        )
        pin = self.device.type == "cuda"
        self.store = PagedKV(
            device_storage.cfg, page_size, device_storage.model_dtype, "cpu", host_pages, units, pin,
            device_storage.formats,
        )  # fmt: skip
        self.kv = self.store.kv
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._events: dict[tuple[str, int], torch.cuda.Event] = {}

    def bind(self, kind: str, pool: PagePool) -> None:
        """Read a host pool's page -> unit map (a host arena)."""
        self.store.bind(kind, pool)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def _rows(
        self, kind: str, group: int, dev_pages: list[int], host_pages: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.dev.page_rows(kind, group, dev_pages).to(self.device)
        return d, self.store.page_rows(kind, group, host_pages)

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None:
        if not dev_pages:
            return
        self.sync()
        rows = {g: self._rows(kind, g, dev_pages, host_pages) for g in set(self.dev.groups[kind])}
        for src, dst in zip(self.dev.kv[kind], self.kv[kind], strict=True):
            for j, (s, t) in enumerate(zip(src, dst, strict=True)):
                d, h = rows[self.dev.groups[kind][j]]
                t[h] = s[d].to("cpu")

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None:
        if not dev_pages:
            return
        rows = {g: self._rows(kind, g, dev_pages, host_pages) for g in set(self.dev.groups[kind])}
        ks, vs = self.dev.kv[kind]
        hk, hv = self.kv[kind]
        if self._stream is not None:  # the pages may have been read by kernels still in flight
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for j in range(len(ks)):
            d, h = rows[self.dev.groups[kind][j]]
            if self._stream is None:
                ks[j][d] = hk[j][h]
                vs[j][d] = hv[j][h]
                continue
            with torch.cuda.stream(self._stream):
                ks[j][d] = hk[j][h].to(self.device, non_blocking=True)
                vs[j][d] = hv[j][h].to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
                self._events[(kind, j)] = ev

    def wait_layer(self, kind: str, layer: int) -> None:
        """Make the compute stream wait for layer ``layer`` of ``kind``'s pending loads."""
        ev = self._events.pop((kind, layer), None)
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def pending(self) -> bool:
        return bool(self._events)

    def sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
            self._events.clear()
