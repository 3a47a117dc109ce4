"""The UCX data plane (services/gcache/ucx.py) against real nodes on 127.0.0.1: pages of 64 KiB to
4 MiB come back byte for byte (into the caller's buffers when given), bad frames are refused with
a reply while the server keeps serving, a stopped node costs the deadline and a killed one fails
fast (``UcxTransportError`` both), the client reconnects after a restart (or falls back to gRPC
when the node comes back without UCX), and a process that leaves a client open still exits."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import types
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from services.gcache.client import GCacheClient
from services.gcache.node import OP_GET
from swaserve.gcache import codec
from swaserve.gcache.l3 import L3Error, PutPage
from swaserve.procs import free_port
from swaserve.v1 import gcache_pb2 as pb
from tests.services.gcache.helpers import chain, node, run, run_script, tokens, ucx_or_skip
from tests.services.gcache.test_node_process import gcache_node

SLACK_S = 3.0  # a busy 2-core machine: scheduling on top of a deadline
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(autouse=True)
def _ucx() -> None:
    ucx_or_skip()


def _get_meta(pages: list[PutPage]) -> bytes:
    return pb.GetRequest(pages=[pb.PageRef(key=p.pid[0], kind=p.pid[1]) for p in pages]).SerializeToString()


def _pages(payload: int, n: int, seed: int) -> list[PutPage]:
    return chain(tokens(4 * n, seed=seed), payload=payload, kind=codec.SWA_KIND, seed=seed)


def test_pages_of_64k_to_4m_round_trip_byte_for_byte() -> None:
    from services.gcache.ucx import UcxClient

    async def go() -> None:
        async with node(ucx=True, dram=96 << 20) as srv:
            assert srv.node is not None and srv.node.ucx_port
            c = GCacheClient(srv.address, "ucx", timeout_s=20.0)
            raw = UcxClient("127.0.0.1", srv.node.ucx_port, timeout_s=20.0)
            for i, size in enumerate((64 << 10, 1 << 20, 4 << 20)):
                pages = _pages(size, 4, seed=i)
                assert await c.put(pages) == [True] * 4
                assert c.data_transport == "ucx"
                pids = [p.pid for p in pages]
                assert await c.get(await c.lookup(pids), pids) == [p.obj for p in pages]
                # straight OP_GET into buffers of ours: the reply's buffers are views of them
                into = [np.zeros(len(p.obj) + 100, np.uint8) for p in pages]
                r = await raw.call(OP_GET, _get_meta(pages), into=into)
                assert r.status == 0 and list(pb.GetReply.FromString(bytes(r.meta)).found) == [True] * 4
                for p, buf, got in zip(pages, into, r.buffers, strict=True):
                    assert bytes(got) == p.obj and np.shares_memory(np.asarray(got), buf)
                # one page of 64 KiB: a packed reply (the page in the head message), copied into ours
                if size == 64 << 10:
                    mine = [np.zeros(len(pages[0].obj), np.uint8)]
                    r = await raw.call(OP_GET, _get_meta(pages[:1]), into=mine)
                    assert bytes(r.buffers[0]) == pages[0].obj and np.shares_memory(
                        np.asarray(r.buffers[0]), mine[0]
                    )
                # too small a receive buffer is not written past: the page lands in a new one
                small = [np.zeros(10, np.uint8)]
                r = await raw.call(OP_GET, _get_meta(pages[:1]), into=small)
                assert bytes(r.buffers[0]) == pages[0].obj and not small[0].any()
            # concurrent calls share the one endpoint
            pages = _pages(1 << 20, 4, seed=7)
            assert await c.put(pages) == [True] * 4
            outs = await asyncio.gather(*(raw.call(OP_GET, _get_meta([p])) for p in pages))
            assert [bytes(r.buffers[0]) for r in outs] == [p.obj for p in pages]
            assert raw.connects == 1
            await raw.close()
            await c.close()

    run(go())


def test_bad_frames_are_refused_and_the_server_keeps_serving() -> None:
    import ucxx

    from services.gcache.ucx import UcxClient, UcxServer
    from services.gcache.ucx_wire import (
        HEADER,
        INLINE_BYTES,
        MAGIC,
        OP_REFUSED,
        VERSION,
        message_tag,
        pack_header,
        parse_header,
    )

    async def refused(port: int, head: bytes, rid: int) -> str:
        """Send ``head`` alone; the refusal's message. The server then hangs up."""
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        try:
            await ep.send(head)
            raw = bytearray(INLINE_BYTES)
            await asyncio.wait_for(ep.recv(raw, tag=message_tag(rid, 0)), 10)
            f = parse_header(raw)
            assert (f.op, f.status, f.rid, f.nbuf, f.inline) == (OP_REFUSED, INVALID, rid, 0, True)
            return raw[HEADER.size : HEADER.size + f.meta_len].decode()
        finally:
            ep.abort()

    async def go() -> None:
        async with node(ucx=True) as srv:
            assert srv.node is not None
            # limits of our own on a second server in front of the same node
            server = UcxServer(srv.node.handle_ucx, port=0, max_meta_bytes=1024, max_buffer_bytes=1 << 20)
            await server.start()
            port = server.port
            assert "bad magic" in await refused(port, HEADER.pack(b"XXXX", VERSION, OP_GET, 0, 5, 0, 0), 5)
            assert "version" in await refused(port, HEADER.pack(MAGIC, 9, OP_GET, 0, 6, 0, 0), 6)
            assert "meta of 4096 bytes" in await refused(port, pack_header(OP_GET, 0, 7, 4096, 0), 7)
            assert "protocol version 0" in await refused(port, MAGIC, 0)  # a short head: zeros after it
            # a head larger than any head: the connection ends, nothing else
            ep = await ucxx.create_endpoint("127.0.0.1", port)
            await ep.send(bytes(INLINE_BYTES + 1))
            await asyncio.sleep(0.2)
            ep.abort()
            # a buffer over the limit: the client gets the refusal, then reconnects
            c = UcxClient("127.0.0.1", port, timeout_s=10.0)
            r = await c.call(OP_GET, b"", [np.zeros((1 << 20) + 1, np.uint8)])
            assert r.status == INVALID and b"at most 1048576" in bytes(r.meta) and not c.connected
            pages = chain(tokens(16))
            g = GCacheClient(srv.address, "ucx")
            assert await g.put(pages) == [True] * 4
            r = await c.call(OP_GET, _get_meta(pages))
            assert r.status == 0 and [bytes(b) for b in r.buffers] == [p.obj for p in pages]
            assert c.connects == 2 and server.refused == 5
            await c.close()
            await g.close()
            await server.stop()
            await server.stop()  # idempotent

    run(go())


