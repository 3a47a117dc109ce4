"""Load per instance, counted at dispatch: leases plus worker heartbeats.

A router reserves a lease (estimated seconds and tokens of work, an expiry) on the instance it
picks, atomically with the pick (compare-and-reserve on versions), and releases it when the request
leaves; heartbeats carry what the worker reports. ``InMemoryLoadBook`` here, the Redis one in
``routing.redis.store``. Design notes: docs/DESIGN.md#routingloadpy"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

DEFAULT_LEASE_TTL_S = 600.0  # a request's lease outlives its deadline (router default 600 s)
DEFAULT_HEARTBEAT_TTL_S = 10.0  # ten missed 1 s heartbeats: the instance left


@dataclass(frozen=True)
class Lease:
    """Work reserved on ``instance`` for one request: ``work_s`` estimated seconds of prefill (or
    decode) work, ``tokens`` tokens it brings; void after ``expires_at`` (caller's clock, s)."""

    lease_id: str
    instance: str
    work_s: float
    tokens: int
    expires_at: float


@dataclass(frozen=True)
class WorkerReport:
    """A worker's heartbeat. Tokens: ``queued_tokens`` waiting to be prefilled (uncached),
    ``running_tokens`` in running requests; ``kv_usage``: fraction of KV pages in use (0..1),
    the fuller pool for hybrid layouts; ``at``: when it was sent (s); ``queue_order``: how its
    prefill queue admits requests, ``"fcfs"`` or ``"compute"`` (``sched.priority``; it changes
    how long a new request waits there, ``routing.policy.wait_s``)."""

    queued_tokens: int = 0
    running_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    kv_usage: float = 0.0
    at: float = 0.0
    queue_order: str = "fcfs"


@dataclass(frozen=True)
class InstanceLoad:
    """What selection sees of one instance: live leases (count, seconds, tokens), the last
    heartbeat (None if none is fresh), ``version``, bumped by every reserve and release, and
    ``lease_work_s``, the seconds of each live lease, ascending (they sum to ``reserved_s``)."""

    leases: int = 0
    reserved_s: float = 0.0
    reserved_tokens: int = 0
    report: WorkerReport | None = None
    version: int = 0
    lease_work_s: tuple[float, ...] = ()


class LoadBook(ABC):
    """Leases and heartbeats of every instance; one interface for every backend."""

    @abstractmethod
    def loads(self, instances: Collection[str], now: float) -> dict[str, InstanceLoad]:
        """Current load of each of ``instances`` (expired leases not counted)."""

    @abstractmethod
    def reserve(self, lease: Lease, now: float, expect: Mapping[str, int] | None = None) -> bool:
        """Add ``lease`` atomically, only if every instance in ``expect`` still has the version
        given (the loads the choice was made on). Returns False, adding nothing, otherwise."""

    @abstractmethod
    def release(self, instance: str, lease_id: str) -> None:
        """Remove a lease (no error if it already expired or is unknown)."""

    @abstractmethod
    def renew(self, instance: str, lease_id: str, expires_at: float) -> bool:
        """Move a live lease's expiry to ``expires_at`` (its holder is alive and the work not
        done); False if it is gone. Short leases renewed by their router make a dead router's
        load drain within one lease TTL."""

    @abstractmethod
    def heartbeat(self, instance: str, report: WorkerReport, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> None:
        """Store ``instance``'s report; it counts as live until ``report.at + ttl_s``."""

    @abstractmethod
    def live(self, now: float) -> dict[str, WorkerReport]:
        """Instances whose last heartbeat has not expired, with that heartbeat."""

    @abstractmethod
    def forget(self, instance: str) -> None:
        """Drop an instance's leases and heartbeat (it left)."""


@dataclass
class _Inst:
    leases: dict[str, Lease] = field(default_factory=dict)
    version: int = 0
    report: WorkerReport | None = None
    report_until: float = 0.0


class InMemoryLoadBook(LoadBook):
    """The load book in this process (thread-safe: one lock)."""

    def __init__(self) -> None:
        self._inst: dict[str, _Inst] = {}
        self._lock = threading.Lock()

    def _get(self, instance: str) -> _Inst:
        return self._inst.setdefault(instance, _Inst())

    def loads(self, instances: Collection[str], now: float) -> dict[str, InstanceLoad]:
        with self._lock:
            out = {}
            for name in instances:
                s = self._get(name)
                for lid in [k for k, v in s.leases.items() if v.expires_at <= now]:
                    del s.leases[lid]
                live = s.leases.values()
                report = s.report if s.report is not None and now < s.report_until else None
                work = tuple(sorted(x.work_s for x in live))
                out[name] = InstanceLoad(
                    len(live), sum(work), sum(x.tokens for x in live), report, s.version, work
                )
            return out

    def reserve(self, lease: Lease, now: float, expect: Mapping[str, int] | None = None) -> bool:
        with self._lock:
            if expect and any(self._get(i).version != v for i, v in expect.items()):
                return False
            s = self._get(lease.instance)
            s.leases[lease.lease_id] = lease
            s.version += 1
            return True

    def release(self, instance: str, lease_id: str) -> None:
        with self._lock:
            s = self._get(instance)
            if s.leases.pop(lease_id, None) is not None:
                s.version += 1

    def renew(self, instance: str, lease_id: str, expires_at: float) -> bool:
        with self._lock:
            s = self._get(instance)
            old = s.leases.get(lease_id)
            if old is None:
                return False
            s.leases[lease_id] = Lease(old.lease_id, old.instance, old.work_s, old.tokens, expires_at)
            return True

    def heartbeat(self, instance: str, report: WorkerReport, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> None:
        with self._lock:
            s = self._get(instance)
            s.report, s.report_until = report, report.at + ttl_s

    def live(self, now: float) -> dict[str, WorkerReport]:
        with self._lock:
            return {
                k: s.report for k, s in self._inst.items() if s.report is not None and now < s.report_until
            }

    def forget(self, instance: str) -> None:
        with self._lock:
            self._inst.pop(instance, None)
