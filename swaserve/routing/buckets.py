"""Prompt-length buckets: each prefill instance declares the prompt lengths it serves (``[lo, hi)``),
so similar work batches together and long prompts do not queue behind (or in front of) short ones.
``candidates(n)`` falls back to the nearest non-empty bucket; ``PRODUCTION_BUCKETS`` is the preset
for 1M-context models (0-64K / 64K-256K / 256K-1M).

Design notes: docs/DESIGN.md#routingbucketspy"""

from __future__ import annotations

from collections.abc import Collection, Mapping

ALL_LENGTHS = (0, 1 << 62)
PRODUCTION_BUCKETS = ((0, 64 * 1024), (64 * 1024, 256 * 1024), (256 * 1024, 1024 * 1024 + 1))


def parse_range(text: str) -> tuple[int, int]:
    """``"lo-hi"`` with optional ``k``/``K`` (x1024) suffixes, ``hi`` exclusive; ``"lo-"`` means no upper
    bound. Raises ValueError with the offending text."""

    def num(s: str) -> int:
        s = s.strip().lower()
        mult = 1024 if s.endswith("k") else 1
        return int(s.rstrip("k")) * mult

    try:
        lo_s, hi_s = text.split("-", 1)
        lo = num(lo_s)
        hi = num(hi_s) if hi_s.strip() else ALL_LENGTHS[1]
    except ValueError:
        raise ValueError(f"bad length range {text!r}: expected LO-HI, e.g. 0-64k") from None
    if lo < 0 or hi <= lo:
        raise ValueError(f"bad length range {text!r}: need 0 <= LO < HI")
    return lo, hi


class LengthBuckets:
    """Args: ranges: instance -> ``(lo, hi)`` prompt tokens it serves (``hi`` exclusive)."""

    def __init__(self, ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.ranges: dict[str, tuple[int, int]] = dict(ranges or {})

    def set(self, instance: str, lo: int, hi: int) -> None:
        if lo < 0 or hi <= lo:
            raise ValueError(f"bad range [{lo}, {hi}) for {instance}")
        self.ranges[instance] = (lo, hi)

    def range_of(self, instance: str) -> tuple[int, int]:
        return self.ranges.get(instance, ALL_LENGTHS)

    def candidates(self, n: int, live: Collection[str]) -> tuple[list[str], bool]:
        """Instances of ``live`` to choose from for an ``n``-token prompt, and whether that is a
        fallback (no live instance's range holds ``n``). Empty only if ``live`` is."""
        inside = [i for i in live if self.range_of(i)[0] <= n < self.range_of(i)[1]]
        if inside or not live:
            return sorted(inside), False

        def distance(i: str) -> tuple[int, int]:
            lo, hi = self.range_of(i)
            return (lo - n if n < lo else n - hi + 1), -hi

        best = min(distance(i) for i in live)
        return sorted(i for i in live if distance(i) == best), True
