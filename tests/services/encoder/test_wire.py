"""The Fetch stream: chunks under the message bound, exact round trips per dtype, and every
malformed stream refused with a message (``WireError``)."""

from __future__ import annotations

import pytest
import torch

from services.encoder.limits import CHUNK_BYTES
from services.encoder.wire import Assembler, WireError, chunks
from swaserve.v1 import encoder_pb2 as pb


def _roundtrip(
    emb: torch.Tensor, max_bytes: int = CHUNK_BYTES
) -> tuple[torch.Tensor, list[pb.EmbeddingChunk]]:
    msgs = list(chunks(emb, max_bytes))
    asm = Assembler()
    for m in msgs:
        asm.feed(m)
    return asm.finish(), msgs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_large_embedding_round_trips_in_chunks_under_the_bound(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(1500, 1024, generator=g).to(dtype)  # 6 MiB in fp32, 3 MiB in 16-bit
    back, msgs = _roundtrip(emb)
    assert back.dtype == dtype and back.shape == emb.shape
    assert torch.equal(back.view(torch.uint8), emb.view(torch.uint8))  # bitwise (NaN-safe)
    assert msgs[0].dtype and not msgs[0].data  # the header first
    rows = msgs[1:]
    assert len(rows) >= 2 and all(m.ByteSize() < CHUNK_BYTES for m in msgs)
    assert [m.row_start for m in rows] == [0] + [m.row_end for m in rows[:-1]] and rows[-1].row_end == 1500


def test_small_messages_and_the_header_only_case() -> None:
    emb = torch.arange(12, dtype=torch.float32).view(3, 4)
    back, msgs = _roundtrip(emb, max_bytes=64 + 16)  # one 16-byte row per message
    assert torch.equal(back, emb) and len(msgs) == 4
    empty, msgs = _roundtrip(torch.empty(0, 8))
    assert empty.shape == (0, 8) and len(msgs) == 1
    with pytest.raises(ValueError, match="does not fit"):
        list(chunks(torch.zeros(2, 1024), max_bytes=1024))
    with pytest.raises(ValueError, match="unsupported"):
        list(chunks(torch.zeros(2, 2, dtype=torch.float64)))


def _msgs() -> list[pb.EmbeddingChunk]:
    return list(chunks(torch.randn(64, 32), max_bytes=64 + 32 * 4 * 8))  # 8 rows per message


def _feed(msgs: list[pb.EmbeddingChunk], max_bytes: int = 1 << 30) -> torch.Tensor:
    asm = Assembler(max_bytes)
    for m in msgs:
        asm.feed(m)
    return asm.finish()


def test_a_crc_mismatch_is_refused() -> None:
    msgs = _msgs()
    bad = bytearray(msgs[3].data)
    bad[5] ^= 0x01
    msgs[3] = pb.EmbeddingChunk(
        row_start=msgs[3].row_start, row_end=msgs[3].row_end, data=bytes(bad), crc32=msgs[3].crc32
    )
    with pytest.raises(WireError, match="CRC-32 mismatch"):
        _feed(msgs)


def test_rows_out_of_order_missing_or_past_the_end_are_refused() -> None:
    msgs = _msgs()
    with pytest.raises(WireError, match="where row 8 was expected"):
        _feed([msgs[0], msgs[1], msgs[3], msgs[2], *msgs[4:]])
    with pytest.raises(WireError, match="where row 16 was expected"):
        _feed([msgs[0], msgs[1], msgs[2], msgs[2], *msgs[3:]])  # a repeat
    with pytest.raises(WireError, match="ended at row 56 of 64"):
        _feed(msgs[:-1])
    h = msgs[0]
    short = pb.EmbeddingChunk(num_tokens=8, hidden=h.hidden, dtype=h.dtype)
    with pytest.raises(WireError, match="out of the item's 8 rows"):
        _feed([short, msgs[1], msgs[2]])


def test_a_bad_header_is_refused_before_any_row() -> None:
    msgs = _msgs()
    with pytest.raises(WireError, match="did not start with a header"):
        _feed(msgs[1:])
    with pytest.raises(WireError, match="ended before its header"):
        _feed([])
    with pytest.raises(WireError, match="over the 4096-byte bound"):
        _feed(msgs, max_bytes=4096)  # 64 x 32 fp32 = 8 KiB
    with pytest.raises(WireError, match="unsupported dtype 'int8'"):
        _feed([pb.EmbeddingChunk(num_tokens=1, hidden=1, dtype="int8")])
    with pytest.raises(WireError, match="a second header"):
        _feed([msgs[0], msgs[0], *msgs[1:]])
    wrong = pb.EmbeddingChunk(num_tokens=64, hidden=32, dtype="float16")  # the rows are fp32
    with pytest.raises(WireError, match="carry 1024 bytes, expected 512"):
        _feed([wrong, *msgs[1:]])
