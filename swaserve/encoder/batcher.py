"""``EncodeBatcher``: cross-request batching of encoder work, and ``split`` of a fused output.

Images and audio of different requests are fused into one forward per modality, as SGLang's
``EncoderScheduler`` (python/sglang/srt/disaggregation/encode_server.py) does: a batch is the
longest prefix of a modality's queue (in submission order, never skipping an item, so a big item
cannot starve) within ``max_batch_items`` and ``max_batch_tokens`` (summed ``cost``: patches or
mel frames, the encoder's input size). It leaves when it is full (no further item fits) or when
its oldest item has waited ``max_wait_s``; the shell sleeps ``time_to_next`` in between. Video
goes one item per batch at once (SGLang excludes video from fusion: its preprocessing differs per
item), and so does an item whose cost alone exceeds the token bound (it could never fuse). When
several modalities have a batch ready, the one whose oldest item arrived first goes first.

::

    submit(item) -> queue[modality] --next_batch(now)--> [item, ...] --encoder forward--> output
                                                          split(batch, output) -> per-item rows
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

Modality = Literal["image", "audio", "video"]
MODALITIES: tuple[Modality, ...] = ("image", "audio", "video")
FUSED: frozenset[str] = frozenset({"image", "audio"})  # fused across requests; video goes alone


@dataclass(frozen=True)
class PendingItem:
    """One media item waiting for the encoder.

    Attributes:
        key: the item's content key (the cache key).
        modality: "image", "audio" or "video".
        num_tokens: rows the encoder outputs for it (known from metadata before encoding).
        cost: its input size for the batch token bound (patches, mel frames), >= 0.
        payload: opaque to the batcher (preprocessed input, request handles).
        arrival: when it was submitted, in the batcher clock's seconds (None: ``submit`` stamps it).
    """

    key: bytes
    modality: Modality
    num_tokens: int
    cost: int
    payload: Any = None
    arrival: float | None = None


@dataclass(frozen=True)
class BatcherStats:
    """``queued``: items waiting per modality; ``batches`` and ``items`` released so far, per
    modality in ``batches_by_modality``; ``batch_sizes``: items per batch -> batches of that size;
    ``full``/``timed_out``/``alone``: why fused batches left (no room, the wait window, an item
    that goes alone: video or over the token bound)."""

    queued: Mapping[str, int]
    batches: int
    items: int
    batches_by_modality: Mapping[str, int]
    batch_sizes: Mapping[int, int]
    full: int
    timed_out: int
    alone: int


class EncodeBatcher:
    """Queues of ``PendingItem`` per modality, released as bounded batches.

    Args:
        max_batch_items: the most items in one batch, >= 1.
        max_batch_tokens: the most summed ``cost`` in one batch, >= 1 (one item over it goes alone).
        max_wait_s: how long the oldest item of a partial image/audio batch may wait, seconds, >= 0.
        clock: seconds, monotonic (stamps items without ``arrival``; the default ``now``).

    Raises:
        ValueError: a bound out of range.
    """

    def __init__(
        self, max_batch_items: int, max_batch_tokens: int, max_wait_s: float, clock: Callable[[], float]
    ) -> None:
        if max_batch_items < 1 or max_batch_tokens < 1 or max_wait_s < 0:
            raise ValueError(
                "need max_batch_items >= 1, max_batch_tokens >= 1, max_wait_s >= 0, got "
                f"{max_batch_items}, {max_batch_tokens}, {max_wait_s}"
            )
        self.max_batch_items, self.max_batch_tokens, self.max_wait_s = (
            max_batch_items,
            max_batch_tokens,
            max_wait_s,
        )
        self.clock = clock
        self._queues: dict[str, deque[tuple[int, PendingItem]]] = {m: deque() for m in MODALITIES}
        self._seq = 0  # submission order: ties of equal arrival
        self._batches = self._items = self._full = self._timed_out = self._alone = 0
        self._by_modality: Counter[str] = Counter()
        self._sizes: Counter[int] = Counter()

    def submit(self, item: PendingItem) -> PendingItem:
        """Queue ``item`` (stamped with ``clock()`` if it has no arrival); returns it as queued.

        Raises:
            ValueError: an unknown modality, or a negative ``num_tokens`` or ``cost``.
        """
        if item.modality not in self._queues:
            raise ValueError(f"unknown modality {item.modality!r} (known: {', '.join(MODALITIES)})")
        if item.num_tokens < 0 or item.cost < 0:
            raise ValueError(f"num_tokens and cost must be >= 0, got {item.num_tokens}, {item.cost}")
        if item.arrival is None:
            item = replace(item, arrival=self.clock())
        self._queues[item.modality].append((self._seq, item))
        self._seq += 1
        return item

    def next_batch(self, now: float | None = None) -> list[PendingItem] | None:
        """The next batch to encode (one modality, removed from the queue), or None when no batch
        is ready at ``now`` (default ``clock()``): see the module docstring."""
        now = self.clock() if now is None else now
        best: tuple[float, int, str, int, str] | None = None  # (arrival, seq, modality, size, why)
        for modality, queue in self._queues.items():
            if not queue:
                continue
            size, why = self._ready(modality, now)
            if size:
                seq, head = queue[0]
                cand = (_arrival(head), seq, modality, size, why)
                if best is None or cand[:2] < best[:2]:
                    best = cand
        if best is None:
            return None
        _, _, modality, size, why = best
        queue = self._queues[modality]
        batch = [queue.popleft()[1] for _ in range(size)]
        self._batches += 1
        self._items += size
        self._by_modality[modality] += 1
        self._sizes[size] += 1
        if why == "full":
            self._full += 1
        elif why == "timed_out":
            self._timed_out += 1
        else:
            self._alone += 1
        return batch

    def time_to_next(self, now: float | None = None) -> float | None:
        """Seconds until a batch is ready (0: one is now), or None when nothing is queued: how long
        the shell may sleep if nothing is submitted meanwhile."""
        now = self.clock() if now is None else now
        wait: float | None = None
        for modality, queue in self._queues.items():
            if not queue:
                continue
            if self._ready(modality, now)[0]:
                return 0.0
            left = max(0.0, _arrival(queue[0][1]) + self.max_wait_s - now)
            wait = left if wait is None else min(wait, left)
        return wait

    def _ready(self, modality: str, now: float) -> tuple[int, str]:
        """(items in the batch ``modality`` would release now, why), or (0, "") if none is ready."""
        queue = self._queues[modality]
        head = queue[0][1]
        if modality not in FUSED or head.cost > self.max_batch_tokens:
            return 1, "alone"
        n, cost = 0, 0
        for _, item in queue:
            if n == self.max_batch_items or cost + item.cost > self.max_batch_tokens:
                return n, "full"  # an item is left that does not fit
            n, cost = n + 1, cost + item.cost
        if n == self.max_batch_items or cost == self.max_batch_tokens:
            return n, "full"
        if now >= _arrival(head) + self.max_wait_s:  # the same sum as time_to_next: no float gap
            return n, "timed_out"
        return 0, ""

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def stats(self) -> BatcherStats:
        return BatcherStats(
            queued={m: len(q) for m, q in self._queues.items()},
            batches=self._batches,
            items=self._items,
            batches_by_modality=dict(self._by_modality),
            batch_sizes=dict(sorted(self._sizes.items())),
            full=self._full,
            timed_out=self._timed_out,
            alone=self._alone,
        )


def split(batch: Sequence[PendingItem], output: torch.Tensor) -> list[torch.Tensor]:
    """Cut a fused encoder output ``[sum of num_tokens, hidden]`` into each item's rows, in batch
    order (views, no copy).

    Raises:
        ValueError: ``output`` is not 2-D, or its rows are not the items' ``num_tokens`` summed.
    """
    sizes = [item.num_tokens for item in batch]
    if output.dim() != 2 or output.shape[0] != sum(sizes):
        raise ValueError(
            f"encoder output {tuple(output.shape)} does not hold the {sum(sizes)} rows "
            f"({'+'.join(map(str, sizes)) or 'none'}) of its {len(batch)} items"
        )
    return list(output.split(sizes))


def _arrival(item: PendingItem) -> float:
    assert item.arrival is not None  # submit stamps every queued item
    return item.arrival
