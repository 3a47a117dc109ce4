"""One routing decision, end to end: bucket -> prefix match -> loads -> policy -> atomic reserve ->
index record. The router service and the simulator both call this with their own clock.

Select-and-reserve is atomic: the lease is added only if no candidate's load changed since it was
read (``LoadBook.reserve`` with the versions read); on a conflict (another router reserved in
between) the loads are read again and the policy re-run, up to ``max_conflicts`` times, after which
the last choice is reserved unconditionally (still counted, possibly on slightly stale loads).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

from swaserve.routing.buckets import LengthBuckets
from swaserve.routing.index import PrefixIndex
from swaserve.routing.load import DEFAULT_LEASE_TTL_S, Lease, LoadBook
from swaserve.routing.policy import Candidate, Decision, Policy, choose_decode
from swaserve.sched.cost import CostModel


class NoInstanceError(RuntimeError):
    """No live instance of the role is known."""


@dataclass(frozen=True)
class Route:
    """A prefill decision and the lease holding its work (release it when the prefill is done)."""

    decision: Decision
    lease: Lease


class Dispatcher:
    """Args:
    index, book: the shared state (same backend for every router replica).
    policy: prefill selection. cost: the deployment's cost model.
    buckets: prompt-length ranges of the prefill instances.
    block_tokens: tokens per index block (as ``hashing.block_hashes`` was called with).
    clock: seconds, injected (``time.time`` in services: leases are compared across routers).
    lease_ttl_s: seconds a lease counts if nobody releases it. max_conflicts: see module doc.
    """

    def __init__(
        self,
        index: PrefixIndex,
        book: LoadBook,
        policy: Policy,
        cost: CostModel,
        buckets: LengthBuckets | None = None,
        block_tokens: int = 64,
        clock: Callable[[], float] | None = None,
        lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
        max_conflicts: int = 8,
    ) -> None:
        import time

        self.index, self.book, self.policy, self.cost = index, book, policy, cost
        self.buckets = buckets or LengthBuckets()
        self.block_tokens = block_tokens
        self.clock = clock or time.time
        self.lease_ttl_s, self.max_conflicts = lease_ttl_s, max_conflicts
        self.conflicts = 0  # reserve conflicts seen (metrics)

    def route_prefill(
        self,
        request_id: str,
        prompt_tokens: int,
        hashes: Sequence[int],
        instances: Collection[str],
        record: bool = True,
        l3_nodes: Collection[str] = (),
    ) -> Route:
        """Choose a prefill instance among ``instances`` (live ones) and reserve its work.

        Args:
            request_id: unique per attempt (the lease id is derived from it).
            prompt_tokens: prompt length. hashes: its block chain (``block_tokens`` per block).
            record: record the chain on the chosen instance (approximate index mode; in precise
                mode the workers' events fill the index).
            l3_nodes: the index names of the L3 (GCache) nodes whose events fill the index: the
                leading blocks they hold together are credited to every instance.

        Raises:
            NoInstanceError: ``instances`` is empty.
        """
        now = self.clock()
        names, fallback = self.buckets.candidates(prompt_tokens, instances)
        if not names:
            raise NoInstanceError("no prefill instance is available")
        matched = self.index.match(hashes, now, names)
        cap = max(prompt_tokens - 1, 0)  # the last prompt token is always computed
        l3 = min(self.l3_blocks(hashes, now, l3_nodes) * self.block_tokens, cap)
        for attempt in range(self.max_conflicts + 1):
            loads = self.book.loads(names, now)
            cands = [
                Candidate(i, min(matched.get(i, 0) * self.block_tokens, cap), loads[i], l3) for i in names
            ]
            d = self.policy.choose(prompt_tokens, cands, self.cost)
            uncached = prompt_tokens - d.cached_tokens
            lease = Lease(
                f"{request_id}/prefill",
                d.instance,
                self.cost.prefill_s(uncached, d.cached_tokens),
                uncached,
                now + self.lease_ttl_s,
            )
            last = attempt == self.max_conflicts
            if self.book.reserve(lease, now, None if last else {i: loads[i].version for i in names}):
                break
            self.conflicts += 1
        if record:
            self.index.record(d.instance, hashes, now)
        return Route(replace(d, fallback=fallback), lease)

    def l3_blocks(
        self, hashes: Sequence[int], now: float, nodes: Collection[str], max_rounds: int = 64
    ) -> int:
        """Leading blocks of ``hashes`` the L3 nodes hold together (a chain is spread over nodes
        segment by segment: each round asks for the longest run one node holds from where the
        last one stopped)."""
        k = 0
        for _ in range(max_rounds if nodes else 0):
            if k >= len(hashes):
                break
            got = max(self.index.match(hashes[k:], now, nodes).values(), default=0)
            if got == 0:
                break
            k += got
        return k

    def route_decode(self, request_id: str, tokens: int, instances: Collection[str]) -> Lease:
        """Choose a decode instance and reserve ``tokens`` (prompt + max output) of KV on it.

        Raises:
            NoInstanceError: ``instances`` is empty.
        """
        if not instances:
            raise NoInstanceError("no decode instance is available")
        now = self.clock()
        names = sorted(instances)
        for attempt in range(self.max_conflicts + 1):
            loads = self.book.loads(names, now)
            lease = Lease(f"{request_id}/decode", choose_decode(loads), 0.0, tokens, now + self.lease_ttl_s)
            last = attempt == self.max_conflicts
            if self.book.reserve(lease, now, None if last else {i: loads[i].version for i in names}):
                return lease
            self.conflicts += 1
        raise AssertionError("unreachable: the last reserve is unconditional")

    def release(self, lease: Lease) -> None:
        """The leased work left the instance (done, failed or aborted)."""
        self.book.release(lease.instance, lease.lease_id)

    def renew(self, leases: list[Lease]) -> int:
        """Extend the leases of work still running by ``lease_ttl_s`` from now; returns how many
        were still there."""
        until = self.clock() + self.lease_ttl_s
        return sum(self.book.renew(x.instance, x.lease_id, until) for x in leases)
