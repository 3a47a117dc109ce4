"""Trace reader and trace -> token-id prompt construction."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.traces import (
    DEFAULT_MOONCAKE_TRACE,
    TRACE_BLOCK_TOKENS,
    MooncakeRequest,
    TokenBlocks,
    TraceError,
    read_mooncake,
    scaled_prompt_len,
    to_token_ids,
)


def test_committed_trace_is_the_upstream_file() -> None:
    digest = hashlib.sha256(DEFAULT_MOONCAKE_TRACE.read_bytes()).hexdigest()
    assert digest == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_read_mooncake_first_requests() -> None:
    reqs = read_mooncake(limit=3)
    assert len(reqs) == 3
    assert reqs[0] == MooncakeRequest(0, 6758, 500, tuple(range(14)))
    assert reqs[1].input_length == 7322 and reqs[1].output_length == 490
    assert reqs[1].hash_ids == (0, *range(14, 28))


def test_read_mooncake_whole_trace() -> None:
    reqs = read_mooncake()
    assert len(reqs) == 12031
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in itertools.pairwise(reqs))
    assert all(len(r.hash_ids) == math.ceil(r.input_length / TRACE_BLOCK_TOKENS) for r in reqs)
    assert all(r.hash_ids[0] == 0 for r in reqs)
    assert max(r.input_length for r in reqs) == 126195
    assert read_mooncake(limit=0) == []


def _write(tmp_path: Path, rows: Sequence[object]) -> Path:
    p = tmp_path / "t.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"timestamp": 0, "input_length": 10, "output_length": 1}, "missing field 'hash_ids'"),
        ({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}, "2)"),
        ({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}, "positive lengths"),
        ({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}, "non-negative"),
        ({"timestamp": 1.5, "input_length": 5, "output_length": 1, "hash_ids": [0]}, "integers"),
    ],
)
def test_read_mooncake_rejects_bad_rows(tmp_path: Path, row: object, message: str) -> None:
    with pytest.raises(TraceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_mooncake(_write(tmp_path, [row]))


def test_read_mooncake_rejects_decreasing_timestamps(tmp_path: Path) -> None:
    rows = [{"timestamp": t, "input_length": 5, "output_length": 1, "hash_ids": [0]} for t in (5, 3)]
    with pytest.raises(TraceError, match=r"t.jsonl:2: timestamp 3 < previous 5"):
        read_mooncake(_write(tmp_path, rows))


def test_scaled_prompt_len() -> None:
    assert scaled_prompt_len(6758, 16) == 212  # ceil(6758 * 16 / 512) = ceil(211.19)
    assert scaled_prompt_len(512, 16) == 16
    assert scaled_prompt_len(513, 16) == 17
    assert scaled_prompt_len(1, 16) == 1
    assert scaled_prompt_len(6758, 512) == 6758
    with pytest.raises(ValueError):
        scaled_prompt_len(10, 0)


def test_shared_hash_prefix_gives_shared_token_prefix() -> None:
    a = MooncakeRequest(0, 3 * 512, 1, (0, 1, 2))
    b = MooncakeRequest(0, 2 * 512 + 100, 1, (0, 1, 7))
    c = MooncakeRequest(0, 512 + 1, 1, (0, 9))
    blocks = TokenBlocks(16, 4096, (0, 1, 2), seed=0)
    ta, tb, tc = blocks.prompt(a), blocks.prompt(b), blocks.prompt(c)
    assert (len(ta), len(tb), len(tc)) == (48, 36, 17)
    assert ta[:32] == tb[:32]  # ids 0, 1 shared
    assert ta[32:] != tb[32:36]  # id 2 vs id 7
    assert tc == blocks.block(0) + blocks.block(9)[:1]  # a partial last block is a prefix of its block
    assert ta == blocks.block(0) + blocks.block(1) + blocks.block(2)


def test_tokens_are_deterministic_and_seeded() -> None:
    req = read_mooncake(limit=1)[0]
    one = to_token_ids(req, 16, 4096, (0, 1, 2), seed=0)
    assert one == to_token_ids(req, 16, 4096, (0, 1, 2), seed=0)
    assert one != to_token_ids(req, 16, 4096, (0, 1, 2), seed=1)
    # pinned: the construction is byte-defined (SHAKE-256), so it must not drift between versions
    digest = hashlib.shake_256(b"swaserve-trace:0:0").digest(4)
    allowed = list(range(3, 4096))
    assert one[0] == allowed[int.from_bytes(digest, "little") % len(allowed)]


def test_reserved_ids_and_vocab_are_respected() -> None:
    req = MooncakeRequest(0, 40 * 512, 1, tuple(range(40)))
    reserved = set(range(0, 3)) | set(range(20, 30))
    toks = to_token_ids(req, 32, 32, reserved, seed=3)
    assert len(toks) == 40 * 32
    assert set(toks) == set(range(32)) - reserved  # every allowed id shows up in 1280 draws of 19
    with pytest.raises(ValueError, match="no token ids left"):
        TokenBlocks(4, 3, (0, 1, 2))


@settings(max_examples=60, deadline=None)
@given(
    shared=st.integers(0, 5),
    extra_a=st.integers(1, 4),
    extra_b=st.integers(1, 4),
    tail_a=st.integers(1, 512),
    block_tokens=st.sampled_from([1, 3, 16, 64]),
)
def test_prefix_property(shared: int, extra_a: int, extra_b: int, tail_a: int, block_tokens: int) -> None:
    """Requests agree exactly on the tokens of their common hash-id prefix, and lengths scale."""
    ids_a = tuple(range(shared)) + tuple(range(100, 100 + extra_a))
    ids_b = tuple(range(shared)) + tuple(range(200, 200 + extra_b))
    a = MooncakeRequest(0, (len(ids_a) - 1) * 512 + tail_a, 1, ids_a)
    b = MooncakeRequest(0, len(ids_b) * 512, 1, ids_b)
    blocks = TokenBlocks(block_tokens, 1000, (0,), seed=7)
    ta, tb = blocks.prompt(a), blocks.prompt(b)
    assert len(ta) == math.ceil(a.input_length * block_tokens / 512)
    assert len(tb) == len(ids_b) * block_tokens
    n = shared * block_tokens
    assert ta[:n] == tb[:n]
    if block_tokens >= 16:  # two 16-token blocks over 999 ids colliding: ~1e-48
        assert blocks.block(100) != blocks.block(200)
