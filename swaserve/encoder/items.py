"""``EncodeItem``: one media item for an encoder (no torch: the router builds them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EncodeItem:
    """One media item to encode.

    Attributes:
        key: its 16-byte content key. modality: image, video or audio. data: the raw bytes.
        num_tokens: output rows expected (from metadata). times: video: the sampled frame times
            (s). size: video: the per-frame (h, w) after resizing; image: its (h, w) when not the
            model's own ``smart_resize`` (``detail: low``), else None.
    """

    key: bytes
    modality: str
    data: bytes
    num_tokens: int
    times: tuple[float, ...] = ()
    size: tuple[int, int] | None = None
    meta: dict[str, object] = field(default_factory=dict, compare=False)
