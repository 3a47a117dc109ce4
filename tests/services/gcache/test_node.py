"""A GCache node in this process, over gRPC and over UCX: pages come back byte for byte, a second
put is a dedupe, clients run concurrently, a page removed between lookup and get is a miss,
bad requests are refused with a status and a message while the node keeps serving, drain refuses
puts only, and a corrupt NVMe slot is a counted miss."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import generate_latest

from services.gcache.client import GCacheClient, connect
from services.gcache.node import OP_GET, OP_PUT
from swaserve.gcache import codec
from swaserve.gcache.l3 import L3Error
from swaserve.gcache.l3 import connect as swaserve_connect
from swaserve.v1 import gcache_pb2 as pb
from swaserve.v1 import gcache_pb2_grpc as gcgrpc
from tests.services.gcache.helpers import chain, node, run, tokens, ucx_or_skip

TRANSPORTS = ["grpc", "ucx"]


def _skip(transport: str) -> None:
    if transport == "ucx":
        ucx_or_skip()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pages_come_back_byte_for_byte(transport: str) -> None:
    _skip(transport)

    async def go() -> None:
        async with node(ucx=transport == "ucx") as srv:
            c = GCacheClient(srv.address, transport, timeout_s=10.0)
            toks = tokens(48)
            full = chain(toks, payload=3000)
            swa = chain(toks, payload=1 << 20, kind=codec.SWA_KIND, seed=1)[-3:]  # a window of big pages
            pages = full + swa
            assert await c.put(pages) == [True] * len(pages)
            assert c.data_transport == transport
            pids = [p.pid for p in pages]
            found = await c.lookup(pids)
            assert found.present == [True] * len(pids) and found.lease
            got = await c.get(found, pids)
            assert got == [p.obj for p in pages]
            info = await c.info()
            assert (info.ucx_port != 0) == (transport == "ucx")
            assert {t.tier: t.pages for t in info.tiers} == {"dram": len(pages)}
            assert all(t.leased == 0 for t in info.tiers)  # the get ended the lease
            other = chain(tokens(8, seed=9))
            assert (await c.lookup([p.pid for p in other])).present == [False] * 2
            await c.close()

    run(go())


def test_a_second_put_is_a_dedupe() -> None:
    async def go() -> None:
        async with node() as srv:
            c = GCacheClient(srv.address, "grpc")
            pages = chain(tokens(24))
            assert await c.put(pages[:4]) == [True] * 4
            assert srv.node is not None
            written = srv.node.snapshot()[0][("bytes_written", "dram", "full")]
            assert await c.put(pages) == [True] * 6  # four already there, two new
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = gcgrpc.GCacheStub(ch)
                items = [
                    pb.PutItem(
                        page=pb.PageRef(key=p.pid[0], kind=0), parent=p.parent, index=p.index, size=len(p.obj)
                    )
                    for p in pages
                ]
                rep = await stub.PutStart(pb.PutStartRequest(items=items))
                assert [s.status for s in rep.slots] == [pb.PutSlot.EXISTS] * 6
            stats = srv.node.snapshot()[0]
            assert stats[("bytes_written", "dram", "full")] == written + 2 * len(pages[0].obj)
            await c.close()

    run(go())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_concurrent_clients(transport: str) -> None:
    _skip(transport)

    async def one(address: str, seed: int) -> None:
        c = GCacheClient(address, transport, timeout_s=20.0)
        pages = chain(tokens(40, seed=seed), payload=20_000, seed=seed)
        for _ in range(3):
            assert await c.put(pages) == [True] * len(pages)
            pids = [p.pid for p in pages]
            assert await c.get(await c.lookup(pids), pids) == [p.obj for p in pages]
        await c.close()

    async def go() -> None:
        async with node(ucx=transport == "ucx") as srv:
            await asyncio.gather(*(one(srv.address, s) for s in range(4)))

    run(go())


def test_a_page_removed_between_lookup_and_get_is_a_miss() -> None:
    """The lease keeps pages from eviction, not from a forced Remove (sglang#31108's race): the
    read reports what is there now; a removed page takes its descendants with it."""

    async def go() -> None:
        async with node() as srv:
            reader, admin = GCacheClient(srv.address, "grpc"), GCacheClient(srv.address, "grpc")
            pages = chain(tokens(32))
            other = chain(tokens(8, seed=5))
            assert await reader.put(pages + other) == [True] * 10
            pids = [p.pid for p in pages + other]
            found = await reader.lookup(pids)
            assert all(found.present)
            await admin.remove([pages[5].pid])
            got = await reader.get(found, pids)
            assert got[:5] == [p.obj for p in pages[:5]]
            assert got[5:8] == [None] * 3
            assert got[8:] == [p.obj for p in other]
            for c in (reader, admin):
                await c.close()

    run(go())


def test_bad_grpc_requests_are_refused_and_the_node_keeps_serving() -> None:
    async def go() -> None:
        async with node(max_object_bytes=1 << 20) as srv:
            pages = chain(tokens(8))
            key, parent = pages[1].pid[0], pages[1].parent
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = gcgrpc.GCacheStub(ch)

                async def refused(call: object, *words: str) -> None:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call  # type: ignore[misc]
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert all(w in (e.value.details() or "") for w in words), e.value.details()

                await refused(
                    stub.Lookup(pb.LookupRequest(pages=[pb.PageRef(key=b"short", kind=0)])), "16 bytes"
                )
                await refused(
                    stub.Lookup(pb.LookupRequest(pages=[pb.PageRef(key=key, kind=7)])), "unknown kind 7"
                )
                await refused(
                    stub.Lookup(pb.LookupRequest(pages=[pb.PageRef(key=key)], lease_s=-1)), "lease_s"
                )
                await refused(stub.Get(pb.GetRequest(pages=[pb.PageRef(key=b"", kind=1)])).read(), "16 bytes")
                await refused(stub.Remove(pb.RemoveRequest(pages=[pb.PageRef(key=key * 2)])), "16 bytes")
                big = pb.PutItem(page=pb.PageRef(key=key), parent=parent, index=1, size=(1 << 20) + 1)
                await refused(stub.PutStart(pb.PutStartRequest(items=[big])), "object size")
                zero = pb.PutItem(page=pb.PageRef(key=key), parent=parent, index=1, size=0)
                await refused(stub.PutStart(pb.PutStartRequest(items=[zero])), "object size")
                orphan = pb.PutItem(page=pb.PageRef(key=key), parent=b"x", index=1, size=10)
                await refused(stub.PutStart(pb.PutStartRequest(items=[orphan])), "parent key")
                many = pb.LookupRequest(pages=[pb.PageRef(key=key)] * 20_000)
                await refused(stub.Lookup(many), "at most")
                # an unknown reservation and a wrong object: refused per object, with the reason
                rep = await stub.PutData(iter([pb.PutChunk(reservation=12345, object=b"x" * 10)]))
                assert list(rep.committed) == [False] and "no reservation" in rep.errors[0]
                slot = await stub.PutStart(
                    pb.PutStartRequest(items=[pb.PutItem(page=pb.PageRef(key=pages[0].pid[0]), parent=pages[0].parent, size=len(pages[0].obj))])
                )  # fmt: skip
                rid = slot.slots[0].reservation
                rep = await stub.PutData(
                    iter([pb.PutChunk(reservation=rid, object=b"\0" * len(pages[0].obj))])
                )
                assert list(rep.committed) == [False] and "magic" in rep.errors[0]
            c = GCacheClient(srv.address, "grpc")
            assert await c.put(pages) == [True, True]
            pids = [p.pid for p in pages]
            assert await c.get(await c.lookup(pids), pids) == [p.obj for p in pages]
            await c.close()

    run(go())


def test_garbage_on_the_ucx_port_is_refused_and_the_node_keeps_serving() -> None:
    ucx_or_skip()
    from services.gcache.ucx import UcxClient

    async def go() -> None:
        async with node(ucx=True, max_object_bytes=1 << 20) as srv:
            assert srv.node is not None
            raw = UcxClient("127.0.0.1", srv.node.ucx_port, timeout_s=10.0)
            r = await raw.call(OP_GET, b"\xff\xfe garbage \x00\x01")
            assert r.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and bytes(r.meta)
            bad_key = pb.GetRequest(pages=[pb.PageRef(key=b"k", kind=0)]).SerializeToString()
            r = await raw.call(OP_GET, bad_key)
            assert r.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"16 bytes" in bytes(r.meta)
            r = await raw.call(OP_PUT, pb.PutDataRequest(reservations=[1, 2]).SerializeToString(), [b"x"])
            assert r.status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"reservations" in bytes(r.meta)
            r = await raw.call(99, b"")
            assert r.status == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"unknown op" in bytes(r.meta)
            # a buffer over --max-object-bytes is refused from its header, before it is received
            big = np.zeros(srv.opts.max_object_bytes + 1, np.uint8)
            r = await raw.call(OP_PUT, pb.PutDataRequest(reservations=[1]).SerializeToString(), [big])
            assert r.status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert f"at most {srv.opts.max_object_bytes}".encode() in bytes(r.meta)
            await raw.close()
            c = GCacheClient(srv.address, "ucx")
            pages = chain(tokens(16))
            assert await c.put(pages) == [True] * 4
            pids = [p.pid for p in pages]
            assert await c.get(await c.lookup(pids), pids) == [p.obj for p in pages]
            await c.close()

    run(go())


def test_a_put_stream_over_max_batch_is_refused_with_its_reason() -> None:
    """INVALID_ARGUMENT naming the limit, while the client is still writing, and the node keeps
    serving. (The status waits for the client's last object, as grpc/grpc#36066 turns one sent
    mid-write into INTERNAL; that race shows only across processes under load, ~1 in 100.)"""

    async def go() -> None:
        async with node(max_batch=4) as srv, grpc.aio.insecure_channel(srv.address) as ch:
            stub = gcgrpc.GCacheStub(ch)

            async def chunks() -> AsyncIterator[pb.PutChunk]:
                for i in range(40):
                    yield pb.PutChunk(reservation=i, object=b"x" * 4096)
                    await asyncio.sleep(0.005)  # still writing well after the refusal

            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.PutData(chunks())
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                assert "more than 4 objects in one PutData stream" in (e.value.details() or "")
            rep = await stub.PutData(iter([pb.PutChunk(reservation=12345, object=b"x")]))
            assert list(rep.committed) == [False]  # and it keeps serving

    run(go())


def test_drain_refuses_puts_and_serves_reads() -> None:
    async def go() -> None:
        async with node() as srv:
            c = GCacheClient(srv.address, "grpc")
            pages = chain(tokens(16))
            assert await c.put(pages[:2]) == [True, True]
            await c.drain()
            with pytest.raises(L3Error, match=r"UNAVAILABLE.*draining"):
                await c.put(pages[2:])
            pids = [p.pid for p in pages]
            found = await c.lookup(pids)
            assert found.present == [True, True, False, False]
            assert (await c.get(found, pids))[:2] == [p.obj for p in pages[:2]]
            assert (await c.info()).draining
            async with grpc.aio.insecure_channel(srv.address) as ch:
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
            assert h.status == health_pb2.HealthCheckResponse.NOT_SERVING
            await c.close()

    run(go())


def test_a_corrupt_nvme_slot_is_a_counted_miss(tmp_path: Path) -> None:
    async def go() -> None:
        async with node(dram=64 << 10, nvme_dir=tmp_path, nvme=8 << 20) as srv:
            c = connect(f"gcache://{srv.address}?transport=grpc&timeout_s=5")
            pages = chain(tokens(4 * 30), payload=4000)  # ~4 KiB each: most go down to NVMe
            assert await c.put(pages) == [True] * 30
            assert srv.node is not None
            usage = await srv.node.usage()
            assert usage["nvme"]["pages"] > 0
            victim = pages[-1]  # a leaf: removing it takes nothing else
            data = b"".join(f.read_bytes() for f in sorted(tmp_path.glob("class-*.slots")))
            assert victim.pid[0] in data, "the deepest page should have been demoted (coldest first)"
            f = next(f for f in tmp_path.glob("class-*.slots") if victim.pid[0] in f.read_bytes())
            at = f.read_bytes().index(victim.pid[0]) - 32 + codec.header_size(4) + 100  # in its payload
            with f.open("r+b") as fh:
                fh.seek(at)
                byte = fh.read(1)[0]
                fh.seek(at)
                fh.write(bytes([byte ^ 0xFF]))
            pids = [p.pid for p in pages]
            got = await c.get(await c.lookup(pids), pids)
            assert got[-1] is None and got[:-1] == [p.obj for p in pages[:-1]]
            text = generate_latest(srv.metrics.registry).decode()
            assert 'swaserve:gcache_corrupt_pages_total{kind="full",tier="nvme"} 1.0' in text
            assert 'swaserve:gcache_pages{tier="nvme"}' in text
            assert 'swaserve:gcache_op_seconds_count{op="get",transport="grpc"} 1.0' in text
            await c.close()

    run(go())


def test_drain_waits_for_open_reservations() -> None:
    """SIGTERM's drain: puts refused at once, the process stops only once the reservations given
    out are committed (or the shutdown timeout passes)."""

    async def go() -> None:
        async with node(shutdown_timeout_s=60.0) as srv:
            page = chain(tokens(4))[0]
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = gcgrpc.GCacheStub(ch)
                item = pb.PutItem(page=pb.PageRef(key=page.pid[0]), parent=page.parent, size=len(page.obj))
                rid = (await stub.PutStart(pb.PutStartRequest(items=[item]))).slots[0].reservation
                draining = asyncio.create_task(srv.drain())
                await asyncio.sleep(0.2)  # not a synchronisation: it must still wait after any delay
                assert not draining.done()
                rep = await stub.PutData(iter([pb.PutChunk(reservation=rid, object=page.obj)]))
                assert list(rep.committed) == [True]
                assert await draining

    run(go())


def test_l3_urls() -> None:
    async def go() -> None:
        c = connect("gcache://127.0.0.1:1?transport=grpc&timeout_s=0.5")
        assert isinstance(c, GCacheClient) and c.timeout_s == 0.5 and c.transport == "grpc"
        with pytest.raises(L3Error, match="UNAVAILABLE"):
            await c.lookup([chain(tokens(4))[0].pid])
        await c.close()
        r = connect("redis://127.0.0.1:1/3?namespace=ns1&transport=ucx")
        assert r.redis_url == "redis://127.0.0.1:1/3" and r.namespace == "ns1"  # type: ignore[attr-defined]
        t = swaserve_connect("rediss://:pw@127.0.0.1:1/0?namespace=ns2")  # through the entry points
        assert t.redis_url == "rediss://:pw@127.0.0.1:1/0" and t.namespace == "ns2"  # type: ignore[attr-defined]
        # the chart appends "?namespace=..&transport=.." to a Redis URL that may have a query
        u = connect("rediss://:pw@127.0.0.1:1/0?ssl_cert_reqs=required?namespace=ns3&transport=grpc")
        assert u.redis_url == "rediss://:pw@127.0.0.1:1/0?ssl_cert_reqs=required"  # type: ignore[attr-defined]
        assert u.namespace == "ns3" and u.transport == "grpc"  # type: ignore[attr-defined]
        for bad in ("http://x:1", "gcache://x:1?transport=tcp", "gcache://", "gcache://x:1?timeout_s=soon",
                    "gcache://x:1?timeout_s=-1", "gcache://x:1?timeout_s=nan", "gcache://x:1?bogus=1"):  # fmt: skip
            with pytest.raises(ValueError):
                connect(bad)

    run(go())


def test_views_are_pinned_until_sent_and_a_cancelled_get_releases_them() -> None:
    """UCX gets send DRAM pages as views, pinned by a lease: ``done`` ends it, and a get whose
    caller was cancelled (the peer left) ends it as soon as the read is over, not at expiry. A
    small all-DRAM get is read on the event loop (``run_inline``), an NVMe one on the store
    thread."""

    async def go() -> None:
        async with node() as srv:
            assert srv.node is not None
            c = GCacheClient(srv.address, "grpc")
            pages = chain(tokens(16))
            assert await c.put(pages) == [True] * 4
            pids = [p.pid for p in pages]

            async def leases() -> int:
                return await srv.node.run(lambda st: len(st.leases))  # type: ignore[union-attr]

            views, done = await srv.node.get_views(pids)
            assert [bytes(v) for v in views if v is not None] == [p.obj for p in pages]
            assert await leases() == 1
            done()
            for _ in range(100):
                if await leases() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await leases() == 0
            # the store busy (its lock held, as by a long NVMe read): the get goes to the store
            # thread and waits there; its caller is cancelled; the read then ends
            srv.node._lock.acquire()
            t = asyncio.ensure_future(srv.node.get_views(pids))
            await asyncio.sleep(0.05)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t
            srv.node._lock.release()
            for _ in range(100):
                if await leases() == 0:
                    break
                await asyncio.sleep(0.01)
            assert await leases() == 0
            await c.close()

    run(go())


def test_small_dram_gets_are_read_inline_and_nvme_ones_on_the_store_thread(tmp_path: Path) -> None:
    async def go() -> None:
        async with node(dram=1 << 20, nvme_dir=tmp_path, nvme=4 << 20) as srv:
            assert srv.node is not None
            c = GCacheClient(srv.address, "grpc")
            pages = chain(tokens(16))
            assert await c.put(pages) == [True] * 4
            pids = [p.pid for p in pages]
            calls = []
            real = srv.node._call

            async def counted(fn, *args):  # type: ignore[no-untyped-def]
                calls.append(fn)
                return await real(fn, *args)

            srv.node._call = counted  # type: ignore[method-assign]
            views, done = await srv.node.get_views(pids)
            assert [bytes(v) for v in views if v is not None] == [p.obj for p in pages] and not calls
            done()
            await srv.node.run(lambda st: [st._move(st.index[p], st.nvme) for p in pids[:1]])
            calls.clear()
            views, done = await srv.node.get_views(pids)
            assert [bytes(v) for v in views if v is not None] == [p.obj for p in pages] and calls
            done()
            await c.close()

    run(go())
