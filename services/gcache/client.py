"""Clients of GCache nodes, as ``swaserve.gcache.l3.L3Store``s.

``GCacheClient``: one node. Control (Lookup, PutStart, Remove, Release, Info) over gRPC; page data
over UCX (``OP_GET`` / ``OP_PUT``) when the node has a UCX port and ucxx imports (``transport=
"auto"``), else the gRPC Get / PutData streams. Every failure (a gRPC status, a deadline, a UCX
transport error, a refusal) raises ``L3Error`` with a message; after a UCX failure the next call
asks the node's Info again (a restarted node may listen on another UCX port).

Several nodes: ``registry`` (nodes register in Redis, ``live_nodes`` reads them) and
``RegistryL3`` (``ShardedL3`` over the live nodes). ``connect(url)`` is the ``swaserve.l3`` entry
point: ``gcache://HOST:PORT`` or ``redis://HOST:PORT/DB``, both with optional query parameters
``transport=auto|ucx|grpc`` and ``timeout_s=SECONDS`` (redis: also ``namespace=NAME``)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import grpc

from services.gcache import registry
from services.gcache.node import OP_GET, OP_PUT
from services.gcache.servicer import message_limit
from swaserve.gcache.l3 import Found, L3Error, L3Store, Object, PutPage, ShardedL3
from swaserve.gcache.store import PageId
from swaserve.v1 import gcache_pb2 as pb
from swaserve.v1 import gcache_pb2_grpc as gcgrpc

T = TypeVar("T")
TRANSPORTS = ("auto", "ucx", "grpc")
MAX_OBJECT_BYTES = 64 << 20  # the largest object a client receives over gRPC (the node's default)


def _refs(pids: Sequence[PageId]) -> list[pb.PageRef]:
    return [pb.PageRef(key=k, kind=kind) for k, kind in pids]


def _ucx_module() -> Any:
    from services.gcache import ucx

    return ucx


class GCacheClient:
    """``L3Store`` over one node. Args: address: its gRPC ``host:port``; transport: ``auto``,
    ``ucx`` (refused when the node has no UCX port or ucxx does not import) or ``grpc``;
    timeout_s: every call's deadline (seconds). Create it inside the event loop that uses it.
    Raises ValueError for an unknown transport."""

    def __init__(
        self,
        address: str,
        transport: str = "auto",
        timeout_s: float = 5.0,
        max_object_bytes: int = MAX_OBJECT_BYTES,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.address, self.transport, self.timeout_s = address, transport, timeout_s
        self.max_object_bytes = max_object_bytes
        self._channel: grpc.aio.Channel | None = None
        self._stub: gcgrpc.GCacheStub | None = None
        self._ucx: Any = None  # ucx.UcxClient
        self._ucx_port = 0
        self._decided = False  # the data transport is chosen (Info asked since the last UCX failure)
        self.data_transport = "grpc" if transport == "grpc" else ""  # "ucx" | "grpc" once decided

    def _grpc(self) -> gcgrpc.GCacheStub:
        if self._stub is None:
            limit = message_limit(self.max_object_bytes)
            self._channel = grpc.aio.insecure_channel(
                self.address,
                options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)],
            )
            self._stub = gcgrpc.GCacheStub(self._channel)
        return self._stub

    async def _rpc(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn()`` with every failure as ``L3Error``."""
        try:
            return await fn()
        except L3Error:
            raise
        except grpc.aio.AioRpcError as e:
            raise L3Error(f"gcache {self.address}: {op}: {e.code().name}: {e.details()}") from e
        except TimeoutError as e:
            raise L3Error(f"gcache {self.address}: {op}: no answer in {self.timeout_s} s") from e
        except Exception as e:
            ucx = sys.modules.get("services.gcache.ucx")
            if ucx is None or not isinstance(e, ucx.UcxTransportError):
                raise
            self._decided = False  # ask Info again next time: the node may have restarted
            raise L3Error(f"gcache {self.address}: {op} over UCX: {e}") from e

    async def info(self) -> pb.InfoReply:
        """The node's Info. Raises ``L3Error``."""
        return await self._rpc("info", lambda: self._grpc().Info(pb.InfoRequest(), timeout=self.timeout_s))

    async def _data(self) -> Any:
        """The UCX client to send data with, or None for gRPC."""
        if self.transport == "grpc":
            return None
        if not self._decided:
            port = (await self.info()).ucx_port
            usable = port != 0 and _ucx_module().available()
            if not usable and self.transport == "ucx":
                why = "the node has no UCX port" if port == 0 else "ucxx does not import here"
                raise L3Error(f"gcache {self.address}: UCX transport asked for, but {why}")
            if self._ucx is not None and (not usable or port != self._ucx_port):
                await self._close_ucx()
            if usable and self._ucx is None:
                host = self.address.rsplit(":", 1)[0].strip("[]")
                self._ucx = _ucx_module().UcxClient(host, port, timeout_s=self.timeout_s)
                self._ucx_port = port
            self._decided = True
            self.data_transport = "ucx" if usable else "grpc"
        return self._ucx

    async def _ucx_call(self, ucx: Any, op: int, meta: bytes, buffers: Sequence[bytes] = ()) -> Any:
        reply = await ucx.call(op, meta, buffers, timeout_s=self.timeout_s)
        if reply.status != 0:
            code = next((c.name for c in grpc.StatusCode if c.value[0] == reply.status), str(reply.status))
            raise L3Error(
                f"gcache {self.address}: op {op}: {code}: {bytes(reply.meta).decode(errors='replace')}"
            )
        return reply

    # -- L3Store ---------------------------------------------------------------------------------
    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        if not pids:
            return Found([], None)
        req = pb.LookupRequest(pages=_refs(pids))
        rep = await self._rpc("lookup", lambda: self._grpc().Lookup(req, timeout=self.timeout_s))
        if len(rep.present) != len(pids):
            raise L3Error(f"gcache {self.address}: lookup answered {len(rep.present)} of {len(pids)} pages")
        return Found(list(rep.present), rep.lease or None)

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        lease = found.lease if isinstance(found.lease, int) else 0
        if not pids:
            if lease:
                await self.release(lease)
            return []
        req = pb.GetRequest(pages=_refs(pids), lease=lease)
        return await self._rpc("get", lambda: self._get(req, len(pids)))

    async def _get(self, req: pb.GetRequest, n: int) -> list[Object | None]:
        out: list[Object | None] = [None] * n
        ucx = await self._data()
        if ucx is not None:
            reply = await self._ucx_call(ucx, OP_GET, req.SerializeToString())
            found = pb.GetReply.FromString(bytes(reply.meta)).found
            if len(found) != n or sum(found) != len(reply.buffers):
                raise L3Error(
                    f"gcache {self.address}: get answered {len(reply.buffers)} objects for {n} pages"
                )
            bufs = iter(reply.buffers)  # fresh arrays per reply: handed over without a copy
            return [next(bufs) if ok else None for ok in found]

        async def stream() -> None:
            async for chunk in self._grpc().Get(req, timeout=self.timeout_s):
                if not 0 <= chunk.i < n:
                    raise L3Error(f"gcache {self.address}: get answered page {chunk.i} of {n}")
                out[chunk.i] = chunk.object

        await stream()
        return out

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        if not pages:
            return []
        items = []
        for p in pages:
            it = pb.PutItem(
                page=pb.PageRef(key=p.pid[0], kind=p.pid[1]), parent=p.parent, index=p.index,
                size=len(p.obj), parent_elsewhere=p.parent_elsewhere,
            )  # fmt: skip
            if p.block is not None:
                it.has_block, it.block, it.block_depth = True, p.block.key, p.block.depth
                if p.block.parent is not None:
                    it.has_block_parent, it.block_parent = True, p.block.parent
            items.append(it)
        req = pb.PutStartRequest(items=items)
        rep = await self._rpc("put_start", lambda: self._grpc().PutStart(req, timeout=self.timeout_s))
        if len(rep.slots) != len(pages):
            raise L3Error(f"gcache {self.address}: put_start answered {len(rep.slots)} of {len(pages)} pages")
        out = [s.status == pb.PutSlot.EXISTS for s in rep.slots]
        send = [(i, s.reservation) for i, s in enumerate(rep.slots) if s.status == pb.PutSlot.RESERVED]
        if send:
            committed = await self._rpc("put_data", lambda: self._put_data(pages, send))
            if len(committed) != len(send):
                raise L3Error(f"gcache {self.address}: put_data answered {len(committed)} of {len(send)}")
            for (i, _), ok in zip(send, committed, strict=True):
                out[i] = ok
        return out

    async def _put_data(self, pages: Sequence[PutPage], send: list[tuple[int, int]]) -> list[bool]:
        ucx = await self._data()
        if ucx is not None:
            meta = pb.PutDataRequest(reservations=[r for _, r in send]).SerializeToString()
            reply = await self._ucx_call(ucx, OP_PUT, meta, [pages[i].obj for i, _ in send])
            return list(pb.PutDataReply.FromString(bytes(reply.meta)).committed)

        async def chunks() -> AsyncIterator[pb.PutChunk]:
            for i, r in send:
                yield pb.PutChunk(reservation=r, object=pages[i].obj)

        rep = await self._grpc().PutData(chunks(), timeout=self.timeout_s)
        return list(rep.committed)

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        if pids:
            req = pb.RemoveRequest(pages=_refs(pids))
            await self._rpc("remove", lambda: self._grpc().Remove(req, timeout=self.timeout_s))

    async def release(self, lease: int) -> None:
        req = pb.ReleaseRequest(lease=lease)
        await self._rpc("release", lambda: self._grpc().Release(req, timeout=self.timeout_s))

    async def drain(self) -> None:
        """Ask the node to refuse puts from now on. Raises ``L3Error``."""
        await self._rpc("drain", lambda: self._grpc().Drain(pb.Empty(), timeout=self.timeout_s))

    async def _close_ucx(self) -> None:
        ucx, self._ucx, self._ucx_port = self._ucx, None, 0
        if ucx is not None:
            with contextlib.suppress(Exception):
                await ucx.close()

    async def close(self) -> None:
        await self._close_ucx()
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class _NodeStore:
    """``L3Store`` of one registered node, resolved to its current address at each call."""

    def __init__(self, owner: RegistryL3, node_id: str) -> None:
        self.owner, self.node_id = owner, node_id

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        return await self.owner.client(self.node_id).lookup(pids)

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        return await self.owner.client(self.node_id).get(found, pids)

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        return await self.owner.client(self.node_id).put(pages)

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        await self.owner.client(self.node_id).remove(pids)

    async def close(self) -> None:
        return None


