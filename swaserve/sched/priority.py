"""Compute-aware priority for a prefill queue: fewest uncached tokens first, with a waiting-time term
and a hard bound against starvation::

    key = (0, t_a)                                   if w >= max_wait_s   (overdue: FCFS first)
    key = (1, prefill_s(u, c) - wait_weight * w)     otherwise   (smallest first; w = now - t_a)

``max_wait_s = 0`` is FCFS; defaults ``max_wait_s = 30`` s, ``wait_weight = 0.1``.
The starvation bound and the defaults: docs/DESIGN.md#schedprioritypy"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Generic, TypeVar

from swaserve.config import EngineConfig
from swaserve.sched.cost import CostModel, preset

T = TypeVar("T")

DEFAULT_MAX_WAIT_S = 30.0
DEFAULT_WAIT_WEIGHT = 0.1


@dataclass(frozen=True)
class ComputeAwarePriority:
    """Ordering key of waiting requests (module docstring). ``max_wait_s`` >= 0, ``wait_weight`` >= 0."""

    cost: CostModel
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    wait_weight: float = DEFAULT_WAIT_WEIGHT

    def __post_init__(self) -> None:
        if self.max_wait_s < 0 or self.wait_weight < 0:
            raise ValueError("max_wait_s and wait_weight must be >= 0")

    def key(self, arrival: float, uncached: int, cached: int, now: float) -> tuple[int, float]:
        """Sort key at ``now`` (seconds, same clock as ``arrival``); smaller runs first."""
        if self.overdue(arrival, now):
            return (0, arrival)
        return (1, self.cost.prefill_s(uncached, cached) - self.wait_weight * (now - arrival))

    def overdue(self, arrival: float, now: float) -> bool:
        """Whether a request that arrived at ``arrival`` has waited ``max_wait_s`` at ``now``.

        Monotone (float subtraction rounds monotonically): if it holds for ``arrival`` it holds for
        every earlier arrival and every later ``now``, so the overdue requests are a prefix of the
        queue in arrival order."""
        return now - arrival >= self.max_wait_s

    def static_key(self, arrival: float, uncached: int, cached: int) -> float:
        """Time-independent form of the key of a request that is not overdue: ``key(...)[1] ==
        static_key(...) - wait_weight * now`` in exact arithmetic, and the ``now`` term is common
        to all requests, so sorting by it gives ``key``'s order at any ``now``. (In floating point
        two keys within a rounding error of each other may compare either way, in either form.)"""
        return self.cost.prefill_s(uncached, cached) + self.wait_weight * arrival


class PriorityQueue(Generic[T]):
    """Waiting requests in ``ComputeAwarePriority`` order (FCFS when ``priority`` is None), with
    O(log n) push and pop.

    Between requests that are not overdue the key's order never changes with time:
    ``prefill_s - w * (now - arrival)`` orders as ``prefill_s + w * arrival``
    (``ComputeAwarePriority.static_key``). So one heap holds that static key and a second one
    arrival order; ``pop(now)`` takes the oldest request if it is overdue, else the top of the first
    heap. Removed entries are skipped lazily.
    """

    def __init__(self, priority: ComputeAwarePriority | None = None) -> None:
        self.priority = priority
        self._by_key: list[tuple[float, int, T]] = []
        self._by_arrival: list[tuple[float, int, T]] = []
        self._arrival: dict[int, float] = {}  # handle -> arrival, for queued requests only
        self._seq = 0

    def __len__(self) -> int:
        return len(self._arrival)

    def push(self, item: T, arrival: float, uncached: int = 0, cached: int = 0) -> int:
        """Add ``item``; returns a handle for ``remove``."""
        self._seq += 1
        h = self._seq
        self._arrival[h] = arrival
        heapq.heappush(self._by_arrival, (arrival, h, item))
        if self.priority is not None:
            heapq.heappush(self._by_key, (self.priority.static_key(arrival, uncached, cached), h, item))
        return h

    def remove(self, handle: int) -> None:
        self._arrival.pop(handle, None)  # its heap entries are skipped when they surface

    def _top(self, heap: list[tuple[float, int, T]]) -> tuple[float, int, T] | None:
        while heap and heap[0][1] not in self._arrival:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def peek(self, now: float) -> T | None:
        """The request ``pop(now)`` would return, left in place."""
        got = self._pick(now)
        return None if got is None else got[1][2]

    def _pick(self, now: float) -> tuple[list[tuple[float, int, T]], tuple[float, int, T]] | None:
        oldest = self._top(self._by_arrival)
        if oldest is None:
            return None
        if self.priority is None or self.priority.overdue(oldest[0], now):
            return self._by_arrival, oldest
        best = self._top(self._by_key)
        assert best is not None
        return self._by_key, best

    def pop(self, now: float) -> T | None:
        """Remove and return the next request at ``now`` (None if empty)."""
        got = self._pick(now)
        if got is None:
            return None
        heap, (_, h, item) = got
        heapq.heappop(heap)
        del self._arrival[h]  # its entry in the other heap is skipped later
        return item

    def items(self) -> list[T]:
        """Queued requests in arrival order."""
        return [it for _, h, it in sorted(self._by_arrival) if h in self._arrival]


def schedule_priority(config: EngineConfig) -> ComputeAwarePriority | None:
    """The scheduler's admission priority for ``config.schedule_policy`` (None: FCFS).

    Raises:
        ValueError: unknown policy or cost model, or a negative bound or weight.
    """
    if config.schedule_policy == "fcfs":
        return None
    if config.schedule_policy != "compute":
        raise ValueError(f"schedule_policy must be 'fcfs' or 'compute', got {config.schedule_policy!r}")
    return ComputeAwarePriority(
        preset(config.cost_model), config.priority_max_wait_s, config.priority_wait_weight
    )
