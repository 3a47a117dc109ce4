"""``L3Store``: how an engine reads and writes GCache pages, whatever the transport.

Implementations: ``LocalL3`` (a ``PageStore`` in this process: tests, a single-process server),
``services.gcache.client.GCacheClient`` (one node over gRPC control + UCX or gRPC data) and
``ShardedL3`` (several nodes: each page's owner by rendezvous hashing over the live nodes, as
Dynamo KVBM's G3PB plan; a dead node costs only misses). Objects are returned unverified: the
caller checks each with ``codec.verify`` against its own chain. Transport failures raise
``L3Error``; callers turn every failure into a miss. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from swaserve.gcache.store import Block, PageId, PageStore

log = logging.getLogger("swaserve.l3")

Object = bytes | memoryview  # a page object as a get returns it (a view: no copy was made)


class L3Error(Exception):
    """The L3 store could not answer (node down, deadline, protocol error)."""


SEGMENT_PAGES = 16  # pages placed together on one node (ShardedL3)


@dataclass
class PutPage:
    """A page object to store: ``obj`` from ``codec.encode``. ``place``: its placement key
    (``placements``); ``parent_elsewhere``: its parent may live on another node; ``block``: the
    routers' index block it completes (the node publishes its stored / removed events)."""

    pid: PageId
    parent: bytes
    index: int
    obj: bytes
    place: bytes = b""
    parent_elsewhere: bool = False
    block: Block | None = None  # the routers' index block this page completes


def placements(keys: Sequence[bytes], first_index: int, head: bytes | None = None) -> list[bytes]:
    """Placement keys of consecutive pages ``first_index, first_index + 1, ...`` with chain keys
    ``keys``: the key of the first page of their ``SEGMENT_PAGES``-page segment (``head``: that
    key when the segment starts before ``keys``). A segment lives on one node, so parents are
    local but at segment starts, and one conversation spreads over nodes segment by segment."""
    out, cur = [], head
    for j, k in enumerate(keys):
        if (first_index + j) % SEGMENT_PAGES == 0 or cur is None:
            cur = k
        out.append(cur)
    return out


@dataclass
class Found:
    """A lookup's answer: per page whether it is stored; ``lease`` is the store's read lease
    (opaque; ``get`` ends it)."""

    present: list[bool]
    lease: Any = None


class L3Store(Protocol):
    """``places``: each page's placement key (``placements``; used by ``ShardedL3``, ignored by a
    single node)."""

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found: ...

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        """The objects of ``pids`` (None: gone since the lookup; bytes or a memoryview: verify
        before use), ends ``found``'s lease."""
        ...

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        """Store pages (parents first); per page whether it is stored now (new or already)."""
        ...

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        """Delete pages a reader found bad (with their descendants)."""
        ...

    async def close(self) -> None: ...


def put_into(store: PageStore, pages: Sequence[PutPage]) -> list[bool]:
    """Two-phase put of ``pages`` into a local store: reserve all, then commit in order."""
    from swaserve.gcache.store import EXISTS

    res = [store.reserve(p.pid, p.parent, p.index, len(p.obj), p.parent_elsewhere, p.block) for p in pages]
    out = []
    for p, r in zip(pages, res, strict=True):
        if isinstance(r, int):
            try:
                store.commit(r, p.obj)
                out.append(True)
            except (KeyError, ValueError):
                out.append(False)
        else:
            out.append(r == EXISTS)
    return out


class LocalL3:
    """``L3Store`` over a ``PageStore`` in this process."""

    def __init__(self, store: PageStore) -> None:
        self.store = store

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        present, lease = self.store.lookup(pids)
        return Found(present, lease)

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        try:
            return [self.store.read(p) for p in pids]
        finally:
            if found.lease:
                self.store.release(found.lease)

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        return put_into(self.store, pages)

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        self.store.remove(pids)

    async def close(self) -> None:
        return None


_LOCAL: dict[str, PageStore] = {}


def local_store(name: str, dram_bytes: int = 256 << 20) -> PageStore:
    """The process-wide in-memory store called ``name`` (``local://name`` L3 URLs): engines of one
    process that name the same store share it (tests; a single-process server)."""
    from swaserve.gcache.tiers import DramTier

    st = _LOCAL.get(name)
    if st is None:
        st = _LOCAL[name] = PageStore(DramTier(dram_bytes))
    return st


def connect(url: str) -> L3Store:
    """The ``L3Store`` an L3 URL names (create it inside the event loop that will use it).

    ``local://NAME``: ``LocalL3`` over ``local_store(NAME)``. Other schemes come from the
    ``swaserve.l3`` entry point group (``gcache://host:port``, ``redis://...`` for the nodes a
    Redis registry lists: services/gcache/client.py). Raises ValueError for an unknown scheme."""
    from importlib.metadata import entry_points

    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"an L3 URL looks like scheme://..., got {url!r}")
    if scheme == "local":
        return LocalL3(local_store(rest or "default"))
    for ep in entry_points(group="swaserve.l3"):
        if ep.name == scheme:
            factory: Callable[[str], L3Store] = ep.load()
            return factory(url)
    raise ValueError(f"no L3 store for {scheme!r} URLs (known: local, and the swaserve.l3 entry points)")


