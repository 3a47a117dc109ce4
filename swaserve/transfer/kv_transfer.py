"""Prefill -> decode KV transfer, sans IO: what is sent, how it is cut into pages, how it is staged.

For a prompt of ``n`` tokens: full-attention layers' K/V of positions ``[0, n)``, SWA layers' K/V of
``[max(0, n - W), n)``. ``KVPayload`` (``gather``/``scatter`` against the pools), ``to_pages`` (wire
pages with CRC-32), ``KVStaging`` (decode-side host staging, verified page by page). Nothing here
touches device pools.

Design notes: docs/DESIGN.md#transferkv_transferpy"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from swaserve.config import FULL, SWA
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.storage import KVStorage
from swaserve.kvformat import AUTO, AUTO_FORMAT, KVFormat

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TransferError(ValueError):
    """A KV page failed verification (checksum, shape, dtype, range) or a transfer is incomplete."""


class StagingFull(TransferError):
    """Staging has no room for a transfer now (a capacity refusal, not a fault: retry later)."""


class StagingTooSmall(TransferError):
    """A transfer larger than the whole staging: it can never be staged on this decode worker."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise TransferError(f"unsupported KV dtype {dtype}")


def page_format(fmt: KVFormat, dtype: torch.dtype) -> str:
    """What a page message names as its ``dtype``: the model dtype's name for ``auto`` pages
    (``"bfloat16"``), else the quantized format (``KVFormat.describe``: name, group, scale layout),
    whose rows are packed bytes."""
    return dtype_name(dtype) if not fmt.quantized else fmt.describe()


@dataclass
class KVPayload:
    """The KV one request's decode needs, in host or device tensors.

    Attributes:
        request_id: the request.
        num_tokens: prompt tokens ``n`` whose KV this is.
        window: SWA window ``W`` (previous tokens a query sees).
        kv: per kind, per layer of that kind, ``(k, v)``: full ``[n, kv_heads, head_dim]``, SWA
            ``[min(n, W), kv_heads, head_dim]`` (positions ``[n - min(n, W), n)``); v's last dim
            is ``v_head_dim``.
        sampler_state: a seeded request's ``torch.Generator`` state after its first token.
        spec_drafts: MTP on: the first draft tokens after the first token (``engine.drafter``).
        mtp_hidden: MTP on: [m, hidden] the target's pre-final-norm hidden states of positions
            ``[n - m, n)``, which the decoder's first MTP rows read (m <= its MTP layers).
        formats: per kind, the page format (``page_format``) of quantized K/V: their tensors are
            packed rows ``[.., kv_heads, row_bytes]`` uint8 (``swaserve.kvformat``); absent: the
            tensors' own dtype.
    """

    request_id: str
    num_tokens: int
    window: int
    kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    sampler_state: bytes = b""  # seeded requests: RNG state after the first token (empty: none)
    spec_drafts: list[int] = field(default_factory=list)
    mtp_hidden: torch.Tensor | None = None
    formats: dict[str, str] = field(default_factory=dict)

    def token_range(self, kind: str) -> tuple[int, int]:
        """Positions ``[lo, n)`` whose KV the payload carries for ``kind``."""
        n = self.num_tokens
        return (0, n) if kind == FULL else (max(0, n - self.window), n)

    def nbytes(self) -> int:
        h = self.mtp_hidden
        extra = h.numel() * h.element_size() if h is not None else 0
        return extra + sum(
            t.numel() * t.element_size() for layers in self.kv.values() for kv in layers for t in kv
        )


@dataclass(frozen=True)
class KVPage:
    """One page of one layer's K and V, as sent on the wire (``protos/swaserve/v1/kv_transfer.proto``).

    ``k``/``v`` are the raw bytes of ``[token_end - token_start, kv_heads, head_dim]`` tensors in
    ``dtype`` (``page_format``: for a quantized format, ``[.., kv_heads, row_bytes]`` packed rows,
    head_dim in the shapes standing for the row's bytes); ``checksum`` is CRC-32 (zlib) of ``k + v``.
    """

    request_id: str
    kind: str  # "full" | "swa"
    layer: int  # index among the layers of this kind
    token_start: int
    token_end: int
    page_size: int
    dtype: str
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    k: bytes
    v: bytes
    checksum: int

    def nbytes(self) -> int:
        return len(self.k) + len(self.v)


