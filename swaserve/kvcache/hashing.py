"""Block hash chains: the keys of the router's prefix index.

Block ``i`` of ``block_tokens`` tokens has the key ``h_i = H(h_{i-1}, tokens of block i)``, ``h_{-1} =
H(salt)``, so equal keys mean equal whole prefixes (vLLM prefix caching / nano-vllm's block manager);
only whole blocks get keys. ``H`` is BLAKE2b with an 8-byte digest as an unsigned 64-bit integer,
stable across processes and machines (unlike Python's ``hash``), as the shared Redis index needs.
Design notes: docs/DESIGN.md#kvcachehashingpy"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DEFAULT_BLOCK_TOKENS = 64


def _h(parent: int, payload: bytes) -> int:
    d = hashlib.blake2b(payload, digest_size=8, key=parent.to_bytes(8, "little"))
    return int.from_bytes(d.digest(), "little")


def root_hash(salt: str = "") -> int:
    """``h_{-1}``: the chain's seed. A different ``salt`` (model name, LoRA, media hashes) gives
    unrelated chains."""
    return _h(0, b"swaserve-prefix:" + salt.encode())


def block_hashes(
    tokens: Sequence[int], block_tokens: int = DEFAULT_BLOCK_TOKENS, salt: str = "", parent: int | None = None
) -> list[int]:
    """Chain keys of the whole blocks of ``tokens``.

    Args:
        tokens: token ids (``int`` in ``[0, 2**32)``).
        block_tokens: tokens per block, >= 1.
        salt: see ``root_hash``.
        parent: continue a chain: the key of the block just before ``tokens`` (default: the root).

    Returns:
        ``len(tokens) // block_tokens`` keys, 64-bit unsigned ints.

    Raises:
        ValueError: ``block_tokens < 1`` or a token id outside ``[0, 2**32)``.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
    n = len(tokens) // block_tokens
    if n == 0:
        return []
    arr = np.asarray(tokens[: n * block_tokens], dtype=np.int64)
    if arr.min() < 0 or arr.max() >= 2**32:
        raise ValueError("token ids must be in [0, 2**32)")
    raw = arr.astype("<u4").tobytes()
    step = 4 * block_tokens
    out, h = [], root_hash(salt) if parent is None else parent
    for i in range(n):
        h = _h(h, raw[i * step : (i + 1) * step])
        out.append(h)
    return out


def chain_ids(ids: Sequence[int], salt: str = "") -> list[int]:
    """Chain keys of blocks already named by ids (e.g. a Mooncake trace's ``hash_ids``, one per
    512 tokens): ``h_i = H(h_{i-1}, id_i)``."""
    out, h = [], root_hash(salt)
    for i in ids:
        h = _h(h, int(i).to_bytes(8, "little", signed=False))
        out.append(h)
    return out
