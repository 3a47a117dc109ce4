"""GCache's UCX wire format (no ucxx import): a request or a reply is a head, then its buffers,
each buffer one tag message.

- Header ``<4sBBHQII``, 24 bytes: magic ``SWGU``, version (1), op (a reply echoes it; ``OP_REFUSED``
  means the server refused the frame and closes the connection), status (0 in requests; in replies
  a gRPC status code number, 0 OK), request id, meta bytes, buffer count.
- Tail: the meta bytes (the node's protobuf), then one u64 little-endian length per buffer.
- The head is the header and the tail in one message when they fit ``INLINE_BYTES``, else the
  header then the tail. Empty buffers are not sent.
- A reply whose header, tail and buffers fit ``REPLY_HEAD_BYTES`` is one message: its op carries
  ``PACKED`` and the buffers follow the tail in order (the client posts a head buffer that large,
  so a small get costs one message and no receive posted after the head arrives).

A request's head goes on the endpoint's own tag; every other message on a tag made of the request
id and the part number (``message_tag``), so calls share one endpoint without waiting for each
other. ``_send`` / ``_recv_rest`` take any endpoint whose ``send(buf, tag=)`` / ``recv(buf, tag=)``
return awaitables (``ucx_ep.FastEndpoint``'s futures, or ucxx's coroutines)."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gcache.recv_pool import POOL

MAGIC = b"SWGU"
VERSION = 2
PACKED = 0x80  # op flag: a reply whose buffers follow its tail in the head message (ops: 1..127)
HEADER = struct.Struct("<4sBBHQII")  # magic, version, op, status, request id, meta bytes, buffers
OP_REFUSED = 0  # a reply's op when the server refused the frame (the connection then closes)
OK, INVALID_ARGUMENT, INTERNAL = 0, 3, 13  # gRPC status code numbers
INLINE_BYTES = 4096  # a head (header + tail) up to this size is one message
REPLY_HEAD_BYTES = 256 << 10  # a reply up to this size (header, tail, buffers) is one message
MAX_META_BYTES = 16 << 20
MAX_BUFFERS = 65536
MAX_BUFFER_BYTES = 1 << 30
MAX_MESSAGE_BYTES = 4 << 30  # the sum of one request's (or reply's) buffers
_PART_BITS = 24  # message tags: request id << 24 | part (0 reply head, 1 tail, 2 + i buffer i)

Buffer = bytes | bytearray | memoryview


class UcxTransportError(ConnectionError):
    """The UCX transport failed: no connection, the peer died or did not answer in time, or a
    malformed frame. The message says which."""


class FrameError(ValueError):
    """A frame that breaks the wire format or a limit."""


@dataclass(frozen=True)
class Reply:
    """A reply: status (a gRPC status code number, 0 OK), meta (the node's protobuf, or an error
    message when status is not 0), buffers (page objects), done (called once the reply is sent
    or dropped: the buffers may be views that must stay valid until then)."""

    status: int
    meta: Buffer = b""
    buffers: Sequence[Any] = field(default_factory=tuple)
    done: Callable[[], None] | None = None


# -- framing ---------------------------------------------------------------------------------------
def message_tag(rid: int, part: int) -> int:
    """The tag (before ucxx mixes in the endpoint's) of part ``part`` of request ``rid``'s messages
    but its request head: 0 the reply head, 1 a tail sent apart, ``2 + i`` buffer ``i``."""
    return (rid << _PART_BITS) | part


def _view(b: Any, writable: bool = False) -> memoryview:
    """A flat byte view of a contiguous buffer. Raises TypeError / ValueError otherwise."""
    mv = memoryview(b)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("a receive buffer (into) must be writable")
    return mv


@dataclass(frozen=True)
class Frame:
    """A parsed header: op (``PACKED`` taken off), status, rid (request id), meta_len (bytes),
    nbuf (buffers), packed (the buffers came in the head's message too)."""

    op: int
    status: int
    rid: int
    meta_len: int
    nbuf: int
    packed: bool = False

    @property
    def inline(self) -> bool:
        """Whether the tail came in the head's message."""
        return self.packed or HEADER.size + self.meta_len + 8 * self.nbuf <= INLINE_BYTES


def pack_header(op: int, status: int, rid: int, meta_len: int, nbuf: int) -> bytes:
    """A header (``HEADER``) of this version. Raises struct.error for a field out of range."""
    return HEADER.pack(MAGIC, VERSION, op, status, rid, meta_len, nbuf)


def parse_header(raw: Buffer, max_meta: int = MAX_META_BYTES, max_buffers: int = MAX_BUFFERS) -> Frame:
    """The header at the start of ``raw`` (a head). Raises ``FrameError`` (too short, magic,
    version, meta or buffer count over the limits)."""
    if len(raw) < HEADER.size:
        raise FrameError(f"a header is {HEADER.size} bytes, got {len(raw)}")
    magic, version, op, status, rid, meta_len, nbuf = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise FrameError(f"protocol version {version}, this side speaks {VERSION}")
    if meta_len > max_meta:
        raise FrameError(f"meta of {meta_len} bytes, at most {max_meta}")
    if nbuf > max_buffers:
        raise FrameError(f"{nbuf} buffers in one message, at most {max_buffers}")
    return Frame(op & ~PACKED, status, rid, meta_len, nbuf, bool(op & PACKED))


def _send(
    ep: Any, op: int, status: int, rid: int, meta: Buffer, views: Sequence[memoryview], request: bool
) -> asyncio.Future[Any]:
    """Post a head (a request's on the endpoint's own tag) and the buffers ``views``: a future
    done once all are sent (often done already: a small message completes as it is posted)."""
    tail = bytes(meta) + struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
    if not request and views and HEADER.size + len(tail) + sum(v.nbytes for v in views) <= REPLY_HEAD_BYTES:
        packed = b"".join([pack_header(op | PACKED, status, rid, len(meta), len(views)), tail, *views])
        return asyncio.ensure_future(ep.send(packed, tag=message_tag(rid, 0)))
    head = pack_header(op, status, rid, len(meta), len(views))
    inline = HEADER.size + len(tail) <= INLINE_BYTES
    sends = [ep.send(head + tail if inline else head, **({} if request else {"tag": message_tag(rid, 0)}))]
    if tail and not inline:
        sends.append(ep.send(tail, tag=message_tag(rid, 1)))
    sends += [ep.send(v, tag=message_tag(rid, 2 + i)) for i, v in enumerate(views) if v.nbytes]
    return asyncio.ensure_future(sends[0]) if len(sends) == 1 else asyncio.gather(*sends)


async def _recv_rest(
    ep: Any, f: Frame, head: Buffer, max_buffer: int, max_total: int, into: Sequence[memoryview] = ()
) -> tuple[bytes, list[memoryview]]:
    """The meta and buffers of the message whose head (``f``, parsed from ``head``) arrived.
    Buffer ``i`` lands in ``into[i]`` when that holds it, else in a buffer of ``POOL``
    (``recv_pool``; a packed reply's: a view of ``head``). Raises ``FrameError`` for a buffer
    over ``max_buffer``, all over ``max_total`` bytes, or a packed reply longer than ``head``."""
    if f.inline:
        tail: Buffer = memoryview(head)[HEADER.size : HEADER.size + f.meta_len + 8 * f.nbuf]
    else:
        tail = bytearray(f.meta_len + 8 * f.nbuf)
        await ep.recv(tail, tag=message_tag(f.rid, 1))
    lengths = struct.unpack_from(f"<{f.nbuf}Q", tail, f.meta_len)
    for i, n in enumerate(lengths):
        if n > max_buffer:
            raise FrameError(f"buffer {i}: {n} bytes, at most {max_buffer}")
    if sum(lengths) > max_total:
        raise FrameError(f"{sum(lengths)} bytes of buffers in one message, at most {max_total}")
    bufs: list[memoryview] = []
    if f.packed:
        pos = HEADER.size + f.meta_len + 8 * f.nbuf
        if pos + sum(lengths) > len(head):
            raise FrameError(f"a packed reply of {pos + sum(lengths)} bytes in a {len(head)}-byte head")
        for i, n in enumerate(lengths):
            src = memoryview(head)[pos : pos + n]
            if i < len(into) and into[i].nbytes >= n:
                into[i][:n] = src
                src = into[i][:n]
            bufs.append(src)
            pos += n
        return bytes(tail[: f.meta_len]), bufs
    recvs = []
    for i, n in enumerate(lengths):
        dst = into[i][:n] if i < len(into) and into[i].nbytes >= n else POOL.take(n)
        bufs.append(dst)
        if n:
            recvs.append(ep.recv(dst, tag=message_tag(f.rid, 2 + i)))
    await asyncio.gather(*recvs)
    return bytes(tail[: f.meta_len]), bufs
