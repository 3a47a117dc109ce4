"""Prefill and decode instance selection.

Every policy sees, per candidate instance (already narrowed to the request's length bucket), the
tokens of the prompt it has cached (prefix index) and its load (leases + heartbeat), and returns a
``Decision``. Policies (``POLICIES``):

* ``round_robin``: in turn, blind to cache and load (the baseline).
* ``least_load``: least queued work (``queue_s``), blind to the cache.
* ``cache_aware``: least estimated TTFT::

      ttft(i) = queue_s(i) + prefill_s(n - cached(i), cached(i))

  (KV transfer is the same for every prefill instance and left out), with a balance guard: if
  the choice's queue exceeds the shortest queue by more than ``balance_abs_s`` *and* by a factor
  ``balance_rel``, the least-loaded instance is taken instead (the estimate undercounts
  queueing when prompts are long or the cost model is off, and a hot prefix must not pile every
  request onto one instance). On a miss everywhere this is least-load, so balance always sees load.

``queue_s(i) = max(reserved seconds of live leases, prefill_tokens_s(queued tokens last reported))``:
leases count what routers dispatched (at once, atomically), the heartbeat what the worker
actually has (covers leases lost with a router).

Decode: ``choose_decode`` takes the instance with the fewest KV tokens held or reserved (decode
load is memory: a full KV pool queues new requests).

Defaults: ``balance_abs_s = 2`` s: twice the prefill of a 64K prompt on the H200 preset; a
queue difference below it is what the cost model's error could hide. ``balance_rel = 1.5``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

from swaserve.routing.cost import CostModel
from swaserve.routing.load import InstanceLoad

DEFAULT_BALANCE_ABS_S = 2.0
DEFAULT_BALANCE_REL = 1.5


@dataclass(frozen=True)
class Candidate:
    """One instance as a policy sees it: ``cached_tokens`` of this prompt it holds, its load."""

    instance: str
    cached_tokens: int
    load: InstanceLoad


@dataclass(frozen=True)
class Decision:
    """The chosen instance, the cached tokens expected there, the TTFT estimate (s), and why:
    ``affinity`` (cache hit chosen), ``balance`` (guard overrode the cache), ``load`` (least load /
    no hit anywhere), ``round_robin``; ``fallback`` when no instance's bucket held the prompt."""

    instance: str
    cached_tokens: int
    est_ttft_s: float
    reason: str
    fallback: bool = False


def queue_s(load: InstanceLoad, cost: CostModel) -> float:
    """Estimated seconds of prefill work queued on an instance (module docstring)."""
    reported = cost.prefill_tokens_s(load.report.queued_tokens) if load.report is not None else 0.0
    return max(load.reserved_s, reported)


class Policy(ABC):
    name: str

    @abstractmethod
    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        """Pick one of ``candidates`` (non-empty, any order) for a prompt of ``prompt_tokens``."""

    def estimate(self, prompt_tokens: int, c: Candidate, cost: CostModel) -> float:
        return queue_s(c.load, cost) + cost.prefill_s(prompt_tokens - c.cached_tokens, c.cached_tokens)


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.instance)
        c = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(c.instance, c.cached_tokens, self.estimate(prompt_tokens, c, cost), "round_robin")


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        c = min(candidates, key=lambda c: (queue_s(c.load, cost), c.load.leases, c.instance))
        return Decision(c.instance, c.cached_tokens, self.estimate(prompt_tokens, c, cost), "load")


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self, balance_abs_s: float = DEFAULT_BALANCE_ABS_S, balance_rel: float = DEFAULT_BALANCE_REL
    ):
        if balance_abs_s < 0 or balance_rel < 1:
            raise ValueError("need balance_abs_s >= 0 and balance_rel >= 1")
        self.balance_abs_s, self.balance_rel = balance_abs_s, balance_rel

    def choose(self, prompt_tokens: int, candidates: list[Candidate], cost: CostModel) -> Decision:
        est = {c.instance: self.estimate(prompt_tokens, c, cost) for c in candidates}
        best = min(candidates, key=lambda c: (est[c.instance], -c.cached_tokens, c.instance))
        q_best = queue_s(best.load, cost)
        idle = min(candidates, key=lambda c: (queue_s(c.load, cost), -c.cached_tokens, c.instance))
        q_min = queue_s(idle.load, cost)
        if q_best > q_min + self.balance_abs_s and q_best > self.balance_rel * q_min:
            return Decision(idle.instance, idle.cached_tokens, est[idle.instance], "balance")
        reason = "affinity" if best.cached_tokens > 0 else "load"
        return Decision(best.instance, best.cached_tokens, est[best.instance], reason)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RoundRobin, LeastLoad, CacheAware)}


def make_policy(name: str, **kwargs: float) -> Policy:
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
