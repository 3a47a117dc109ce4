"""Keep routing when the shared store (Redis) is gone, and re-sync when it is back.

``FallbackIndex`` and ``FallbackBook`` write to the shared backend and to a local in-memory copy,
read from the shared one while it answers and from the local one after an error, probe every
``retry_s`` seconds, and on recovery write the local index entries back (leases are not re-synced).

Design notes: docs/DESIGN.md#routingresilientpy"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TypeVar

from swaserve.routing.index import InMemoryPrefixIndex, PrefixIndex
from swaserve.routing.load import (
    DEFAULT_HEARTBEAT_TTL_S,
    InMemoryLoadBook,
    InstanceLoad,
    Lease,
    LoadBook,
    WorkerReport,
)

log = logging.getLogger("swaserve.routing")
R = TypeVar("R")


class SharedState:
    """Up/down state of one shared backend, with the retry clock. Args: probe: raises when the
    backend is unreachable; errors: exception types meaning "unreachable"; retry_s: seconds
    between probes while down; clock: seconds; on_back: called (under the state's lock) when the
    backend answers again, before reads go back to it."""

    def __init__(
        self,
        probe: Callable[[], object],
        errors: tuple[type[BaseException], ...],
        clock: Callable[[], float],
        retry_s: float = 1.0,
    ) -> None:
        self.probe, self.errors, self.clock, self.retry_s = probe, errors, clock, retry_s
        self.up = True
        self.outages = 0
        self._down_since = 0.0
        self._next_probe = 0.0
        self._lock = threading.RLock()
        self.on_back: list[Callable[[], None]] = []

    def call(self, fn: Callable[[], R], fallback: Callable[[], R]) -> R:
        """``fn()`` on the shared backend if it is up, else (or on an error) ``fallback()``."""
        with self._lock:
            if not self.up and self.clock() >= self._next_probe:
                self._try_back()
            if self.up:
                try:
                    return fn()
                except self.errors as e:
                    self._down(e)
            return fallback()

    def _down(self, e: BaseException) -> None:
        self.up = False
        self.outages += 1
        self._down_since = self.clock()
        self._next_probe = self._down_since + self.retry_s
        log.warning("shared routing state unreachable (%s): routing on this router's local state", e)

    def _try_back(self) -> None:
        try:
            self.probe()
            for fn in self.on_back:
                fn()
        except self.errors:
            self._next_probe = self.clock() + self.retry_s  # from the end of a probe that hung
            return
        self.up = True
        log.warning("shared routing state is back after %.1f s: re-synced", self.clock() - self._down_since)


class FallbackIndex(PrefixIndex):
    """``PrefixIndex`` over a shared backend with a local fallback (module docstring)."""

    def __init__(
        self, shared: PrefixIndex, state: SharedState, local: InMemoryPrefixIndex | None = None
    ) -> None:
        self.shared, self.state = shared, state
        self.local = local or InMemoryPrefixIndex(shared.config)
        self.config = shared.config
        state.on_back.append(self._resync)

    def _resync(self) -> None:
        for inst in sorted(self.local.instances()):
            by_time: dict[float, list[tuple[int, int]]] = {}
            for h, t, depth in self.local.dump(inst):
                by_time.setdefault(t, []).append((depth, h))
            for t in sorted(by_time):  # one record per run of consecutive depths: depths are kept
                run: list[int] = []
                start = 0
                for depth, h in sorted(by_time[t]):
                    if run and depth != start + len(run):
                        self.shared.record(inst, run, t, depth=start)
                        run = []
                    if not run:
                        start = depth
                    run.append(h)
                self.shared.record(inst, run, t, depth=start)

    def match(
        self, hashes: Sequence[int], now: float, instances: Collection[str] | None = None
    ) -> dict[str, int]:
        return self.state.call(
            lambda: self.shared.match(hashes, now, instances),
            lambda: self.local.match(hashes, now, instances),
        )

    def record(
        self, instance: str, hashes: Sequence[int], now: float, depth: int = 0, parent: int | None = None
    ) -> None:
        self.local.record(instance, hashes, now, depth, parent)
        self.state.call(lambda: self.shared.record(instance, hashes, now, depth, parent), lambda: None)

    def evict(self, instance: str, hashes: Sequence[int]) -> None:
        self.local.evict(instance, hashes)
        self.state.call(lambda: self.shared.evict(instance, hashes), lambda: None)

    def remove_instance(self, instance: str) -> int:
        n = self.local.remove_instance(instance)
        return self.state.call(lambda: self.shared.remove_instance(instance), lambda: n)

    def size(self) -> int:
        return self.state.call(self.shared.size, self.local.size)

    def entries(self, instance: str) -> list[tuple[int, float]]:
        return self.state.call(lambda: self.shared.entries(instance), lambda: self.local.entries(instance))


class FallbackBook(LoadBook):
    """``LoadBook`` over a shared backend with a local fallback (module docstring)."""

    def __init__(self, shared: LoadBook, state: SharedState, local: InMemoryLoadBook | None = None) -> None:
        self.shared, self.state = shared, state
        self.local = local or InMemoryLoadBook()

    def loads(self, instances: Collection[str], now: float) -> dict[str, InstanceLoad]:
        return self.state.call(
            lambda: self.shared.loads(instances, now), lambda: self.local.loads(instances, now)
        )

    def reserve(self, lease: Lease, now: float, expect: Mapping[str, int] | None = None) -> bool:
        def shared() -> bool:
            ok = self.shared.reserve(lease, now, expect)
            if ok:
                self.local.reserve(lease, now)
            return ok

        # down: the versions are the local book's (loads() read it too), or, if the backend failed
        # between the two calls, the shared one's: then the compare fails and the caller re-reads
        return self.state.call(shared, lambda: self.local.reserve(lease, now, expect))

    def release(self, instance: str, lease_id: str) -> None:
        self.local.release(instance, lease_id)
        self.state.call(lambda: self.shared.release(instance, lease_id), lambda: None)

    def renew(self, instance: str, lease_id: str, expires_at: float) -> bool:
        ok = self.local.renew(instance, lease_id, expires_at)
        return self.state.call(lambda: self.shared.renew(instance, lease_id, expires_at), lambda: ok)

    def heartbeat(self, instance: str, report: WorkerReport, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> None:
        self.local.heartbeat(instance, report, ttl_s)
        self.state.call(lambda: self.shared.heartbeat(instance, report, ttl_s), lambda: None)

    def live(self, now: float) -> dict[str, WorkerReport]:
        return self.state.call(lambda: self.shared.live(now), lambda: self.local.live(now))

    def forget(self, instance: str) -> None:
        self.local.forget(instance)
        self.state.call(lambda: self.shared.forget(instance), lambda: None)
