"""GCache page keys: a 128-bit chain over page tokens, salted with everything that decides KV bytes.

``K_i = BLAKE2b-128(key=K_{i-1}, u32le(tokens of page i))`` with ``K_{-1} = seed(salt)``, so a key
names a whole prefix (vLLM prefix caching, SGLang HiCache ``get_hash_str``). The seed hashes the
model fingerprint *and* a weights digest, the KV dtype, page size and payload layout: a fine-tune
or another KV format never reads another model's pages. 128 bits: the router's 64-bit block keys
are fine for an approximate index, not for content identity (vLLM GHSA-rm76-4mrf-v9r8).
Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

KEY_BYTES = 16
LAYOUT_VERSION = 1  # bump when the page payload layout changes (codec.py)


@dataclass(frozen=True)
class Salt:
    """What must match for two engines to share a page (all of it is hashed into the seed).

    Attributes:
        model: the model fingerprint (``model.identity``: config + tokenizer).
        weights: a digest of the weights (``model.identity.weights_digest``) or a revision the
            operator vouches for.
        kv_dtype: dtype of the KV bytes (``"float32"``, ``"bfloat16"``...).
        page_size: tokens per page.
        geometry: per kind, the payload's layers and their K/V shapes (``codec.Geometry.describe``).
        shard: which part of the KV this engine holds (``"tp0/1"``).
        extra: reserved (LoRA, media hashes).
    """

    model: str
    weights: str
    kv_dtype: str
    page_size: int
    geometry: dict[str, Any] = field(default_factory=dict)
    shard: str = "tp0/1"
    extra: str = ""

    def seed(self) -> bytes:
        """``K_{-1}``: 16 bytes."""
        doc = {"v": LAYOUT_VERSION, **asdict(self)}
        raw = b"swaserve-gcache/v1" + json.dumps(doc, sort_keys=True).encode()
        return hashlib.blake2b(raw, digest_size=KEY_BYTES).digest()


def page_keys(tokens: Sequence[int], page_size: int, parent: bytes) -> list[bytes]:
    """Chain keys of the whole pages of ``tokens``, continuing from ``parent`` (the seed, or the
    key of the page just before ``tokens``).

    Returns ``len(tokens) // page_size`` keys of 16 bytes. Raises ValueError for a token id outside
    ``[0, 2**32)``, a non-positive page size or a parent that is not 16 bytes."""
    if page_size < 1:
        raise ValueError(f"page_size must be at least 1, got {page_size}")
    if len(parent) != KEY_BYTES:
        raise ValueError(f"a parent key is {KEY_BYTES} bytes, got {len(parent)}")
    n = len(tokens) // page_size
    if n == 0:
        return []
    arr = np.asarray(tokens[: n * page_size], dtype=np.int64)
    if arr.min() < 0 or arr.max() >= 2**32:
        raise ValueError("token ids must be in [0, 2**32)")
    raw = arr.astype("<u4").tobytes()
    step = 4 * page_size
    out, h = [], parent
    for i in range(n):
        h = hashlib.blake2b(raw[i * step : (i + 1) * step], digest_size=KEY_BYTES, key=h).digest()
        out.append(h)
    return out
