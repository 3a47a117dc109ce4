"""Media items in a prompt: content keys, placeholder ids and spans.

An encoder's output replaces a run of placeholder tokens one row per token. In the prompt the engine,
the radix cache and the router's index see, each placeholder position ``j`` of item ``k`` carries a
*pad id* ``PAD_BASE + BLAKE2b(key_k, j) mod 2**30``: above every vocabulary (``PAD_BASE = 2**30``)
and below ``2**31`` (the proto's int32), so the same media gives the same ids (a prefix hit across
the item) and different media of the same size diverges at the span's first token. SGLang writes
one 30-bit value over a whole item (``MM_PAD_SHIFT_VALUE + hash % 2**30``,
python/sglang/srt/managers/schedule_batch.py); per-position values make a false hit need the whole
run to collide. vLLM adds ``(mm_hash, offset)`` to each block's hash instead
(vllm/v1/core/kv_cache_utils.py). Structural tokens (vision start/end, timestamps) stay real ids.

The key is BLAKE2b-128 over a domain tag, the encoder's identity (weights included), the modality,
the canonical preprocessing parameters and the raw media bytes: identical bytes under the same
encoder always give identical embeddings; a re-encoded copy of an image only misses.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

PAD_BASE = 1 << 30
PAD_SPAN = 1 << 30
KEY_BYTES = 16
MODALITIES = ("image", "video", "audio")
Modality = Literal["image", "video", "audio"]


@dataclass(frozen=True)
class MediaSpan:
    """One media item's placeholder run in a prompt.

    Attributes:
        start: position of the first placeholder token. length: placeholder tokens (= encoder
            output rows). key: the item's 16-byte content key. modality: image, video or audio.
        offset: the span's first row in its item's embeddings (a video item has one span per
            frame pair, timestamps between them); its pad ids are the item's from ``offset`` on.
    """

    start: int
    length: int
    key: bytes
    modality: str
    offset: int = 0

    @property
    def end(self) -> int:
        return self.start + self.length


def item_key(encoder_id: str, modality: str, params: Mapping[str, Any], data: bytes) -> bytes:
    """The 16-byte content key of one media item.

    Args:
        encoder_id: the encoder's identity (config and weights digest of its tower).
        modality: image, video or audio. params: the preprocessing parameters that change the
            output (sizes, fps, frame limits), JSON-serialisable. data: the raw media bytes.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"swaserve-media")
    for part in (encoder_id.encode(), modality.encode(), json.dumps(params, sort_keys=True).encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    h.update(data)
    return h.digest()


def pad_ids(key: bytes, n: int, offset: int = 0) -> list[int]:
    """The placeholder ids of positions ``offset .. offset + n - 1`` of the item with content
    ``key`` (module docstring)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a media key has {KEY_BYTES} bytes, got {len(key)}")
    # one BLAKE2b stream: digest i covers item positions 8i..8i+7 (4 bytes each)
    lo, hi = offset // 8, (offset + n + 7) // 8
    chunks = [
        np.frombuffer(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32, key=key).digest(), dtype="<u4")
        for i in range(lo, hi)
    ]
    if not chunks:
        return []
    out = np.concatenate(chunks)[offset - 8 * lo : offset - 8 * lo + n]
    return (PAD_BASE + (out.astype(np.int64) % PAD_SPAN)).tolist()


def is_pad(token_id: int) -> bool:
    return token_id >= PAD_BASE


def check_spans(prompt: Sequence[int], spans: Sequence[MediaSpan], vocab_size: int) -> None:
    """Raise ValueError unless ``spans`` are in order, disjoint, inside ``prompt``, each carries
    its own key's pad ids, and every id outside them is in ``[0, vocab_size)``."""
    pos = 0
    for s in spans:
        if s.modality not in MODALITIES:
            raise ValueError(f"unknown media modality {s.modality!r}")
        if s.length <= 0 or s.start < pos or s.end > len(prompt):
            raise ValueError(
                f"media span [{s.start}, {s.end}) is empty, out of order, overlaps another, or leaves the prompt"
            )
        pos = s.end
    pos = 0
    for s in spans:
        _check_ids(prompt, pos, s.start, vocab_size)
        if list(prompt[s.start : s.end]) != pad_ids(s.key, s.length, s.offset):
            raise ValueError(
                f"the prompt's ids at [{s.start}, {s.end}) are not the media item's placeholders"
            )
        pos = s.end
    _check_ids(prompt, pos, len(prompt), vocab_size)


def _check_ids(prompt: Sequence[int], lo: int, hi: int, vocab_size: int) -> None:
    for t in prompt[lo:hi]:
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t} out of range [0, {vocab_size})")


def text_ids(ids: Sequence[int]) -> list[int]:
    """``ids`` without pad ids (what penalties and detokenizers see)."""
    return [t for t in ids if t < PAD_BASE]


@dataclass
class MediaInputs:
    """A request's media: its spans in prompt order and the embeddings known so far.

    Attributes:
        spans: the items' placeholder runs, in order, disjoint.
        embeds: span index -> encoder output [span.length, hidden] (any float dtype; cast to the
            model's). A span the prefix cache covers needs none; one it does not is waited for
            (``EngineCore.supply_media``) before the prefill reaches it.
        sources: span index -> where its embeddings are fetched from (an encoder's address; a
            router fills it in, a prefill worker fetches what its prefix hit does not cover).
    """

    spans: tuple[MediaSpan, ...]
    embeds: dict[int, Any]
    sources: dict[int, str] = field(default_factory=dict)
    items: tuple[Any, ...] = ()  # a router's: the items to submit again on a retry
    item_spans: tuple[tuple[int, ...], ...] = ()

    def check_embeds(self, hidden: int) -> None:
        """Raise ValueError unless every embedding is [span.length, hidden]."""
        for i, t in self.embeds.items():
            if not 0 <= i < len(self.spans):
                raise ValueError(f"embeddings for media item {i}, but the prompt has {len(self.spans)}")
            want = (self.spans[i].length, hidden)
            if tuple(t.shape) != want:
                raise ValueError(f"media item {i}: embeddings of shape {tuple(t.shape)}, expected {want}")


def split_embeds(
    spans: Sequence[MediaSpan], item_spans: Sequence[Sequence[int]], embeds: Sequence[Any]
) -> dict[int, Any]:
    """Per span index, its rows of its item's embeddings (``embeds[i]``: item i's [rows, hidden];
    ``item_spans[i]``: the spans it covers)."""
    out: dict[int, Any] = {}
    for idx, e in zip(item_spans, embeds, strict=True):
        for j in idx:
            s = spans[j]
            out[j] = e[s.offset : s.offset + s.length]
    return out
