"""``GCacheNode``: one GCache node's page store behind both data planes (gRPC and UCX).

Every store operation runs on one dedicated thread (``PageStore`` is not thread-safe, and NVMe
reads and writes must not block the event loop); ``maintain`` (lease expiry, zombie reclaim,
demotion) runs there every ``maintain_s``. The request checks (``check_pages``, ``check_items``)
are shared by the gRPC servicer and the UCX dispatcher (``handle_ucx``: ``OP_GET``, ``OP_PUT``),
so a bad request is a ``BadRequest`` (INVALID_ARGUMENT with a message) on either port, never a
crash. ``drain``: puts are refused (``Unavailable``), reads go on. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from swaserve.gcache.codec import KIND_NAMES, CorruptPage
from swaserve.gcache.keys import KEY_BYTES
from swaserve.gcache.store import BUSY, EXISTS, FULL, NO_PARENT, Block, PageId, PageStore
from swaserve.kvcache.block_events import BlockEvent
from swaserve.v1 import gcache_pb2 as pb

if TYPE_CHECKING:
    from services.gcache.ucx import Reply

log = logging.getLogger("swaserve.gcache")
T = TypeVar("T")

INLINE_PAGES = 64  # a UCX get of at most this many pages, all in DRAM, is read on the event loop
OP_GET = 1  # meta: GetRequest -> reply meta GetReply, buffers: the found objects in order
OP_PUT = 2  # meta: PutDataRequest, buffers: one object per reservation -> reply meta PutDataReply
STATUS = {
    EXISTS: pb.PutSlot.EXISTS,
    BUSY: pb.PutSlot.BUSY,
    FULL: pb.PutSlot.FULL,
    NO_PARENT: pb.PutSlot.NO_PARENT,
}
Observe = Callable[[str, str, float], None]  # (op, transport, seconds)


class BadRequest(ValueError):
    """A request the node refuses as malformed (INVALID_ARGUMENT); the message says why."""


class Unavailable(RuntimeError):
    """The node does not take this request now (draining: UNAVAILABLE)."""


@dataclass(frozen=True)
class Limits:
    """max_object_bytes: the largest page object accepted (bytes); max_batch: pages per request;
    max_lease_s: the longest read lease a lookup may ask for (seconds)."""

    max_object_bytes: int = 64 << 20
    max_batch: int = 16384
    max_lease_s: float = 600.0


@dataclass(frozen=True)
class Reserve:
    """One checked ``PutItem``."""

    pid: PageId
    parent: bytes
    index: int
    size: int
    parent_elsewhere: bool
    block: Block | None


def check_pages(pages: Sequence[pb.PageRef], limits: Limits) -> list[PageId]:
    """The page ids of ``pages``. Raises ``BadRequest`` (too many, a key not 16 bytes, a kind not
    0 or 1)."""
    if len(pages) > limits.max_batch:
        raise BadRequest(f"{len(pages)} pages in one request, at most {limits.max_batch}")
    out = []
    for i, p in enumerate(pages):
        if len(p.key) != KEY_BYTES:
            raise BadRequest(f"page {i}: a key is {KEY_BYTES} bytes, got {len(p.key)}")
        if p.kind not in KIND_NAMES:
            raise BadRequest(f"page {i}: unknown kind {p.kind} (0 full attention, 1 sliding window)")
        out.append((bytes(p.key), int(p.kind)))
    return out


def check_items(items: Sequence[pb.PutItem], limits: Limits) -> list[Reserve]:
    """``PutItem``s checked: page, parent key (16 bytes), size in ``(0, max_object_bytes]``.
    Raises ``BadRequest``."""
    pids = check_pages([it.page for it in items], limits)
    out = []
    for i, (it, pid) in enumerate(zip(items, pids, strict=True)):
        if len(it.parent) != KEY_BYTES:
            raise BadRequest(f"item {i}: a parent key is {KEY_BYTES} bytes, got {len(it.parent)}")
        if not 0 < it.size <= limits.max_object_bytes:
            raise BadRequest(f"item {i}: object size {it.size} not in [1, {limits.max_object_bytes}] bytes")
        block = None
        if it.has_block:
            block = Block(it.block, it.block_depth, it.block_parent if it.has_block_parent else None)
        out.append(Reserve(pid, bytes(it.parent), it.index, it.size, it.parent_elsewhere, block))
    return out


class GCacheNode:
    """Args:
    make_store: builds the store (called on the store thread: NVMe recovery reads every slot).
    node_id: this node's name. limits: request bounds. maintain_s: seconds between ``maintain``.
    observe: records an op's latency (``metrics.GCacheMetrics.observe``).

    Attributes: draining (puts refused), ucx_port (0: no UCX data plane), direct_io."""

    def __init__(
        self,
        make_store: Callable[[], PageStore],
        node_id: str = "gcache",
        limits: Limits | None = None,
        maintain_s: float = 1.0,
        observe: Observe | None = None,
    ) -> None:
        self.make_store, self.node_id = make_store, node_id
        self.limits = limits or Limits()
        self.maintain_s = maintain_s
        self.observe: Observe = observe or (lambda op, transport, s: None)
        self.draining = False
        self.ucx_port = 0
        self.direct_io = False
        self.publish_events = False  # a publisher drains store.events (else maintain drops them)
        self.on_drain: list[Callable[[], Awaitable[None]]] = []
        self._store: PageStore | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gcache-store")
        # held by every store operation: the store thread's, and a DRAM read the event loop does
        # itself when the store is free (``run_inline``: no thread hop for a small UCX get)
        self._lock = threading.Lock()
        self._maintainer: asyncio.Task[None] | None = None
        self._ops = 0
        self._changed: asyncio.Event | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the store (on its thread) and start maintenance. Raises what ``make_store`` does."""
        self._changed = asyncio.Event()
        self._store = await self._call(self.make_store)
        self._maintainer = asyncio.create_task(self._maintain_loop())

    @property
    def store(self) -> PageStore:
        """The store: touch it only on the store thread (``run``)."""
        if self._store is None:
            raise RuntimeError("the node is not started")
        return self._store

    async def close(self) -> None:
        if self._maintainer is not None:
            self._maintainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._maintainer
        if self._store is not None:
            await self._call(self._store.close)
        self._pool.shutdown(wait=True)

    def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._locked, fn, *args)

    def run_inline(self, fn: Callable[[PageStore], T]) -> tuple[bool, T | None]:
        """``(True, fn(store))`` run on this thread if the store is free right now, else
        ``(False, None)`` (never waits). ``fn`` must not block: no NVMe I/O."""
        if self._store is None or not self._lock.acquire(blocking=False):
            return False, None
        try:
            return True, fn(self._store)
        finally:
            self._lock.release()

    async def run(self, fn: Callable[[PageStore], T]) -> T:
        """``fn(store)`` on the store thread, counted as an operation in flight."""
        self._ops += 1
        try:
            return await self._call(fn, self.store)
        finally:
            self._ops -= 1
            if self._changed is not None:
                self._changed.set()

    async def _maintain_loop(self) -> None:
        while True:
            await asyncio.sleep(self.maintain_s)  # a period, not a wait for another task
            try:
                await self.run(self._maintain)
            except Exception:  # keep maintaining: one failure (an NVMe error) must not stop it
                log.exception("gcache maintenance failed")

    def _maintain(self, st: PageStore) -> None:
        st.maintain()
        if not self.publish_events:
            st.events.clear()

    def snapshot(
        self, timeout_s: float = 5.0
    ) -> tuple[Counter[tuple[str, str, str]], dict[str, dict[str, int]]]:
        """The store's counters and usage, from any thread (metrics). Raises RuntimeError when the
        node is closed, TimeoutError when the store thread is busy past ``timeout_s``."""

        def take() -> tuple[Counter[tuple[str, str, str]], dict[str, dict[str, int]]]:
            return Counter(self.store.stats), self.store.usage()

        return self._pool.submit(self._locked, take).result(timeout_s)

    # -- operations ------------------------------------------------------------------------------
    async def lookup(self, pids: list[PageId], lease_s: float = 0.0) -> tuple[list[bool], int]:
        """Which pages are present and a read lease on them (0: none; ``lease_s`` 0: the store's
        default). Raises ``BadRequest`` for a lease outside ``[0, max_lease_s]``."""
        if not (math.isfinite(lease_s) and 0 <= lease_s <= self.limits.max_lease_s):
            raise BadRequest(f"lease_s {lease_s} not in [0, {self.limits.max_lease_s}] seconds")
        return await self.run(lambda st: st.lookup(pids, lease_s or None))

    async def release(self, lease: int) -> None:
        await self.run(lambda st: st.release(lease))

    async def get(self, pids: list[PageId], lease: int = 0) -> list[bytes | None]:
        """The objects of ``pids`` (None: absent or corrupt); ends ``lease`` after the read."""

        def read(st: PageStore) -> list[bytes | None]:
            try:
                return [st.read(p) for p in pids]
            finally:
                if lease:
                    st.release(lease)

        return await self.run(read)

    async def get_views(
        self, pids: list[PageId], lease: int = 0, pin_s: float = 75.0
    ) -> tuple[list[bytes | memoryview | None], Callable[[], None]]:
        """``get`` without copying DRAM pages: views into the tier, leased here until the
        returned ``done`` is called (from the event loop, once they are sent; any thread) or
        ``pin_s`` seconds at most (longer than the UCX server's request timeout). A caller
        cancelled meanwhile releases them as soon as the read is over."""

        def read(st: PageStore) -> tuple[list[bytes | memoryview | None], int]:
            try:
                pin = st.pin(pids, pin_s)
                return [st.read_view(p) for p in pids], pin
            finally:
                if lease:
                    st.release(lease)

        def release(pin: int) -> None:
            if pin and self._store is not None and not self.run_inline(lambda st: st.release(pin))[0]:
                with contextlib.suppress(RuntimeError):  # the pool is shut down: the store is gone
                    self._pool.submit(self._locked, self.store.release, pin)

        def in_dram(st: PageStore) -> tuple[list[bytes | memoryview | None], int] | None:
            if any((e := st.index.get(p)) is not None and e.tier is not st.dram for p in pids):
                return None  # an NVMe read would block the loop: the store thread does it
            return read(st)

        if len(pids) <= INLINE_PAGES:
            ok, got = self.run_inline(in_dram)
            if ok and got is not None:
                return got[0], lambda: release(got[1])

        def after_cancel(t: asyncio.Task[tuple[list[bytes | memoryview | None], int]]) -> None:
            if not t.cancelled() and t.exception() is None:
                release(t.result()[1])

        task = asyncio.ensure_future(self.run(read))
        try:
            objs, pin = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(after_cancel)  # the peer left: nothing will send these views
            raise
        return objs, lambda: release(pin)

    async def put_start(self, items: list[Reserve]) -> list[tuple[pb.PutSlot.Status, int]]:
        """Reserve room: per item ``(PutSlot status, reservation)``. Raises ``Unavailable`` while
        draining."""
        if self.draining:
            raise Unavailable(f"gcache node {self.node_id} is draining: puts refused, reads go on")

        def reserve(st: PageStore) -> list[tuple[pb.PutSlot.Status, int]]:
            out = []
            for it in items:
                r = st.reserve(it.pid, it.parent, it.index, it.size, it.parent_elsewhere, it.block)
                out.append((pb.PutSlot.RESERVED, r) if isinstance(r, int) else (STATUS[r], 0))
            return out

        return await self.run(reserve)

    async def put_data(self, objs: Sequence[tuple[int, bytes | memoryview]]) -> list[tuple[bool, str]]:
        """Commit reserved objects: per object ``(committed, why not)``. Raises ``BadRequest``
        for an object over ``max_object_bytes``."""
        for i, (_, obj) in enumerate(objs):
            if len(obj) > self.limits.max_object_bytes:
                raise BadRequest(f"object {i}: {len(obj)} bytes, at most {self.limits.max_object_bytes}")

        def commit(st: PageStore) -> list[tuple[bool, str]]:
            out: list[tuple[bool, str]] = []
            for rid, obj in objs:
                try:
                    st.commit(rid, obj)
                    out.append((True, ""))
                except (KeyError, CorruptPage) as e:
                    out.append((False, str(e.args[0]) if e.args else type(e).__name__))
                except OSError as e:  # the store released the slot and counted it (io_errors)
                    log.warning("gcache write failed: %s", e)
                    out.append((False, f"write failed: {e}"))
            return out

        return await self.run(commit)

    async def remove(self, pids: list[PageId]) -> int:
        return await self.run(lambda st: st.remove(pids))

    async def usage(self) -> dict[str, dict[str, int]]:
        return await self.run(lambda st: st.usage())

    async def drain_events(self, resync: bool = False) -> list[BlockEvent]:
        """The index block events since the last call (``resync``: a ``cleared`` then every
        stored block: a snapshot), for ``services.index_events.EventPump``."""

        def take(st: PageStore) -> list[BlockEvent]:
            evs, st.events[:] = list(st.events), []
            if resync:
                return [
                    BlockEvent("cleared", ()),
                    *(BlockEvent("stored", (b.key,), b.parent, b.depth) for b in st.blocks()),
                ]
            return [
                BlockEvent("stored", (b.key,), b.parent, b.depth)
                if op == "stored"
                else BlockEvent("removed", (b.key,))
                for op, b in evs
            ]

        return await self.run(take)

    async def drain(self) -> None:
        """Refuse puts from now on (reads go on); runs the ``on_drain`` callbacks once."""
        if self.draining:
            return
        self.draining = True
        log.info("gcache node %s draining: puts refused, reads go on", self.node_id)
        for cb in self.on_drain:
            await cb()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no operation is in flight and no put reservation is open, at most
        ``timeout_s`` seconds; returns whether that happened."""
        assert self._changed is not None
        deadline = time.monotonic() + timeout_s
        while True:
            self._changed.clear()
            if self._ops == 0 and not await self._call(lambda: len(self.store.pending)):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    # -- the UCX data plane ----------------------------------------------------------------------
    async def handle_ucx(self, op: int, meta: bytes, buffers: list[memoryview]) -> Reply:
        """The UCX server's handler: ``OP_GET`` / ``OP_PUT``. Every failure is a status with a
        message in ``meta`` (INVALID_ARGUMENT, UNAVAILABLE, UNIMPLEMENTED, INTERNAL)."""
        from services.gcache.ucx import Reply

        t0 = time.perf_counter()
        name = {OP_GET: "get", OP_PUT: "put_data"}.get(op, "unknown")
        try:
            if op == OP_GET:
                req = pb.GetRequest.FromString(bytes(meta))
                views, done = await self.get_views(check_pages(req.pages, self.limits), req.lease)
                found = [o for o in views if o is not None]
                meta = pb.GetReply(found=[o is not None for o in views]).SerializeToString()
                return Reply(0, meta, found, done)
            if op == OP_PUT:
                put = pb.PutDataRequest.FromString(bytes(meta))
                if len(put.reservations) != len(buffers):
                    raise BadRequest(f"{len(put.reservations)} reservations but {len(buffers)} objects")
                if len(buffers) > self.limits.max_batch:
                    raise BadRequest(
                        f"{len(buffers)} objects in one request, at most {self.limits.max_batch}"
                    )
                res = await self.put_data(list(zip(put.reservations, buffers, strict=True)))
                reply = pb.PutDataReply(committed=[ok for ok, _ in res], errors=[why for _, why in res])
                return Reply(0, reply.SerializeToString())
            return Reply(_code(grpc.StatusCode.UNIMPLEMENTED), f"unknown op {op} (1 get, 2 put)".encode())
        except DecodeError as e:
            return Reply(_code(grpc.StatusCode.INVALID_ARGUMENT), f"op {op}: bad metadata: {e}".encode())
        except BadRequest as e:
            return Reply(_code(grpc.StatusCode.INVALID_ARGUMENT), str(e).encode())
        except Unavailable as e:
            return Reply(_code(grpc.StatusCode.UNAVAILABLE), str(e).encode())
        except Exception as e:
            log.exception("gcache UCX op %d failed", op)
            return Reply(_code(grpc.StatusCode.INTERNAL), f"op {op} failed: {e!r}".encode())
        finally:
            self.observe(name, "ucx", time.perf_counter() - t0)


def _code(code: grpc.StatusCode) -> int:
    return int(code.value[0])
