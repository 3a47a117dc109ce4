"""The encoder's embedding cache in one process, and in-flight dedupe.

``EmbeddingCache``: item key (a 16-byte content key: weights identity, modality, preprocessing
parameters and media bytes hashed together, so equal keys mean equal embeddings) -> ``Embedding``,
least recently used first out, bounded by bytes (``tensor.nbytes`` + ``ENTRY_OVERHEAD_BYTES`` per
entry). As SGLang's ``MultiModalStaticCache`` (python/sglang/srt/mem_cache/multimodal_cache.py), an
LRU of encoder outputs by bytes, except that an entry larger than the whole capacity is refused
before anything is evicted (SGLang empties the cache first). vLLM's ``EncoderCacheManager``
(vllm/v1/core/encoder_cache_manager.py) counts embeddings rather than bytes and pins entries while
requests use them; here a hit returns the tensor itself, which an eviction does not free while
the caller holds it, so nothing is pinned.

``InFlight``: identical items submitted while one is being encoded are computed once: the first
``claim`` wins, the others ``wait`` with opaque tokens (futures, request ids) that ``finish`` or
``fail`` hand back."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

ENTRY_OVERHEAD_BYTES = 256  # bookkeeping counted per entry on top of the tensor's bytes


@dataclass(frozen=True, eq=False)
class Embedding:
    """An item's encoder output.

    Attributes:
        data: ``[n_tokens, hidden]``, on the CPU, contiguous: the rows that replace the item's
            placeholder tokens, in order.
        meta: small JSON-able metadata (e.g. ``{"frame_tokens": [...]}`` for a video); the shared
            memory tier stores it as JSON (tuples come back as lists).

    Raises:
        ValueError: ``data`` is not a 2-D contiguous CPU tensor, or ``meta`` is not a mapping.
    """

    data: torch.Tensor
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = self.data
        if not isinstance(d, torch.Tensor) or d.dim() != 2:
            raise ValueError(f"embedding data must be a 2-D tensor [n_tokens, hidden], got {_describe(d)}")
        if d.device.type != "cpu" or not d.is_contiguous():
            raise ValueError(f"embedding data must be a contiguous CPU tensor, got {_describe(d)}")
        if not isinstance(self.meta, Mapping):
            raise ValueError(f"embedding meta must be a mapping, got {type(self.meta).__name__}")

    @property
    def nbytes(self) -> int:
        """Bytes the cache charges for this entry: the tensor's bytes + ``ENTRY_OVERHEAD_BYTES``."""
        return self.data.nbytes + ENTRY_OVERHEAD_BYTES


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{tuple(x.shape)} {x.dtype} on {x.device}{'' if x.is_contiguous() else ', not contiguous'}"
    return type(x).__name__


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of an ``EmbeddingCache``: ``bytes`` and ``capacity`` in bytes (entry overheads
    included); ``hits``/``misses`` count ``get`` calls; ``evictions`` entries dropped to make room;
    ``refused`` puts of an entry larger than the capacity."""

    entries: int
    bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    refused: int


class EmbeddingCache:
    """LRU cache of ``Embedding`` by item key, bounded by bytes.

    Args:
        capacity_bytes: the most bytes the entries may hold together (``Embedding.nbytes`` each).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._entries: OrderedDict[bytes, Embedding] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._hits = self._misses = self._evictions = self._refused = 0

    def get(self, key: bytes) -> Embedding | None:
        """The entry for ``key`` (it becomes the most recently used), or None."""
        emb = self._entries.get(key)
        if emb is None:
            self._misses += 1
            return None
        self._entries.move_to_end(key)
        self._hits += 1
        return emb

    def put(self, key: bytes, emb: Embedding) -> bool:
        """Store ``emb`` under ``key`` (replacing an entry of that key), evicting least recently
        used entries to make room. Returns False, changing nothing, when ``emb`` alone is larger
        than the capacity."""
        size = emb.nbytes
        if size > self.capacity:
            self._refused += 1
            return False
        self.pop(key)
        while self._bytes + size > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self._evictions += 1
        self._entries[key] = emb
        self._bytes += size
        return True

    def pop(self, key: bytes) -> Embedding | None:
        """Remove and return the entry for ``key``, or None (not counted as a hit or miss)."""
        emb = self._entries.pop(key, None)
        if emb is not None:
            self._bytes -= emb.nbytes
        return emb

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Bytes held now (entry overheads included)."""
        return self._bytes

    def stats(self) -> CacheStats:
        return CacheStats(
            entries=len(self._entries),
            bytes=self._bytes,
            capacity=self.capacity,
            hits=self._hits,
            misses=self._misses,
            evictions=self._evictions,
            refused=self._refused,
        )


class InFlight:
    """Keys being computed now, and who waits for each.

    ``claim(key)`` -> True: the caller computes the item; False: a computation is already under way,
    so the caller ``wait``s on it with a token of its own. ``finish``/``fail`` end the computation and
    return the tokens to resolve (in registration order, each once). Tokens are opaque hashables
    (futures, request ids). Not thread-safe: one shell loop drives it.
    """

    def __init__(self) -> None:
        self._waiting: dict[bytes, dict[Hashable, None]] = {}  # key -> tokens, an ordered set
        self.claims = 0  # computations started
        self.joins = 0  # claims that found one under way
        self.failures = 0
        self.last_error: BaseException | None = None

    def claim(self, key: bytes) -> bool:
        """True: ``key`` was not in flight and now is, the caller computes it; False otherwise."""
        if key in self._waiting:
            self.joins += 1
            return False
        self._waiting[key] = {}
        self.claims += 1
        return True

    def wait(self, key: bytes, token: Hashable) -> None:
        """Register ``token`` to be handed back when ``key``'s computation ends.

        Raises:
            KeyError: ``key`` is not in flight (``claim`` it first).
        """
        self._waiting[key][token] = None

    def waiters(self, key: bytes) -> list[Hashable]:
        """The tokens waiting on ``key`` (empty if it is not in flight)."""
        return list(self._waiting.get(key, ()))

    def finish(self, key: bytes) -> list[Hashable]:
        """``key`` is computed: it leaves the in-flight set; returns its waiters' tokens.

        Raises:
            KeyError: ``key`` is not in flight.
        """
        return list(self._waiting.pop(key))

    def fail(self, key: bytes, error: BaseException) -> list[Hashable]:
        """``key``'s computation failed with ``error`` (kept as ``last_error``): it leaves the
        in-flight set, so a later ``claim`` retries it; returns its waiters' tokens, for the shell
        to fail each with ``error``.

        Raises:
            KeyError: ``key`` is not in flight.
        """
        tokens = list(self._waiting.pop(key))
        self.failures += 1
        self.last_error = error
        return tokens

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)
