"""Readers for the bundled request traces, and synthetic token prompts built from them.

The Mooncake conversation trace gives per request an arrival time, prompt and output lengths and
``hash_ids`` (one id per 512-token block, naming it and every block before it). ``to_token_ids``
scales a request to ``B``-token blocks, each a pure function of (seed, hash id) by SHAKE-256, so
equal hash-id prefixes give equal token prefixes.

Design notes: docs/DESIGN.md#tracespy"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

TRACE_BLOCK_TOKENS = 512
"""Prompt tokens per Mooncake hash id (the trace's block size)."""

DEFAULT_MOONCAKE_TRACE = (
    Path(__file__).resolve().parent.parent / "data" / "traces" / "conversation_trace.jsonl"
)
"""The Mooncake conversation trace committed with the repository."""


class TraceError(ValueError):
    """A trace file is malformed (bad JSON, missing fields, inconsistent lengths)."""


@dataclass(frozen=True)
class MooncakeRequest:
    """One request of a Mooncake trace.

    Attributes:
        timestamp_ms: Arrival time, milliseconds since the trace start (non-decreasing in the file).
        input_length: Prompt tokens in the original (unscaled) trace.
        output_length: Output tokens in the original trace.
        hash_ids: One id per 512-token prompt block; ``len == ceil(input_length / 512)``.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_mooncake(
    path: str | Path = DEFAULT_MOONCAKE_TRACE, limit: int | None = None
) -> list[MooncakeRequest]:
    """Read a Mooncake trace (JSON lines) in file order.

    Args:
        path: The ``.jsonl`` (or gzipped ``.jsonl.gz``) file; default: the committed conversation trace.
        limit: Read at most this many requests (None = all).

    Returns:
        The requests, in arrival order.

    Raises:
        TraceError: A line is not a JSON object with the four fields, a length is not positive,
            ``len(hash_ids) != ceil(input_length / 512)``, or timestamps decrease.
        OSError: The file cannot be read.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    return list(_iter_mooncake(Path(path), limit))


def _iter_mooncake(path: Path, limit: int | None) -> Iterator[MooncakeRequest]:
    if limit == 0:
        return
    count = 0
    prev_ts = 0
    with open_text(path) as f:  # plain or gzipped JSON lines
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            req = _parse_mooncake_line(line, f"{path}:{lineno}")
            if req.timestamp_ms < prev_ts:
                raise TraceError(f"{path}:{lineno}: timestamp {req.timestamp_ms} < previous {prev_ts}")
            prev_ts = req.timestamp_ms
            yield req
            count += 1
            if limit is not None and count >= limit:
                return


def json_object(line: str, where: str) -> dict[str, Any]:
    """Parse one JSON-lines record. Raises TraceError naming ``where`` (file:line)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object")
    return raw


def _parse_mooncake_line(line: str, where: str) -> MooncakeRequest:
    raw = json_object(line, where)
    try:
        ts, inp, out, ids = raw["timestamp"], raw["input_length"], raw["output_length"], raw["hash_ids"]
    except KeyError as e:
        raise TraceError(f"{where}: missing field {e.args[0]!r}") from e
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (ts, inp, out)):
        raise TraceError(f"{where}: timestamp, input_length and output_length must be integers")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of non-negative integers")
    if ts < 0 or inp < 1 or out < 1:
        raise TraceError(f"{where}: need timestamp >= 0 and positive lengths, got {ts}, {inp}, {out}")
    if len(ids) != math.ceil(inp / TRACE_BLOCK_TOKENS):
        raise TraceError(
            f"{where}: {len(ids)} hash ids for input_length {inp} "
            f"(expected ceil({inp}/{TRACE_BLOCK_TOKENS}) = {math.ceil(inp / TRACE_BLOCK_TOKENS)})"
        )
    return MooncakeRequest(timestamp_ms=ts, input_length=inp, output_length=out, hash_ids=tuple(ids))


def scaled_prompt_len(input_length: int, block_tokens: int) -> int:
    """Prompt tokens after scaling trace blocks of 512 tokens to ``block_tokens``.

    Returns ``ceil(input_length * block_tokens / 512)``; e.g. 6758 trace tokens at B=16 -> 212.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    return -(-input_length * block_tokens // TRACE_BLOCK_TOKENS)


class TokenBlocks:
    """Deterministic token blocks: hash id -> ``block_tokens`` token ids (docs/DESIGN.md#tracespy).

    Args:
        block_tokens: Tokens per block (B), >= 1.
        vocab_size: Token ids are drawn from ``[0, vocab_size)``.
        reserved_ids: Ids never emitted (special tokens: BOS, EOS, pad, chat markers...).
        seed: Different seeds give unrelated blocks.
        cache_blocks: Most blocks kept in memory (least recently used dropped); None = all.

    Raises:
        ValueError: ``block_tokens < 1`` or no token id is left to draw from.
    """

    def __init__(
        self,
        block_tokens: int,
        vocab_size: int,
        reserved_ids: Collection[int] = (),
        seed: int = 0,
        cache_blocks: int | None = None,
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        reserved = np.fromiter((int(i) for i in reserved_ids), dtype=np.int64)
        allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), reserved)
        if allowed.size == 0:
            raise ValueError(f"no token ids left: vocab_size={vocab_size} and {reserved.size} reserved ids")
        self.block_tokens = block_tokens
        self.vocab_size = vocab_size
        self.seed = seed
        self._allowed = allowed
        self._cache: OrderedDict[int, list[int]] = OrderedDict()
        self.cache_blocks = cache_blocks

    def block(self, hash_id: int) -> list[int]:
        """The ``block_tokens`` token ids of one hash id (cached; do not mutate the result)."""
        got = self._cache.get(hash_id)
        if got is not None:
            if self.cache_blocks is not None:
                self._cache.move_to_end(hash_id)
        else:
            digest = hashlib.shake_256(f"swaserve-trace:{self.seed}:{hash_id}".encode()).digest(
                4 * self.block_tokens
            )
            draws = np.frombuffer(digest, dtype="<u4").astype(np.int64) % self._allowed.size
            got = self._allowed[draws].tolist()
            self._cache[hash_id] = got
            if self.cache_blocks is not None and len(self._cache) > self.cache_blocks:
                self._cache.popitem(last=False)
        return got

    def prompt(self, req: MooncakeRequest) -> list[int]:
        """The scaled token prompt of ``req``: one block per hash id, the last one cut to length."""
        n = scaled_prompt_len(req.input_length, self.block_tokens)
        out: list[int] = []
        for h in req.hash_ids:
            out.extend(self.block(h))
        # ceil(input_length/512) blocks and input_length > 512 * (k - 1) guarantee
        # B * (k - 1) < n <= B * k: every hash id contributes at least one token.
        return out[:n]


def to_token_ids(
    req: MooncakeRequest,
    block_tokens: int,
    vocab_size: int,
    reserved_ids: Collection[int] = (),
    seed: int = 0,
) -> list[int]:
    """Token-id prompt of one trace request (construction: docs/DESIGN.md#tracespy).

    For many requests, build one ``TokenBlocks`` and call ``prompt`` (it caches blocks).

    Args:
        req: The trace request.
        block_tokens: Tokens per trace block after scaling (B); the trace's blocks are 512 tokens.
        vocab_size: Ids are drawn from ``[0, vocab_size)``.
        reserved_ids: Ids never emitted.
        seed: Seed of the block generator.

    Returns:
        ``ceil(req.input_length * block_tokens / 512)`` token ids.
    """
    return TokenBlocks(block_tokens, vocab_size, reserved_ids, seed).prompt(req)


def open_text(path: Path) -> IO[str]:
    """A text file, gunzipped if it starts with the gzip magic."""
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    return gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")


def detect_kind(path: Path) -> str:
    """ "mooncake" or "agent" (agent sessions), from the first record's fields.

    Raises:
        TraceError: neither format.
    """
    with open_text(path) as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rec = json_object(line, f"{path}:{lineno}")
                if isinstance(rec, dict) and "hash_ids" in rec:
                    return "mooncake"
                if isinstance(rec, dict) and "messages" in rec:
                    return "agent"
                break
    raise TraceError(f"{path}: neither a Mooncake trace (hash_ids) nor agent sessions (messages)")
