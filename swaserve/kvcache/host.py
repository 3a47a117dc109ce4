"""Host-memory KV tier (L2): page tensors in host memory and the copies between tiers.

Per kind and layer ``host_k [host_pages, page_size, num_kv_heads, head_dim]`` and ``host_v [...,
v_head_dim]`` (pinned when CUDA is used). ``to_host`` copies device pages out; ``to_device`` copies
them back layer by layer, on a GPU on a side stream so layer ``i + 1`` loads while layer ``i``
computes (the layer-wise overlap of SGLang HiCache / Mooncake's store).

Design notes: docs/DESIGN.md#kvcachehostpy"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from swaserve.kvcache.storage import KVStorage


class PageMover(Protocol):
    """Moves KV pages between the device pools and the host tier (kind: "full_attention" /
    "sliding_attention")."""

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None: ...

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None: ...

    def sync(self) -> None:
        """Wait until every copy issued so far is done (before host pages are reused)."""


class NoCopy:
    """A ``PageMover`` for page accounting without KV tensors (``swaserve bench prefix-cache``)."""

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None:
        return None

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None:
        return None

    def sync(self) -> None:
        return None


class HostKVStorage:
    """Host tensors for ``host_pages`` pages per kind, copying to/from a device ``KVStorage``.

    Args:
        device_storage: the device pools' tensors.
        host_pages: {kind: pages} of the host tier.
        page_size: tokens per page.
    """

    def __init__(self, device_storage: KVStorage, host_pages: dict[str, int], page_size: int) -> None:
        self.dev = device_storage
        self.page_size = page_size
        self.device = next(
            (t.device for ks, _ in device_storage.kv.values() for t in ks), torch.device("cpu")
        )
        pin = self.device.type == "cuda"
        self.kv: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for kind, (ks, vs) in device_storage.kv.items():
            n = host_pages.get(kind, 0)

            def alloc(t: torch.Tensor, n: int = n) -> torch.Tensor:
                return torch.zeros((n, page_size, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)

            self.kv[kind] = ([alloc(t) for t in ks], [alloc(t) for t in vs])
        self._stream = torch.cuda.Stream(self.device) if pin else None
        self._events: dict[tuple[str, int], torch.cuda.Event] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ks, vs in self.kv.values() for t in ks + vs)

    def _paged(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, self.page_size, *t.shape[1:])

    def to_host(self, kind: str, dev_pages: list[int], host_pages: list[int]) -> None:
        if not dev_pages:
            return
        self.sync()
        d = torch.tensor(dev_pages, dtype=torch.int64, device=self.device)
        h = torch.tensor(host_pages, dtype=torch.int64)
        for src, dst in zip(self.dev.kv[kind], self.kv[kind], strict=True):
            for s, t in zip(src, dst, strict=True):
                t[h] = self._paged(s)[d].to("cpu")

    def to_device(self, kind: str, host_pages: list[int], dev_pages: list[int]) -> None:
        if not dev_pages:
            return
        d = torch.tensor(dev_pages, dtype=torch.int64, device=self.device)
        h = torch.tensor(host_pages, dtype=torch.int64)
        ks, vs = self.dev.kv[kind]
        hk, hv = self.kv[kind]
        if self._stream is not None:  # the pages may have been read by kernels still in flight
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        for j in range(len(ks)):
            if self._stream is None:
                self._paged(ks[j])[d] = hk[j][h]
                self._paged(vs[j])[d] = hv[j][h]
                continue
            with torch.cuda.stream(self._stream):
                self._paged(ks[j])[d] = hk[j][h].to(self.device, non_blocking=True)
                self._paged(vs[j])[d] = hv[j][h].to(self.device, non_blocking=True)
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
