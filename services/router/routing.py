"""The router's routing state: the sans-IO core (``swaserve.routing``) over this router's view of its
workers, with the shared state in Redis when ``redis_url`` is given (stateless replicas) or in this
process otherwise. ``choose``/``release`` reserve and return work, ``observe`` turns polls into
heartbeats and buckets, ``sync_workers`` merges the worker registry; Redis calls run on one thread.
In precise index mode the live GCache nodes (``l3.L3Nodes``, index instances ``l3:<node id>``) are
credited to every prefill worker: never a route target, never dropped as a worker.

Design notes: docs/DESIGN.md#servicesrouterroutingpy"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from services.router.l3 import L3Nodes
from swaserve.kvcache.hashing import block_hashes
from swaserve.routing.buckets import ALL_LENGTHS, LengthBuckets
from swaserve.routing.dispatch import Dispatcher, NoInstanceError
from swaserve.routing.index import IndexConfig, InMemoryPrefixIndex, PrefixIndex
from swaserve.routing.load import InMemoryLoadBook, Lease, LoadBook, WorkerReport
from swaserve.routing.policy import Decision, make_policy
from swaserve.routing.redis.registry import RedisWorkerRegistry
from swaserve.routing.registry import RegistryReplica, WorkerRegistry
from swaserve.sched.cost import preset
from swaserve.v1 import worker_pb2 as pb

log = logging.getLogger("swaserve.router")


@dataclass(frozen=True)
class RoutingOptions:
    """Router routing settings (``python -m services.router --help`` documents each).

    ``block_tokens`` must equal the prefill workers' ``--index-block-tokens`` in precise mode.
    ``lease_ttl_s``: a lease lives this long unless its router renews it (every third of it while the
    work runs), so a dead router's load is gone within it.
    """

    policy: str = "cache_aware"
    cost_model: str = "cpu-tiny"
    block_tokens: int = 64
    redis_url: str | None = None
    namespace: str = "swaserve"
    index_mode: str = "approximate"  # or "precise"
    index_max_entries: int = IndexConfig().max_entries
    index_ttl_s: float = IndexConfig().ttl_s
    balance_abs_s: float | None = None
    balance_rel: float | None = None
    queue_order: str = "auto"  # cache_aware: routing.policy.wait_s
    lease_ttl_s: float = 30.0
    redis_retry_s: float = 1.0
    l3_cache_s: float = 1.0  # precise mode: seconds the live GCache nodes are read for (l3.L3Nodes)
    policy_args: dict[str, float | str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.index_mode not in ("approximate", "precise"):
            raise ValueError(f"index mode must be 'approximate' or 'precise', got {self.index_mode!r}")
        if self.index_mode == "precise" and not self.redis_url:
            raise ValueError("precise index mode needs --redis-url (workers publish their events there)")
        if self.block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")


class RouterRouting:
    def __init__(self, opts: RoutingOptions, clock: Any = time.time) -> None:
        self.opts = opts
        cost = preset(opts.cost_model)
        kwargs = dict(opts.policy_args)
        if opts.policy == "cache_aware":
            if opts.balance_abs_s is not None:
                kwargs["balance_abs_s"] = opts.balance_abs_s
            if opts.balance_rel is not None:
                kwargs["balance_rel"] = opts.balance_rel
            kwargs["queue_order"] = opts.queue_order
        policy = make_policy(opts.policy, **kwargs)
        cfg = IndexConfig(opts.index_max_entries, opts.index_ttl_s)
        self.state = None
        self.follower = None
        self.l3: L3Nodes | None = None  # the GCache nodes credited (precise mode with Redis)
        self.registry: WorkerRegistry | None = None  # shared worker registry (None: no Redis)
        index: PrefixIndex
        book: LoadBook
        if opts.redis_url:
            import redis

            from swaserve.routing.redis.store import RedisLoadBook, RedisPrefixIndex
            from swaserve.routing.resilient import FallbackBook, FallbackIndex, SharedState

            client = redis.Redis.from_url(
                opts.redis_url, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0
            )
            # probes use a short timeout: a hung Redis must not stall routing for the full one
            prober = redis.Redis.from_url(opts.redis_url, socket_timeout=0.25, socket_connect_timeout=0.25)
            self.state = SharedState(
                prober.ping, (redis.exceptions.RedisError, OSError), clock, opts.redis_retry_s
            )
            index = FallbackIndex(RedisPrefixIndex(client, cfg, opts.namespace), self.state)
            book = FallbackBook(RedisLoadBook(client, opts.namespace), self.state)
            self.registry = RedisWorkerRegistry(client, opts.namespace)
            if opts.index_mode == "precise":
                from swaserve.routing.redis.events import IndexFollower

                self.follower = IndexFollower(index, client, opts.namespace, clock)
                # only precise mode has the nodes' entries (their block events); they are asked to
                # re-publish them every half TTL, as a page outlives its store event's last use
                self.l3 = L3Nodes(opts.redis_url, opts.namespace, opts.l3_cache_s, opts.index_ttl_s / 2)
        else:
            index, book = InMemoryPrefixIndex(cfg), InMemoryLoadBook()
        self.index, self.book = index, book
        self.buckets = LengthBuckets()
        self.dispatcher = Dispatcher(
            index, book, policy, cost, self.buckets, opts.block_tokens, clock, opts.lease_ttl_s
        )
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-routing")
        self._gone: set[str] = set()  # prefill workers seen down (entries dropped)
        self.active: dict[str, Lease] = {}  # leases of this router's running work (renewed)
        self._warned: set[str] = set()  # block-size mismatches reported
        self.decisions: collections.Counter[str] = collections.Counter()
        self.dispatches: collections.Counter[tuple[str, str]] = collections.Counter()  # (role, instance)

    def hashes(self, prompt: list[int]) -> list[int]:
        return block_hashes(prompt, self.opts.block_tokens)

    def choose(
        self,
        rid: str,
        prompt_len: int,
        hashes: list[int],
        total_tokens: int,
        prefill: Collection[str],
        decode: Collection[str],
    ) -> tuple[Decision, Lease, Lease]:
        """A prefill and a decode instance for one attempt, with their leases (blocking: run on
        ``executor``).

        Raises:
            NoInstanceError: ``prefill`` or ``decode`` is empty.
        """
        if self.follower is not None and self.state is not None:
            follower = self.follower
            self.state.call(follower.poll, lambda: 0)  # Redis down: route on the local index
        if not decode:
            raise NoInstanceError("no decode instance is available")
        # precise mode records nothing (the workers' events fill the index) unless Redis is down:
        # then no event arrives, so dispatches are recorded in the local index as in approximate
        # mode; when Redis is back they are re-synced into it and each worker's snapshot (it lost
        # events too) clears them and says what it really holds
        record = self.follower is None or (self.state is not None and not self.state.up)
        route = self.dispatcher.route_prefill(
            rid, prompt_len, hashes, prefill, record=record, l3_nodes=self.l3_nodes()
        )
        try:
            d_lease = self.dispatcher.route_decode(rid, total_tokens, decode)
        except BaseException:
            self.dispatcher.release(route.lease)
            raise
        self.active[route.lease.lease_id] = route.lease
        self.active[d_lease.lease_id] = d_lease
        d = route.decision
        self.decisions[d.reason + ("_fallback" if d.fallback else "")] += 1
        self.dispatches[("prefill", d.instance)] += 1
        self.dispatches[("decode", d_lease.instance)] += 1
        return d, route.lease, d_lease

    def l3_nodes(self) -> tuple[str, ...]:
        """The index instances of the live GCache nodes to credit (blocking: run on ``executor``):
        none without precise mode or while Redis is down (the index is local then, without their
        entries), else ``L3Nodes.current`` (read at most every ``l3_cache_s``); the nodes due a
        refresh of their entries are asked for a snapshot."""
        if self.l3 is None or self.state is None or self.follower is None or not self.state.up:
            return ()
        names = self.l3.current()
        follower = self.follower
        for inst in self.l3.due():
            self.state.call(functools.partial(follower.ask, inst), lambda: None)
        return names

    def release(self, *leases: Lease) -> None:
        for lease in leases:
            self.active.pop(lease.lease_id, None)
            self.dispatcher.release(lease)

    def renew(self) -> int:
        """Renew the leases of this router's running work (blocking: run on ``executor``)."""
        return self.dispatcher.renew(list(self.active.values()))

    def observe(self, address: str, role: str, load: pb.Load | None, healthy: bool) -> None:
        """One poll result (blocking: run on ``executor``). A prefill worker seen down has its
        index entries dropped once (its cache is gone if it died; a worker that comes back
        under the same address starts empty; in precise mode one that was only unreachable for a
        while is asked to re-publish its cache)."""
        if not healthy:
            if role == "prefill" and address not in self._gone:
                self._gone.add(address)
                dropped = self.index.remove_instance(address)
                log.info("prefill worker %s left: %d index entries dropped", address, dropped)
            return
        if address in self._gone and self.follower is not None and self.state is not None:
            # its cache may have outlived the outage: ask it to re-publish it (Redis down: its
            # pump re-publishes once Redis is back anyway)
            follower = self.follower
            self.state.call(lambda: follower.ask(address), lambda: None)
        self._gone.discard(address)
        if load is None:
            return
        B = load.index_block_tokens
        if (
            role == "prefill"
            and self.follower is not None
            and self.opts.block_tokens != B
            and address not in self._warned
        ):
            self._warned.add(address)
            log.error(
                "prefill worker %s publishes cache events in blocks of %s tokens, this router indexes "
                "blocks of %d (--block-tokens): precise mode cannot match its entries",
                address, B or "no", self.opts.block_tokens,
            )  # fmt: skip
        if role == "prefill":
            hi = load.max_prompt_tokens or ALL_LENGTHS[1]
            if self.buckets.range_of(address) != (load.min_prompt_tokens, hi):
                self.buckets.set(address, load.min_prompt_tokens, hi)
        kv = max((p.used_pages / p.total_pages for p in load.pools.values() if p.total_pages), default=0.0)
        rep = WorkerReport(
            queued_tokens=load.prefill_tokens if role == "prefill" else 0,
            running_tokens=0,
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_usage=kv,
            at=self.dispatcher.clock(),
            queue_order=load.queue_order or "fcfs",
        )
        self.book.heartbeat(address, rep)

    def forget(self, address: str, role: str) -> None:
        """A worker left this router for good (removed and drained; blocking: run on
        ``executor``): its index entries, leases, heartbeat and length bucket are dropped."""
        if role == "prefill":
            dropped = self.index.remove_instance(address)
            log.info("prefill worker %s removed: %d index entries dropped", address, dropped)
        self.book.forget(address)
        self.buckets.ranges.pop(address, None)
        self._gone.discard(address)
        self._warned.discard(address)

    def drop_index(self, address: str) -> int:
        """Drop a prefill worker's index entries (it is being drained: nothing new goes there)."""
        return self.index.remove_instance(address)

    def sync_workers(self, replica: RegistryReplica) -> bool:
        """Merge ``replica`` with the shared worker registry (blocking: run on ``executor``, the
        only thread that touches ``replica``). Returns False when there is no shared registry or
        it is unreachable (the replica then holds this router's changes until it is back)."""
        if self.registry is None or self.state is None:
            return False
        registry = self.registry

        def shared() -> bool:
            replica.sync(registry)
            return True

        return self.state.call(shared, lambda: False)

    @property
    def shared_up(self) -> bool | None:
        """Whether Redis answers (None without Redis)."""
        return None if self.state is None else self.state.up

    def index_size(self) -> int:
        return self.index.size()
