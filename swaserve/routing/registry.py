"""The worker registry: prefill and decode workers added or removed at runtime, shared by the
stateless router replicas of one cluster.

One ``WorkerEntry`` per address (active with a role, or removed: a tombstone), merged
last-writer-wins; each router keeps a ``RegistryReplica`` over its command-line workers (and the
pods it discovers: ``routing.discovery``) and syncs it with the shared backend every poll (Redis:
``routing.redis.registry``).

Design notes: docs/DESIGN.md#routingregistrypy"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ROLES = ("prefill", "decode")
ACTIVE, REMOVED = "active", "removed"


@dataclass(frozen=True)
class WorkerEntry:
    """One registry change. ``address``: ``host:port`` as routers dial it (and as the worker is
    named in the prefix index and metrics); ``role``: ``prefill`` or ``decode``; ``state``:
    ``active`` or ``removed``; ``at``: when the change was made (wall clock, seconds)."""

    address: str
    role: str
    state: str
    at: float

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if self.state not in (ACTIVE, REMOVED):
            raise ValueError(f"state must be 'active' or 'removed', got {self.state!r}")

    def key(self) -> tuple[float, str, str]:
        """Merge order: the greater key wins."""
        return (self.at, self.state, self.role)

    def encode(self) -> str:
        return f"{self.at!r} {self.state} {self.role}"

    @classmethod
    def decode(cls, address: str, value: str) -> WorkerEntry:
        """Raises ValueError on a malformed stored value."""
        at, state, role = value.split(" ")
        return cls(address, role, state, float(at))


def newest(a: WorkerEntry | None, b: WorkerEntry) -> WorkerEntry:
    """The entry that wins a merge (``b`` when ``a`` is None)."""
    return b if a is None or b.key() > a.key() else a


class WorkerRegistry(ABC):
    """The shared registry; one interface for every backend."""

    @abstractmethod
    def sync(self, entries: Iterable[WorkerEntry]) -> dict[str, WorkerEntry]:
        """Store each of ``entries`` unless a newer one is stored for its address (one atomic
        step), then return every stored entry by address. Backend errors propagate."""


class InMemoryWorkerRegistry(WorkerRegistry):
    """The registry in this process (thread-safe); for one router, tests and the simulator."""

    def __init__(self) -> None:
        self._entries: dict[str, WorkerEntry] = {}
        self._lock = threading.Lock()

    def sync(self, entries: Iterable[WorkerEntry]) -> dict[str, WorkerEntry]:
        with self._lock:
            for e in entries:
                self._entries[e.address] = newest(self._entries.get(e.address), e)
            return dict(self._entries)


class RegistryReplica:
    """A router's copy of the registry over its command-line workers and its discovered ones.

    Args:
        flags: address -> role of the workers this router was started with.
    """

    def __init__(self, flags: Mapping[str, str]) -> None:
        self.flags = dict(flags)
        self.entries: dict[str, WorkerEntry] = {}
        self.found: dict[str, tuple[str, float]] = {}  # discovered: address -> (role, since)

    def discover(self, found: Mapping[str, tuple[str, float]]) -> None:
        """Replace the discovered workers (Kubernetes pods in use): address -> (role, since: when
        the pod was created, wall-clock seconds). They count as command-line workers, but a
        registry change made before ``since`` does not apply to them: it was about an earlier
        holder of the address (pod IPs are reused)."""
        self.found = dict(found)

    def _applies(self, e: WorkerEntry) -> bool:
        found = self.found.get(e.address)
        return found is None or e.at > found[1]

    def set(self, entry: WorkerEntry) -> None:
        """Apply one change (made on this router, or read from the shared registry)."""
        self.entries[entry.address] = newest(self.entries.get(entry.address), entry)

    def merge(self, entries: Mapping[str, WorkerEntry]) -> None:
        """Merge what the shared registry returned."""
        for e in entries.values():
            self.set(e)

    def sync(self, registry: WorkerRegistry) -> None:
        """Write this copy's entries to ``registry`` and merge back what it holds. Errors of
        the backend propagate (the copy is unchanged then)."""
        self.merge(registry.sync(list(self.entries.values())))

    def effective(self) -> dict[str, str]:
        """address -> role of the workers to route to: the flags and the discovered workers (those
        win), with the entries that apply applied."""
        out = dict(self.flags) | {addr: role for addr, (role, _) in self.found.items()}
        for addr, e in self.entries.items():
            if not self._applies(e):
                continue
            if e.state == ACTIVE:
                out[addr] = e.role
            else:
                out.pop(addr, None)
        return out

    def source(self, address: str) -> str:
        """``registry`` if a change for ``address`` applies, else ``kubernetes`` if discovered,
        else ``flag``."""
        e = self.entries.get(address)
        if e is not None and self._applies(e):
            return "registry"
        return "kubernetes" if address in self.found else "flag"