def owner(place: bytes, nodes: Sequence[str]) -> str:
    """Rendezvous (highest random weight) hashing: the node with the largest
    ``BLAKE2b(node, place)``; adding or losing a node moves only its share of the pages."""

    def weight(n: str) -> bytes:
        return hashlib.blake2b(n.encode() + b"\0" + place, digest_size=8).digest()

    return max(nodes, key=weight)


class Throttle:
    """Lets an event through at most once per ``period_s`` per key (the first always): a call
    returns how many were held back since the last one let through, or None while holding back.
    ``clock``: seconds, monotonic."""

    def __init__(self, period_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s, self.clock = period_s, clock
        self._last: dict[str, float] = {}
        self._held: Counter[str] = Counter()

    def __call__(self, key: str = "") -> int | None:
        now = self.clock()
        if now - self._last.get(key, -math.inf) < self.period_s:
            self._held[key] += 1
            return None
        self._last[key] = now
        return self._held.pop(key, 0)


@dataclass
class _Leases:
    by_node: dict[str, Found] = field(default_factory=dict)


class ShardedL3:
    """``L3Store`` over several nodes. ``live()``: the node ids usable now (e.g. from the Redis
    registry); ``connect(node_id)``: its ``L3Store``. A node that fails answers "absent" (its
    pages are misses, its puts not stored), counted in ``node_errors`` by operation and logged
    (the first failure of a node, then at most one a minute)."""

    def __init__(self, live: Callable[[], Sequence[str]], connect: Callable[[str], L3Store]) -> None:
        self.live, self.connect = live, connect
        self._stores: dict[str, L3Store] = {}
        self.node_errors: Counter[str] = Counter(dict.fromkeys(("lookup", "get", "put", "remove"), 0))
        self._throttle = Throttle()  # per node

    def _failed(self, node: str, op: str, err: L3Error) -> None:
        self.node_errors[op] += 1
        held = self._throttle(node)
        if held is not None:
            log.warning(
                "gcache node %s: %s failed (%s; %d more failures since the last warning); its pages "
                "are misses meanwhile", node, op, err, held,
            )  # fmt: skip

    def _store(self, node: str) -> L3Store:
        s = self._stores.get(node)
        if s is None:
            s = self._stores[node] = self.connect(node)
        return s

    def _split(self, pids: Sequence[PageId], places: Sequence[bytes] | None) -> dict[str, list[int]]:
        nodes = sorted(self.live())
        groups: dict[str, list[int]] = {}
        if nodes:
            for i, p in enumerate(pids):
                groups.setdefault(owner(places[i] if places else p[0], nodes), []).append(i)
        return groups

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        groups = self._split(pids, places)
        present = [False] * len(pids)
        leases = _Leases()

        async def one(node: str, idx: list[int]) -> None:
            try:
                f = await self._store(node).lookup([pids[i] for i in idx])
            except L3Error as e:
                self._failed(node, "lookup", e)
                return
            leases.by_node[node] = f
            for i, ok in zip(idx, f.present, strict=True):
                present[i] = ok

        await asyncio.gather(*(one(n, idx) for n, idx in groups.items()))
        return Found(present, leases)

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        groups = self._split(pids, places)
        out: list[Object | None] = [None] * len(pids)
        leases: _Leases = found.lease if isinstance(found.lease, _Leases) else _Leases()

        async def one(node: str, idx: list[int]) -> None:
            f = leases.by_node.get(node, Found([True] * len(idx)))
            try:
                objs = await self._store(node).get(f, [pids[i] for i in idx])
            except L3Error as e:
                self._failed(node, "get", e)
                return
            for i, o in zip(idx, objs, strict=True):
                out[i] = o

        # the lookup's leases on nodes this get reads nothing from end too (a get of no pages)
        rest = {n: f for n, f in leases.by_node.items() if n not in groups and f.lease}
        await asyncio.gather(
            *(one(n, idx) for n, idx in groups.items()), *(self._release(n, f) for n, f in rest.items())
        )
        return out

    async def _release(self, node: str, found: Found) -> None:
        with contextlib.suppress(L3Error):
            await self._store(node).get(found, [])

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        # a segment's first page has its parent on another node (or none): stored without it
        pages = [
            dataclasses.replace(p, parent_elsewhere=p.parent_elsewhere or p.index % SEGMENT_PAGES == 0)
            for p in pages
        ]
        groups = self._split([p.pid for p in pages], [p.place or p.pid[0] for p in pages])
        out = [False] * len(pages)

        async def one(node: str, idx: list[int]) -> None:
            try:
                oks = await self._store(node).put([pages[i] for i in idx])
            except L3Error as e:
                self._failed(node, "put", e)
                return
            for i, ok in zip(idx, oks, strict=True):
                out[i] = ok

        await asyncio.gather(*(one(n, idx) for n, idx in groups.items()))
        return out

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        groups = self._split(pids, places)
        for node, idx in groups.items():
            try:
                await self._store(node).remove([pids[i] for i in idx])
            except L3Error as e:
                self._failed(node, "remove", e)

    async def close(self) -> None:
        for s in self._stores.values():
            await s.close()
        self._stores.clear()
