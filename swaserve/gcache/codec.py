"""The GCache page object: one page of one attention kind over all its layers, header first.

Header (little-endian): magic ``SWGC``, version u16, kind u8 (0 full, 1 SWA), flags u8 (bit 0: the
first page of its sequence), page size u16, reserved u16, page index u32, salt seed [16], key [16],
parent key [16], payload length u64, payload CRC-32 u32, header CRC-32 u32 (over the header with this
field zero, tokens included), then the page's token ids u32 [page size]; padded to 64 bytes. The
payload follows: for each layer of the kind, K ``[page, kv_heads, head_dim]`` then V ``[page,
kv_heads, v_head_dim]``, contiguous (page-first, as SGLang HiCache's ``page_first`` layout).

Every read is checked by ``verify`` against what the reader expects (a reader recomputes the chain
from its own tokens, so a colliding or misplaced page is refused); a bad page is a ``CorruptPage``.
Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAGIC = b"SWGC"
VERSION = 1
FULL_KIND, SWA_KIND = 0, 1
KIND_NAMES = {FULL_KIND: "full", SWA_KIND: "swa"}
FIRST_PAGE = 1
_FIXED = struct.Struct("<4sHBBHHI16s16s16sQII")
_CRC_AT = _FIXED.size - 4  # offset of the header CRC field


class CorruptPage(ValueError):
    """A page object that fails a check (message says which)."""


def header_size(page_size: int) -> int:
    """Bytes of a header for ``page_size`` tokens (64-byte aligned)."""
    n = _FIXED.size + 4 * page_size
    return (n + 63) // 64 * 64


@dataclass(frozen=True)
class Header:
    kind: int
    index: int  # page index in its sequence (0 = the first page)
    salt: bytes
    key: bytes
    parent: bytes  # the previous page's key, or the salt seed for page 0
    tokens: tuple[int, ...]
    payload_len: int
    payload_crc: int

    @property
    def page_size(self) -> int:
        return len(self.tokens)

    @property
    def object_size(self) -> int:
        return header_size(self.page_size) + self.payload_len


def encode(
    kind: int,
    index: int,
    salt: bytes,
    key: bytes,
    parent: bytes,
    tokens: Sequence[int],
    payload: bytes | memoryview,
) -> bytes:
    """One page object (header + payload). Raises ValueError on a bad kind or token id."""
    if kind not in KIND_NAMES:
        raise ValueError(f"unknown page kind {kind}")
    toks = np.asarray(tokens, dtype=np.int64)
    if toks.size and (toks.min() < 0 or toks.max() >= 2**32):
        raise ValueError("token ids must be in [0, 2**32)")
    ps = len(tokens)
    hs = header_size(ps)
    out = bytearray(hs + len(payload))
    flags = FIRST_PAGE if index == 0 else 0
    crc = zlib.crc32(payload)
    _FIXED.pack_into(
        out, 0, MAGIC, VERSION, kind, flags, ps, 0, index, salt, key, parent, len(payload), crc, 0
    )
    out[_FIXED.size : _FIXED.size + 4 * ps] = toks.astype("<u4").tobytes()
    struct.pack_into("<I", out, _CRC_AT, zlib.crc32(memoryview(out)[:hs]))
    out[hs:] = payload
    return bytes(out)


def decode_header(obj: bytes | bytearray | memoryview) -> Header:
    """Parse and check a header (magic, version, header CRC, sizes). Raises ``CorruptPage``."""
    view = memoryview(obj)
    if len(view) < _FIXED.size:
        raise CorruptPage(f"object of {len(view)} bytes is shorter than a header")
    magic, ver, kind, flags, ps, _, index, salt, key, parent, plen, pcrc, hcrc = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptPage("bad magic")
    if ver != VERSION:
        raise CorruptPage(f"page format version {ver}, this reader knows {VERSION}")
    hs = header_size(ps)
    if len(view) < hs:
        raise CorruptPage("truncated header")
    head = bytearray(view[:hs])
    struct.pack_into("<I", head, _CRC_AT, 0)
    if zlib.crc32(head) != hcrc:
        raise CorruptPage("header CRC mismatch")
    if kind not in KIND_NAMES:
        raise CorruptPage(f"unknown page kind {kind}")
    if bool(flags & FIRST_PAGE) != (index == 0):
        raise CorruptPage("first-page flag disagrees with the page index")
    toks = np.frombuffer(bytes(view[_FIXED.size : _FIXED.size + 4 * ps]), dtype="<u4")
    return Header(kind, index, salt, key, parent, tuple(toks.tolist()), plen, pcrc)


def check_stored(raw: bytes | memoryview) -> Header:
    """The header of the object at the start of ``raw`` (a slot's bytes, padding after the object),
    checked with its payload (``verify``). Raises ``CorruptPage``."""
    h = decode_header(raw)
    if h.object_size > len(raw):
        raise CorruptPage("object larger than its slot")
    verify(raw[: h.object_size], kind=h.kind, salt=h.salt, key=h.key)
    return h


def verify(
    obj: bytes | bytearray | memoryview,
    *,
    kind: int,
    salt: bytes,
    key: bytes,
    parent: bytes | None = None,
    tokens: Sequence[int] | None = None,
    index: int | None = None,
    payload_len: int | None = None,
    header: Header | None = None,
) -> memoryview:
    """Check a whole object against what the reader expects; returns the payload view.
    ``header``: ``decode_header(obj)`` when the caller has it already.

    Raises ``CorruptPage`` naming the first mismatch (header, kind, salt, key, parent, index,
    tokens, length, payload CRC)."""
    h = header or decode_header(obj)
    view = memoryview(obj)
    if h.kind != kind:
        raise CorruptPage(f"kind {KIND_NAMES[h.kind]}, expected {KIND_NAMES.get(kind, kind)}")
    if h.salt != salt:
        raise CorruptPage("salt mismatch (another model, weights, dtype or layout)")
    if h.key != key:
        raise CorruptPage("key mismatch")
    if parent is not None and h.parent != parent:
        raise CorruptPage("parent key mismatch")
    if index is not None and h.index != index:
        raise CorruptPage(f"page index {h.index}, expected {index}")
    if tokens is not None and tuple(map(int, tokens)) != h.tokens:
        raise CorruptPage("token ids mismatch")
    if payload_len is not None and h.payload_len != payload_len:
        raise CorruptPage(f"payload of {h.payload_len} bytes, expected {payload_len}")
    hs = header_size(h.page_size)
    if len(view) != hs + h.payload_len:
        raise CorruptPage(f"object of {len(view)} bytes, header says {hs + h.payload_len}")
    payload = view[hs:]
    if zlib.crc32(payload) != h.payload_crc:
        raise CorruptPage("payload CRC mismatch")
    return payload
