"""The embeddings of one item on the wire: ``Encoder.Fetch``'s stream of ``EmbeddingChunk``.

The first message is the header (``num_tokens``, ``hidden``, ``dtype``; no rows), then rows
``[row_start, row_end)`` of the row-major ``[num_tokens, hidden]`` tensor in order, little-endian,
each message with the CRC-32 (``zlib.crc32``) of its ``data``, and each under ``max_bytes`` so a
stream of any size passes gRPC's 4 MiB default message bound (the pattern of ``KVTransfer``:
services/convert.py). ``chunks`` writes a stream, ``Assembler`` reads one back and checks it:
header first, contiguous rows, the CRC of each chunk, the dtype and the total size against a
bound the reader sets (``WireError`` with a message otherwise).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from services.encoder.limits import CHUNK_BYTES, MAX_EMBEDDING_BYTES, MESSAGE_OVERHEAD
from swaserve.v1 import encoder_pb2 as pb

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


class WireError(ValueError):
    """A stream that is not one item's embeddings: bad header, rows out of order, a CRC
    mismatch, a dtype or size out of bounds, or an early end."""


def chunks(emb: torch.Tensor, max_bytes: int = CHUNK_BYTES) -> Iterator[pb.EmbeddingChunk]:
    """The messages of ``emb`` (``[n, hidden]``; float32, bfloat16 or float16; any device):
    the header, then as many whole rows per message as keep it under ``max_bytes``.

    Raises:
        ValueError: not 2-D, an unsupported dtype, or one row (+ ``MESSAGE_OVERHEAD``) over
            ``max_bytes``.
    """
    if emb.dim() != 2:
        raise ValueError(f"embeddings must be [num_tokens, hidden], got shape {tuple(emb.shape)}")
    name = DTYPE_NAMES.get(emb.dtype)
    if name is None:
        raise ValueError(f"unsupported embedding dtype {emb.dtype} (supported: {', '.join(DTYPES)})")
    n, hidden = emb.shape
    row_bytes = hidden * emb.element_size()
    per = (max_bytes - MESSAGE_OVERHEAD) // row_bytes if row_bytes else n
    if n and per < 1:
        raise ValueError(f"a row of {row_bytes} bytes does not fit a {max_bytes}-byte message")
    yield pb.EmbeddingChunk(num_tokens=n, hidden=hidden, dtype=name)
    flat = emb.detach().to("cpu").contiguous().view(torch.uint8)  # [n, row_bytes], host order = LE
    for start in range(0, n, max(per, 1)):
        end = min(n, start + per)
        data = flat[start:end].numpy().tobytes()
        yield pb.EmbeddingChunk(row_start=start, row_end=end, data=data, crc32=zlib.crc32(data))


class Assembler:
    """Reads one ``Fetch`` stream back into a tensor: ``feed`` each message, then ``finish``.

    Args:
        max_bytes: the largest embedding (``num_tokens * hidden * dtype size``, bytes) accepted;
            the header is checked against it before any row arrives.

    Raises (``feed``, ``finish``): ``WireError`` (module docstring).
    """

    def __init__(self, max_bytes: int = MAX_EMBEDDING_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_tokens = self.hidden = 0
        self.dtype: torch.dtype | None = None
        self._buf: bytearray | None = None
        self._row_bytes = 0
        self._next = 0  # the next row expected
        self.bytes = 0  # row bytes received so far

    def feed(self, chunk: pb.EmbeddingChunk) -> None:
        """Take the next message of the stream."""
        if self._buf is None:
            self._header(chunk)
            return
        if chunk.dtype or chunk.num_tokens or chunk.hidden:
            raise WireError("a second header in one stream")
        start, end = chunk.row_start, chunk.row_end
        if start != self._next:
            raise WireError(f"rows [{start}, {end}) arrived where row {self._next} was expected")
        if not start < end <= self.num_tokens:
            raise WireError(f"rows [{start}, {end}) out of the item's {self.num_tokens} rows")
        size = (end - start) * self._row_bytes
        if len(chunk.data) != size:
            raise WireError(f"rows [{start}, {end}) carry {len(chunk.data)} bytes, expected {size}")
        if zlib.crc32(chunk.data) != chunk.crc32:
            raise WireError(f"rows [{start}, {end}): CRC-32 mismatch")
        self._buf[start * self._row_bytes : end * self._row_bytes] = chunk.data
        self._next = end
        self.bytes += size

    def _header(self, h: pb.EmbeddingChunk) -> None:
        if not h.dtype:
            raise WireError("the stream did not start with a header")
        if h.data or h.row_end:
            raise WireError("a header carrying rows")
        dtype = DTYPES.get(h.dtype)
        if dtype is None:
            raise WireError(f"unsupported dtype {h.dtype!r} (supported: {', '.join(DTYPES)})")
        if h.hidden < 1:
            raise WireError(f"hidden size {h.hidden}: must be >= 1")
        self._row_bytes = h.hidden * dtype.itemsize
        total = h.num_tokens * self._row_bytes
        if total > self.max_bytes:
            raise WireError(
                f"embeddings of {h.num_tokens} x {h.hidden} {h.dtype} ({total} bytes) over the "
                f"{self.max_bytes}-byte bound"
            )
        self.num_tokens, self.hidden, self.dtype = h.num_tokens, h.hidden, dtype
        self._buf = bytearray(total)

    def finish(self) -> torch.Tensor:
        """The embeddings ``[num_tokens, hidden]`` (CPU, the wire's dtype), once every row came."""
        if self._buf is None or self.dtype is None:
            raise WireError("the stream ended before its header")
        if self._next != self.num_tokens:
            raise WireError(f"the stream ended at row {self._next} of {self.num_tokens}")
        if not self._buf:
            return torch.empty((self.num_tokens, self.hidden), dtype=self.dtype)
        return torch.frombuffer(self._buf, dtype=self.dtype).view(self.num_tokens, self.hidden)