@pytest.mark.cluster
def test_a_stopped_node_costs_the_deadline_a_killed_one_fails_fast_and_a_restart_reconnects() -> None:
    from services.gcache.ucx import UcxClient, UcxTransportError

    port, ucx_port = free_port(), free_port()
    args = ("--ucx-port", str(ucx_port), "--dram", "96MiB")
    pages = _pages(4 << 20, 8, seed=3)
    meta = _get_meta(pages)

    async def fill(addr: str) -> None:
        g = GCacheClient(addr, "ucx", timeout_s=20.0)
        assert await g.put(pages) == [True] * len(pages)
        await g.close()

    async def deadline(proc: Any, c: UcxClient) -> None:
        r = await c.call(OP_GET, meta)
        assert [bytes(b) for b in r.buffers] == [p.obj for p in pages]
        # stopped before the call (a call that starts first may well finish within any sleep
        # here: a stop mid-transfer is the killed case's, and the cluster tests')
        proc.kill(signal.SIGSTOP)
        t0 = time.monotonic()
        fetch = asyncio.create_task(c.call(OP_GET, meta, timeout_s=1.5))
        try:
            with pytest.raises(UcxTransportError, match=r"no reply within 1\.5 s"):
                await fetch
            assert time.monotonic() - t0 < 1.5 + SLACK_S
        finally:
            proc.kill(signal.SIGCONT)
        r = await c.call(OP_GET, meta)  # the node is back: a new endpoint
        assert [bytes(b) for b in r.buffers] == [p.obj for p in pages] and c.connects == 2

    async def killed(proc: Any, c: UcxClient) -> None:
        proc.kill(signal.SIGSTOP)
        fetch = asyncio.create_task(c.call(OP_GET, meta, timeout_s=60.0))
        await asyncio.sleep(0.3)
        proc.kill(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(UcxTransportError):
            await fetch
        assert time.monotonic() - t0 < SLACK_S  # far from its 60 s deadline
        t0 = time.monotonic()
        with pytest.raises(UcxTransportError):
            await c.call(OP_GET, meta, timeout_s=1.5)  # nobody listens
        assert time.monotonic() - t0 < 1.5 + SLACK_S

    async def first(proc: Any, addr: str) -> UcxClient:
        await fill(addr)
        c = UcxClient("127.0.0.1", ucx_port, timeout_s=20.0)
        await deadline(proc, c)
        await killed(proc, c)
        return c

    async def again(addr: str, c: UcxClient) -> None:
        r = await c.call(OP_GET, meta)  # the same client, the same port: it reconnects
        assert r.status == 0 and not any(pb.GetReply.FromString(bytes(r.meta)).found)
        await fill(addr)
        r = await c.call(OP_GET, meta)
        assert [bytes(b) for b in r.buffers] == [p.obj for p in pages]
        await c.close()

    loop = asyncio.new_event_loop()  # one loop for the client across the node's lives
    try:
        with gcache_node("gcache-ucx", *args, port=port) as (proc, addr):
            c = loop.run_until_complete(first(proc, addr))
        with gcache_node("gcache-ucx-2", *args, port=port) as (proc, addr):
            loop.run_until_complete(again(addr, c))
    finally:
        loop.close()


@pytest.mark.cluster
def test_the_client_falls_back_to_grpc_when_the_node_returns_without_ucx() -> None:
    port = free_port()
    pages = chain(tokens(32), payload=64 << 10)
    pids = [p.pid for p in pages]
    loop = asyncio.new_event_loop()
    c = GCacheClient(f"127.0.0.1:{port}", "auto", timeout_s=5.0)
    try:
        with gcache_node("gcache-ucx", "--ucx-port", "0", port=port) as (proc, _):
            assert loop.run_until_complete(c.put(pages)) == [True] * 8
            assert c.data_transport == "ucx"
            proc.kill(signal.SIGKILL)
            with pytest.raises(L3Error):
                loop.run_until_complete(c.get(loop.run_until_complete(c.lookup(pids)), pids))
        with gcache_node("gcache-grpc", "--ucx-port", "-1", port=port):
            # gRPC: the new node has nothing. The channel may still be backing off from the dead
            # node (calls fail fast, UNAVAILABLE: a miss to the engine) until it reconnects.
            deadline = time.monotonic() + 20
            while True:
                try:
                    found = loop.run_until_complete(c.lookup(pids))
                    break
                except L3Error:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert not any(found.present)
            with pytest.raises(L3Error):  # the UCX endpoint is dead: this call fails, the next asks Info
                loop.run_until_complete(c.get(found, pids))
            assert loop.run_until_complete(c.put(pages)) == [True] * 8
            assert c.data_transport == "grpc"
            got = loop.run_until_complete(c.get(loop.run_until_complete(c.lookup(pids)), pids))
            assert got == [p.obj for p in pages]
    finally:
        loop.run_until_complete(c.close())
        loop.close()


EXITS = """
import asyncio
from services.gcache.client import GCacheClient
from tests.services.gcache.helpers import chain, node, tokens

async def go():
    async with node(ucx=True) as srv:
        c = GCacheClient(srv.address, "ucx")
        assert await c.put(chain(tokens(8))) == [True, True]
        # neither c nor its UCX endpoint is closed: ucxx's threads must not keep the process alive

asyncio.run(go())
print("done", flush=True)
"""


@pytest.mark.cluster
def test_a_process_that_leaves_a_client_open_exits() -> None:
    run_script(EXITS)


@pytest.mark.cluster
def test_ucx_perftest_baseline_runs_and_a_missing_binary_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.ucx_perftest import PerftestMissing, run_perftest

    rows = run_perftest([64 << 10, 1 << 20], budget_bytes=16 << 20)
    assert [r["size_bytes"] for r in rows] == [64 << 10, 1 << 20]
    assert all(r["mb_per_s"] > 0 and r["iterations"] >= 20 and r["lat_avg_us"] > 0 for r in rows)
    fake = types.ModuleType("libucx")
    fake.__file__ = str(tmp_path / "libucx" / "__init__.py")  # a wheel without its binaries
    monkeypatch.setitem(sys.modules, "libucx", fake)
    with pytest.raises(PerftestMissing, match="no executable ucx_perftest"):
        run_perftest([1 << 20])


def test_ucx_perftest_env_is_ucx_defaults_plus_what_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.ucx_perftest import _env

    monkeypatch.setenv("UCX_RNDV_SCHEME", "get_zcopy")  # set by this process's own ucxx, say
    env = _env(Path("/lib/ucx"), "tcp,self")
    assert "UCX_RNDV_SCHEME" not in env and env["UCX_TLS"] == "tcp,self"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == "/lib/ucx"
    env = _env(Path("/lib/ucx"), "tcp", {"UCX_RNDV_SCHEME": "put_zcopy", "UCX_TLS": "shm"})
    assert env["UCX_RNDV_SCHEME"] == "put_zcopy" and env["UCX_TLS"] == "tcp"


class _Wire:
    """An endpoint stand-in: ``send`` records (tag, bytes); ``recv`` is never needed by a packed
    reply."""

    def __init__(self) -> None:
        self.sent: list[tuple[int | None, bytes]] = []

    async def send(self, buf: Any, tag: int | None = None) -> None:
        self.sent.append((tag, bytes(buf)))

    async def recv(self, buf: Any, tag: int | None = None) -> None:
        raise AssertionError("a packed reply needs no further receive")


def test_small_replies_are_packed_in_one_message_and_checked() -> None:
    from services.gcache.ucx_wire import (
        HEADER,
        PACKED,
        REPLY_HEAD_BYTES,
        FrameError,
        _recv_rest,
        _send,
        message_tag,
        parse_header,
    )

    async def go() -> None:
        bufs = [memoryview(bytes(range(256)) * 40), memoryview(b""), memoryview(b"xyz")]
        w = _Wire()
        await _send(w, OP_GET, 0, 9, b"meta", bufs, False)
        [(tag, msg)] = w.sent  # header, tail and buffers: one message on the reply's tag
        assert tag == message_tag(9, 0) and msg[5] == OP_GET | PACKED
        f = parse_header(msg)
        assert (f.op, f.packed, f.inline, f.nbuf) == (OP_GET, True, True, 3)
        head = np.zeros(REPLY_HEAD_BYTES, np.uint8)
        head[: len(msg)] = np.frombuffer(msg, np.uint8)
        meta, got = await _recv_rest(w, f, head.data, 1 << 20, 1 << 20)
        assert meta == b"meta" and [bytes(g) for g in got] == [bytes(b) for b in bufs]
        # a head too short for what its tail announces is refused, not read past
        with pytest.raises(FrameError, match="packed reply"):
            await _recv_rest(w, f, head.data[: len(msg) - 1], 1 << 20, 1 << 20)
        # requests and large replies are never packed
        w = _Wire()
        await _send(w, OP_GET, 0, 10, b"m", bufs, True)
        assert len(w.sent) == 3 and not parse_header(w.sent[0][1]).packed  # head, 2 non-empty buffers
        w = _Wire()
        big = [memoryview(bytes(REPLY_HEAD_BYTES))]
        await _send(w, OP_GET, 0, 11, b"m", big, False)
        assert len(w.sent) == 2 and not parse_header(w.sent[0][1]).packed
        assert len(w.sent[0][1]) == HEADER.size + 1 + 8

    run(go())