class RegistryL3:
    """``L3Store`` over the nodes registered in Redis (``registry``): ``ShardedL3`` over the live
    ones, re-read at most every ``cache_s`` seconds (a Redis failure keeps the last list).
    Args as ``GCacheClient``'s, plus redis_url and namespace."""

    def __init__(
        self, redis_url: str, namespace: str = "swaserve", transport: str = "auto", timeout_s: float = 5.0,
        cache_s: float = 1.0,
    ) -> None:  # fmt: skip
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.redis_url, self.namespace, self.cache_s = redis_url, namespace, cache_s
        self.transport, self.timeout_s = transport, timeout_s
        self.nodes: dict[str, str] = {}  # node id -> gRPC address
        self._read_at = -float("inf")
        self._clients: dict[str, GCacheClient] = {}  # by address
        self.sharded = ShardedL3(lambda: list(self.nodes), lambda node: _NodeStore(self, node))

    @property
    def node_errors(self) -> Counter[str]:
        """Failed node operations by kind (``ShardedL3.node_errors``)."""
        return self.sharded.node_errors

    def client(self, node_id: str) -> GCacheClient:
        """The client of a live node. Raises ``L3Error`` when it is not live any more."""
        addr = self.nodes.get(node_id)
        if addr is None:
            raise L3Error(f"gcache node {node_id} is not registered any more")
        c = self._clients.get(addr)
        if c is None:
            c = self._clients[addr] = GCacheClient(addr, self.transport, self.timeout_s)
        return c

    async def refresh(self, force: bool = False) -> dict[str, str]:
        """The live nodes (re-read from Redis when older than ``cache_s``)."""
        now = time.monotonic()
        if force or now - self._read_at >= self.cache_s:
            self._read_at = now
            with contextlib.suppress(L3Error):  # logged by live_nodes; the last list stays
                self.nodes = await asyncio.to_thread(registry.live_nodes, self.redis_url, self.namespace, 0.0)
        return self.nodes

    async def lookup(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> Found:
        await self.refresh()
        return await self.sharded.lookup(pids, places)

    async def get(
        self, found: Found, pids: Sequence[PageId], places: Sequence[bytes] | None = None
    ) -> list[Object | None]:
        await self.refresh()
        return await self.sharded.get(found, pids, places)

    async def put(self, pages: Sequence[PutPage]) -> list[bool]:
        await self.refresh()
        return await self.sharded.put(pages)

    async def remove(self, pids: Sequence[PageId], places: Sequence[bytes] | None = None) -> None:
        await self.refresh()
        await self.sharded.remove(pids, places)

    async def close(self) -> None:
        await self.sharded.close()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()


def sharded_client(
    redis_url: str, namespace: str = "swaserve", transport: str = "auto", timeout_s: float = 5.0
) -> RegistryL3:
    """The ``L3Store`` over every GCache node registered under ``namespace`` in ``redis_url``."""
    return RegistryL3(redis_url, namespace, transport, timeout_s)


def connect(url: str) -> L3Store:
    """The ``L3Store`` of a ``gcache://`` or ``redis://`` URL (module docstring). A ``?`` after
    the first separates parameters as ``&`` does: the Helm chart appends ours to a Redis URL from
    a Secret, which may carry its own (``rediss://...?ssl_cert_reqs=required``). Raises
    ValueError for another scheme, a bad transport or timeout."""
    base, sep, params = url.partition("?")
    if sep:
        url = f"{base}?{params.replace('?', '&')}"
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    transport = query.pop("transport", "auto")
    try:
        timeout_s = float(query.pop("timeout_s", "5"))
    except ValueError as e:
        raise ValueError(f"timeout_s in {url!r} is not a number") from e
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s in {url!r} must be a positive number of seconds")
    ns = query.pop("namespace", "swaserve") if parts.scheme in ("redis", "rediss") else None
    if parts.scheme == "gcache" and query:
        raise ValueError(f"unknown parameters {', '.join(sorted(query))} in {url!r} (transport, timeout_s)")
    if parts.scheme == "gcache":
        if not parts.netloc:
            raise ValueError(f"a gcache URL is gcache://HOST:PORT, got {url!r}")
        return GCacheClient(parts.netloc, transport, timeout_s)
    if ns is not None:  # rediss: Redis over TLS (redis-py); other parameters go to redis-py
        rest = urlunsplit(parts._replace(query=urlencode(query)))
        return sharded_client(rest, ns, transport, timeout_s)
    raise ValueError(f"GCache URLs are gcache://HOST:PORT or redis[s]://..., got {url!r}")