def _checksum(k: bytes, v: bytes) -> int:
    return zlib.crc32(v, zlib.crc32(k))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def to_pages(payload: KVPayload, page_size: int, pages_per_message: int = 1) -> Iterator[KVPage]:
    """Cut ``payload`` into page messages: per kind (full then SWA), per layer, runs of up to
    ``pages_per_message`` pages (fewer, bigger messages cost less per byte); a message's token
    range is clipped to the positions the payload carries (so the first SWA page and the last
    page of each layer can be partial)."""
    span = page_size * max(1, pages_per_message)
    for kind in (FULL, SWA):
        lo, hi = payload.token_range(kind)
        for layer, (k, v) in enumerate(payload.kv.get(kind, [])):
            dt = payload.formats.get(kind) or dtype_name(k.dtype)
            start = lo
            while start < hi:
                end = min(hi, (start // page_size) * page_size + span)
                kp, vp = k[start - lo : end - lo], v[start - lo : end - lo]
                kb, vb = _tensor_bytes(kp), _tensor_bytes(vp)
                yield KVPage(
                    payload.request_id, kind, layer, start, end, page_size, dt,
                    tuple(kp.shape), tuple(vp.shape), kb, vb, _checksum(kb, vb),
                )  # fmt: skip
                start = end


def _pages(lo: int, hi: int, page_size: int) -> int:
    return 0 if hi <= lo else (hi - 1) // page_size - lo // page_size + 1


def expected_pages(
    num_tokens: int, window: int, page_size: int, layers: dict[str, int], pages_per_message: int = 1
) -> int:
    """How many messages ``to_pages`` sends for a prompt of ``num_tokens`` tokens."""
    total = 0
    for kind, n_layers in layers.items():
        lo, hi = (0, num_tokens) if kind == FULL else (max(0, num_tokens - window), num_tokens)
        pages = _pages(lo, hi, page_size)
        total += -(-pages // max(1, pages_per_message)) * n_layers
    return total


@dataclass
class LayerShape:
    """K/V shape of one layer kind: heads and head dims (``ModelConfig.full`` / ``.swa``)."""

    kv_heads: int
    head_dim: int
    v_head_dim: int


class KVStaging:
    """Decode side: assembles the pages of transfers in host memory, verified page by page.

    Args:
        layers: number of layers per kind, e.g. ``{"full": 10, "swa": 60}``.
        shapes: per-kind ``LayerShape``.
        window: SWA window ``W``. page_size: tokens per page. dtype: the model's KV dtype.
        max_bytes: host bytes staging may hold at once; a transfer that would exceed it is refused.
        formats: per kind, this worker's page format (``swaserve.kvformat``; default ``auto``):
            pages in another format are refused (their bytes are never reinterpreted).
    """

    def __init__(
        self,
        layers: dict[str, int],
        shapes: dict[str, LayerShape],
        window: int,
        page_size: int,
        dtype: torch.dtype,
        max_bytes: int = 1 << 32,
        formats: Mapping[str, KVFormat] | None = None,
    ) -> None:
        self.layers, self.shapes = layers, shapes
        self.window, self.page_size, self.dtype = window, page_size, dtype
        self.max_bytes = max_bytes
        self.formats = {kind: (formats or {}).get(kind, AUTO_FORMAT) for kind in layers}
        self._open: dict[str, tuple[KVPayload, set[tuple[str, int, int]]]] = {}
        self._bytes: dict[str, int] = {}
        self._done: set[str] = set()

    @property
    def staged_bytes(self) -> int:
        return sum(self._bytes.values())

    def transfer_bytes(self, num_tokens: int) -> int:
        """Staging bytes a transfer of ``num_tokens`` prompt tokens takes: every full layer's KV
        for all of them, every SWA layer's for the last ``window``."""
        size = 0
        for kind, n_layers in self.layers.items():
            lo, hi = KVPayload("", num_tokens, self.window).token_range(kind)
            s = self.shapes[kind]
            row = self.formats[kind].token_bytes(s.kv_heads, s.head_dim, s.v_head_dim, self.dtype.itemsize)
            size += n_layers * (hi - lo) * row
        return size

    def max_tokens(self, limit: int) -> int:
        """The longest prompt (at most ``limit`` tokens) whose transfer fits the whole staging:
        longer ones raise ``StagingTooSmall`` in ``begin``; 0 when not even one token fits."""
        lo, hi = 0, limit  # transfer_bytes grows with the tokens: the last n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.transfer_bytes(mid) <= self.max_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def begin(
        self,
        request_id: str,
        num_tokens: int,
        sampler_state: bytes = b"",
        spec_drafts: list[int] | None = None,
        mtp_hidden: torch.Tensor | None = None,
    ) -> KVPayload:
        """Start staging a transfer of ``num_tokens`` prompt tokens' KV (allocates host tensors);
        the header's other fields go into the payload as they are (``KVPayload``). Returns the
        payload being filled: the transfer's identity for ``add`` / ``finish`` / ``discard``, so
        that a transfer superseded by a newer one of the same id never touches the newer one.

        Raises:
            TransferError: duplicate id, bad length; StagingFull: not enough staging memory now;
                StagingTooSmall: more than the whole staging.
        """
        if request_id in self._open:
            raise TransferError(f"transfer for {request_id!r} already open")
        if num_tokens < 1:
            raise TransferError(f"transfer of {num_tokens} tokens")
        payload = KVPayload(
            request_id,
            num_tokens,
            self.window,
            sampler_state=sampler_state,
            spec_drafts=list(spec_drafts or []),
            mtp_hidden=mtp_hidden,
        )
        size = self.transfer_bytes(num_tokens)
        if size > self.max_bytes:
            raise StagingTooSmall(
                f"the request's KV ({size} bytes) is larger than this decode worker's whole KV "
                f"staging ({self.max_bytes} bytes, --staging-memory)"
            )
        if self.staged_bytes + size > self.max_bytes:
            raise StagingFull(
                f"staging full: {self.staged_bytes} + {size} bytes > {self.max_bytes} (retry later)"
            )
        for kind, n_layers in self.layers.items():
            lo, hi = payload.token_range(kind)
            s, dt = self.shapes[kind], self._storage_dtype(kind)
            dk, dv = self._dims(kind)
            payload.kv[kind] = [
                (
                    torch.empty(hi - lo, s.kv_heads, dk, dtype=dt),
                    torch.empty(hi - lo, s.kv_heads, dv, dtype=dt),
                )
                for _ in range(n_layers)
            ]
            if self.formats[kind].quantized:
                payload.formats[kind] = self.formats[kind].describe()
        self._open[request_id] = (payload, set())
        self._bytes[request_id] = size
        return payload

    def _storage_dtype(self, kind: str) -> torch.dtype:
        return self.formats[kind].storage_dtype(self.dtype)

    def _dims(self, kind: str) -> tuple[int, int]:
        """Last dims of a page's K and V: head dims, or packed row bytes of a quantized format."""
        s, fmt, elem = self.shapes[kind], self.formats[kind], self.dtype.itemsize
        if not fmt.quantized:
            return s.head_dim, s.v_head_dim
        return fmt.row_bytes(s.head_dim, elem, key=True), fmt.row_bytes(s.v_head_dim, elem)

    def add(self, page: KVPage, transfer: KVPayload | None = None) -> None:
        """Verify one page and copy it into its request's staging tensors (``transfer``: only if
        that ``begin`` is still the request's open transfer).

        Raises:
            TransferError: unknown or superseded transfer, checksum mismatch, wrong
                dtype/shape/range, duplicate.
        """
        entry = self._open.get(page.request_id)
        if entry is None:
            raise TransferError(f"page for {page.request_id!r} without an open transfer")
        self._check_current(page.request_id, transfer)
        payload, seen = entry  # seen: (kind, layer, page index) received
        if page.request_id in self._done:
            raise TransferError(f"page for {page.request_id!r} after its transfer was finished")
        if page.kind not in self.layers or not 0 <= page.layer < self.layers[page.kind]:
            raise TransferError(f"page of unknown layer {page.kind}[{page.layer}]")
        want_format = page_format(self.formats[page.kind], self.dtype)
        if page.dtype != want_format:
            raise TransferError(
                f"{page.kind} page in KV format {page.dtype!r}, this decode worker stores {want_format!r}: "
                "prefill and decode workers need the same --dtype, --kv-cache-dtype(-swa), "
                "--kv-quant-group and --kv-kivi-* flags (pages are never reinterpreted)"
            )
        if page.page_size != self.page_size:
            raise TransferError(f"page size {page.page_size}, expected {self.page_size}")
        if _checksum(page.k, page.v) != page.checksum:
            raise TransferError(
                f"checksum mismatch on {page.request_id} {page.kind}[{page.layer}] "
                f"tokens [{page.token_start}, {page.token_end})"
            )
        lo, hi = payload.token_range(page.kind)
        a, b = page.token_start, page.token_end
        P = self.page_size
        if not (lo <= a < b <= hi) or (a != lo and a % P) or (b != hi and b % P):
            raise TransferError(f"page token range [{a}, {b}) not page-aligned inside [{lo}, {hi})")
        keys = {(page.kind, page.layer, i) for i in range(a // P, (b - 1) // P + 1)}
        if keys & seen:
            raise TransferError(
                f"duplicate page in {page.kind}[{page.layer}] [{a}, {b}) for {page.request_id}"
            )
        k_dst, v_dst = payload.kv[page.kind][page.layer]
        s, dt = self.shapes[page.kind], self._storage_dtype(page.kind)
        dk, dv = self._dims(page.kind)
        if page.k_shape != (b - a, s.kv_heads, dk) or page.v_shape != (b - a, s.kv_heads, dv):
            raise TransferError(f"page shapes {page.k_shape}/{page.v_shape} do not match the model")
        for dst, raw, shape in ((k_dst, page.k, page.k_shape), (v_dst, page.v, page.v_shape)):
            want = int(torch.Size(shape).numel()) * dt.itemsize
            if len(raw) != want:
                raise TransferError(f"page holds {len(raw)} bytes, shape needs {want}")
            src = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).view(shape)
            dst[a - lo : b - lo].copy_(src)
        seen |= keys

    def missing(self, request_id: str) -> int:
        """Pages (per layer) of an open transfer not received yet."""
        payload, seen = self._open[request_id]
        return expected_pages(payload.num_tokens, self.window, self.page_size, self.layers) - len(seen)

    def _check_current(self, request_id: str, transfer: KVPayload | None) -> None:
        if transfer is not None and self._open[request_id][0] is not transfer:
            raise TransferError(f"transfer for {request_id!r} was superseded by a newer one")

    def finish(self, request_id: str, transfer: KVPayload | None = None) -> None:
        """Mark a transfer complete (all pages verified); it stays staged until ``claim``.
        ``transfer``: as for ``add``.

        Raises:
            TransferError: unknown or superseded transfer, or pages missing (then it is dropped).
        """
        if request_id not in self._open:
            raise TransferError(f"no open transfer for {request_id!r}")
        self._check_current(request_id, transfer)
        left = self.missing(request_id)
        if left:
            self.discard(request_id)
            raise TransferError(f"transfer for {request_id!r} incomplete: {left} pages missing")
        self._done.add(request_id)

    def ready(self, request_id: str) -> bool:
        return request_id in self._done

    def claim(self, request_id: str) -> KVPayload:
        """Hand a complete transfer's payload over; staging forgets it.

        Raises:
            TransferError: unknown or incomplete transfer.
        """
        if request_id not in self._done:
            raise TransferError(f"no complete transfer for {request_id!r}")
        payload, _ = self._open.pop(request_id)
        self._done.discard(request_id)
        self._bytes.pop(request_id, None)
        return payload

    def discard(self, request_id: str, transfer: KVPayload | None = None) -> bool:
        """Drop a transfer (failed, aborted, or never claimed); with ``transfer``, only if that
        ``begin`` is still the request's transfer (a newer one of the same id stays). Returns
        whether one was dropped."""
        entry = self._open.get(request_id)
        if entry is None or (transfer is not None and entry[0] is not transfer):
            return False
        del self._open[request_id]
        self._done.discard(request_id)
        self._bytes.pop(request_id, None)
        return True

    def open_ids(self) -> list[str]:
        return list(self._open)


def gather(kv: KVCacheManager, storage: KVStorage, request_id: str, num_tokens: int) -> KVPayload:
    """Copy a request's prompt KV out of the device pools into host tensors (prefill role).

    Full layers: positions ``[0, n)``; SWA layers: ``[n - W, n)`` (all of ``[0, n)`` with the
    full layout, which keeps SWA KV for every token).
    """
    window = kv.swa.window if kv.swa.window is not None else num_tokens
    payload = KVPayload(request_id, num_tokens, window)
    for kind, mgr in ((FULL, kv.full), (SWA, kv.swa)):
        if kind == SWA and not kv.has_swa:
            continue
        if storage.formats[kind].quantized:
            payload.formats[kind] = storage.formats[kind].describe()
        lo, hi = payload.token_range(kind)
        slots = mgr.slots(request_id, lo, hi)
        layers = (storage.read(kind, j, slots) for j in range(len(storage.kv[kind][0])))
        payload.kv[kind] = [(k.cpu(), v.cpu()) for k, v in layers]
    return payload


def scatter(kv: KVCacheManager, storage: KVStorage, payload: KVPayload) -> None:
    """Copy a staged payload into the request's pages (decode role; the pages are allocated).

    Raises:
        ValueError: the payload's layer count or page format is not this engine's.
    """
    rid = payload.request_id
    for kind, mgr in ((FULL, kv.full), (SWA, kv.swa)):
        if kind not in payload.kv:
            continue
        got, mine = payload.formats.get(kind, AUTO), storage.formats[kind].describe()
        if got != mine:
            raise ValueError(f"payload's {kind} KV is in format {got!r}, this engine stores {mine!r}")
        lo, hi = payload.token_range(kind)
        slots = mgr.slots(rid, lo, hi)
        if len(payload.kv[kind]) != len(storage.kv[kind][0]):
            raise ValueError(
                f"payload has {len(payload.kv[kind])} {kind} layers, the model {len(storage.kv[kind][0])}"
            )
        for j, (k_src, v_src) in enumerate(payload.kv[kind]):
            storage.write(kind, j, slots, k_src, v_src)
