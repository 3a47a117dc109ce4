"""The ``GCache`` gRPC service of a node (``GCacheServicer``) and its server (``start_grpc``:
the service, ``grpc.health.v1``, reflection).

Requests are checked before they reach the store (``node.check_pages`` / ``check_items``: 16-byte
keys, kinds 0/1, sizes in ``(0, max_object_bytes]``, at most ``max_batch`` pages): a bad one is
INVALID_ARGUMENT with a message; PutStart while draining is UNAVAILABLE. Get streams one
``GetChunk`` per found page; PutData takes a stream of ``PutChunk`` and commits them in groups."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.gcache.node import BadRequest, GCacheNode, Unavailable, check_items, check_pages
from swaserve.v1 import gcache_pb2 as pb
from swaserve.v1 import gcache_pb2_grpc as gcgrpc

T = TypeVar("T")
SERVICE = pb.DESCRIPTOR.services_by_name["GCache"].full_name
COMMIT_GROUP_BYTES = 16 << 20  # PutData commits once this much arrived (or the stream ended)
COMMIT_GROUP_OBJECTS = 64


class GCacheServicer(gcgrpc.GCacheServicer):
    """The GCache service over ``node``."""

    def __init__(self, node: GCacheNode) -> None:
        self.node = node

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
        await context.abort(code, msg)
        raise AssertionError("unreachable: abort raises")

    async def _call(self, op: str, context: grpc.aio.ServicerContext, fn: Callable[[], Awaitable[T]]) -> T:
        t0 = time.perf_counter()
        try:
            return await fn()
        except BadRequest as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Unavailable as e:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, str(e))
        except OSError as e:  # the node's disk or memory failed this call; the node goes on
            await self._abort(context, grpc.StatusCode.INTERNAL, f"GCache node I/O error: {e}")
        finally:
            self.node.observe(op, "grpc", time.perf_counter() - t0)

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoReply:
        usage = await self._call("info", context, self.node.usage)
        tiers = [
            pb.TierUsage(
                tier=name, capacity=u["capacity"], used=u["used"], pages=u["pages"], leased=u["leased"]
            )
            for name, u in usage.items()
        ]
        n = self.node
        return pb.InfoReply(
            node_id=n.node_id, ucx_port=n.ucx_port, tiers=tiers, draining=n.draining, direct_io=n.direct_io
        )

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupReply:
        async def run() -> pb.LookupReply:
            present, lease = await self.node.lookup(
                check_pages(request.pages, self.node.limits), request.lease_s
            )
            return pb.LookupReply(present=present, lease=lease)

        return await self._call("lookup", context, run)

    async def Release(self, request: pb.ReleaseRequest, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self._call("release", context, lambda: self.node.release(request.lease))
        return pb.Empty()

    async def PutStart(
        self, request: pb.PutStartRequest, context: grpc.aio.ServicerContext
    ) -> pb.PutStartReply:
        async def run() -> pb.PutStartReply:
            slots = await self.node.put_start(check_items(request.items, self.node.limits))
            return pb.PutStartReply(slots=[pb.PutSlot(status=s, reservation=r) for s, r in slots])

        return await self._call("put_start", context, run)

    async def PutData(
        self, request_iterator: AsyncIterator[pb.PutChunk], context: grpc.aio.ServicerContext
    ) -> pb.PutDataReply:
        limits = self.node.limits

        async def run() -> pb.PutDataReply:
            reply, group, size, n = pb.PutDataReply(), list[tuple[int, bytes]](), 0, 0

            async def flush() -> None:
                for ok, why in await self.node.put_data(group):
                    reply.committed.append(ok)
                    reply.errors.append(why)
                group.clear()

            failed: Exception | None = None
            async for chunk in request_iterator:
                if failed is not None:
                    continue  # refused: the rest is read and dropped, the status sent after it
                n += 1
                try:
                    if n > limits.max_batch:
                        raise BadRequest(f"more than {limits.max_batch} objects in one PutData stream")
                    group.append((chunk.reservation, chunk.object))
                    size += len(chunk.object)
                    if size >= COMMIT_GROUP_BYTES or len(group) >= COMMIT_GROUP_OBJECTS:
                        await flush()
                        size = 0
                except Exception as e:
                    failed = e
            if failed is not None:
                # a status sent while a grpc.aio client is still writing reaches it as INTERNAL
                # ("Internal error from Core", grpc/grpc#36066), so it goes after its last message
                raise failed
            await flush()
            return reply

        return await self._call("put_data", context, run)

    async def Get(
        self, request: pb.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GetChunk]:
        async def run() -> list[bytes | None]:
            return await self.node.get(check_pages(request.pages, self.node.limits), request.lease)

        for i, obj in enumerate(await self._call("get", context, run)):
            if obj is not None:
                yield pb.GetChunk(i=i, object=obj)

    async def Remove(self, request: pb.RemoveRequest, context: grpc.aio.ServicerContext) -> pb.RemoveReply:
        async def run() -> pb.RemoveReply:
            return pb.RemoveReply(
                removed=await self.node.remove(check_pages(request.pages, self.node.limits))
            )

        return await self._call("remove", context, run)

    async def Drain(self, request: pb.Empty, context: grpc.aio.ServicerContext) -> pb.Empty:
        await self.node.drain()
        return pb.Empty()


@dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE):
            await self.health.set(name, status)


def message_limit(max_object_bytes: int) -> int:
    """gRPC message size limit for a node taking objects up to ``max_object_bytes``."""
    return max_object_bytes + (1 << 20)


async def start_grpc(node: GCacheNode, host: str, port: int) -> GrpcServer:
    """Serve ``node`` on ``host:port`` (0: a free port): GCache, health (NOT_SERVING until
    ``set_serving(True)``), reflection. Raises RuntimeError when the port cannot be bound."""
    limit = message_limit(node.limits.max_object_bytes)
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    )
    gcgrpc.add_GCacheServicer_to_server(GCacheServicer(node), server)
    health_svc = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_svc, server)
    reflection.enable_server_reflection([SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    out = GrpcServer(server, bound, health_svc)
    await out.set_serving(False)
    await server.start()
    return out
