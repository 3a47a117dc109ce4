"""Prefill and decode instance selection.

Policies (``POLICIES``): ``round_robin``, ``least_load`` (least queued work, ``queue_s``), and
``cache_aware``: least estimated TTFT, ``wait_s(i) + prefill_s(n - cached(i), cached(i))``, the
wait estimated for the order the instance's queue admits in (FCFS or compute), with a balance guard
(``balance_abs_s`` = 2 s and ``balance_rel`` = 1.5 over the shortest queue: take the least loaded).
``choose_decode``: fewest KV tokens held or reserved. Estimates: docs/DESIGN.md#routingpolicypy"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from swaserve.routing.load import InstanceLoad
from swaserve.sched.cost import CostModel

DEFAULT_BALANCE_ABS_S = 2.0
DEFAULT_BALANCE_REL = 1.5


@dataclass(frozen=True)
class Candidate:
    """One instance as a policy sees it: ``cached_tokens`` of this prompt it holds, its load, and
    ``l3_tokens`` of the prompt any instance can fetch from L3 (GCache)."""

    instance: str
    cached_tokens: int
    load: InstanceLoad
    l3_tokens: int = 0

    def reuse(self) -> int:
        """Tokens this instance would not compute: its own cache, or L3 when that holds more."""
        return max(self.cached_tokens, self.l3_tokens)


@dataclass(frozen=True)
class Decision:
    """The chosen instance, the reused tokens expected there (its cache, or L3 when that holds
    more), the TTFT estimate (s), and why: ``affinity`` (cache hit chosen), ``l3`` (no instance
    holds the prompt, L3 does: least estimated TTFT), ``balance`` (guard overrode the cache),
    ``load`` (least load / no hit anywhere), ``round_robin``; ``fallback`` when no instance's
    bucket held the prompt."""

    instance: str
    cached_tokens: int
    est_ttft_s: float
    reason: str
    fallback: bool = False


QUEUE_ORDERS = ("auto", "fcfs", "compute")


def queue_s(load: InstanceLoad, cost: CostModel) -> float:
    """Estimated seconds of prefill work queued on an instance (docs/DESIGN.md#routingpolicypy)."""
    reported = cost.prefill_tokens_s(load.report.queued_tokens) if load.report is not None else 0.0
    return max(load.reserved_s, reported)


def wait_s(load: InstanceLoad, cost: CostModel, own_s: float, order: str = "auto") -> float:
    """Estimated seconds a request of ``own_s`` prefill seconds waits on an instance before its
    prefill starts (docs/DESIGN.md#routingpolicypy). ``order``: ``auto`` (the instance's reported
    ``queue_order``, FCFS without a report), ``fcfs`` or ``compute``."""
    if order == "auto":
        order = load.report.queue_order if load.report is not None else "fcfs"
    if order != "compute":
        return queue_s(load, cost)
    reported = cost.prefill_tokens_s(load.report.queued_tokens) if load.report is not None else 0.0
    return max(sum(min(w, own_s) for w in load.lease_work_s), min(reported, own_s))


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        """Pick one of ``candidates`` (non-empty, any order) for a prompt of ``prompt_tokens``."""

    def estimate(self, prompt_tokens: int, c: Candidate, cost: CostModel) -> float:
        return queue_s(c.load, cost) + cost.prefill_with_l3_s(prompt_tokens, c.cached_tokens, c.l3_tokens)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.instance)
        c = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(c.instance, c.reuse(), self.estimate(prompt_tokens, c, cost), "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        c = min(candidates, key=lambda c: (queue_s(c.load, cost), c.load.leases, c.instance))
        return Decision(c.instance, c.reuse(), self.estimate(prompt_tokens, c, cost), "load")


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        balance_abs_s: float = DEFAULT_BALANCE_ABS_S,
        balance_rel: float = DEFAULT_BALANCE_REL,
        queue_order: str = "auto",
    ):
        """``queue_order``: the queue discipline ``wait_s`` assumes (``QUEUE_ORDERS``; ``auto``:
        each instance's reported one). Raises ValueError on bad values."""
        if balance_abs_s < 0 or balance_rel < 1:
            raise ValueError("need balance_abs_s >= 0 and balance_rel >= 1")
        if queue_order not in QUEUE_ORDERS:
            raise ValueError(f"queue_order must be one of {', '.join(QUEUE_ORDERS)}, got {queue_order!r}")
        self.balance_abs_s, self.balance_rel, self.queue_order = balance_abs_s, balance_rel, queue_order

    def estimate(self, prompt_tokens: int, c: Candidate, cost: CostModel) -> float:
        own = cost.prefill_with_l3_s(prompt_tokens, c.cached_tokens, c.l3_tokens)
        return wait_s(c.load, cost, own, self.queue_order) + own

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        est = {c.instance: self.estimate(prompt_tokens, c, cost) for c in candidates}
        best = min(candidates, key=lambda c: (est[c.instance], -c.cached_tokens, c.instance))
        q_best = queue_s(best.load, cost)
        idle = min(candidates, key=lambda c: (queue_s(c.load, cost), -c.cached_tokens, c.instance))
        q_min = queue_s(idle.load, cost)
        if q_best > q_min + self.balance_abs_s and q_best > self.balance_rel * q_min:
            return Decision(idle.instance, idle.reuse(), est[idle.instance], "balance")
        reason = "affinity" if best.cached_tokens > 0 else "l3" if best.l3_tokens > 0 else "load"
        return Decision(best.instance, best.reuse(), est[best.instance], reason)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoad, CacheAware)}


def make_policy(name: str, **kwargs: float | str) -> Policy:
    """A policy by name (``POLICIES``); keyword arguments go to its constructor.

    Raises:
        ValueError: unknown name.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(**kwargs)  # type: ignore[arg-type]


def choose_decode(loads: Mapping[str, InstanceLoad]) -> str:
    """The decode instance with the fewest KV tokens held or coming: ``max(tokens of live leases,
    running tokens last reported)`` (leases count dispatches at once, the heartbeat what is really
    held), then the lowest reported KV usage.

    Raises:
        ValueError: ``loads`` is empty.
    """
    if not loads:
        raise ValueError("no decode instance")

    def key(item: tuple[str, InstanceLoad]) -> tuple[int, float, str]:
        name, ld = item
        r = ld.report
        return (max(ld.reserved_tokens, r.running_tokens if r else 0), r.kv_usage if r else 0.0, name)

    return min(loads.items(), key=key)[0]
