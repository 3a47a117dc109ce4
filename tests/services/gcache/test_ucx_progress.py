"""UCX progress by the event loop (services/gcache/ucx_ep.py): calls of every size complete
(many at once on one endpoint), an idle connection does not busy-poll a core (ucxx's own
``polling`` and ``blocking`` modes do: about one CPU second per second), the loop's reader goes
away with the last user and a later loop starts again, and a ucxx context made by someone else
(ucxx's default thread mode) is used with ucxx's own waits."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from services.gcache.ucx_wire import Reply
from swaserve.procs import free_port
from tests.services.gcache.helpers import run, run_script, ucx_or_skip
from tests.services.gcache.test_node_process import gcache_node

IDLE_S = 1.0
IDLE_CPU_MAX_S = 0.4  # busy-polling costs ~IDLE_S; the loop's own ticks cost ~0.01-0.05 s
CYCLES = 20
DEADLINE_S = 2.0


@pytest.fixture(autouse=True)
def _ucx() -> None:
    ucx_or_skip()


async def _echo(op: int, meta: bytes, bufs: list[memoryview]) -> Reply:
    return Reply(0, meta, [bytes(b)[::-1] for b in bufs])


async def _pair() -> tuple[object, object]:
    from services.gcache.ucx import UcxClient, UcxServer

    server = UcxServer(_echo, port=0)
    await server.start()
    return server, UcxClient("127.0.0.1", server.port, timeout_s=10.0)


def test_calls_of_every_size_complete_many_at_once_and_an_idle_connection_costs_no_cpu() -> None:
    from services.gcache import ucx

    async def go() -> None:
        server, client = await _pair()
        try:
            rng = np.random.default_rng(0)
            sizes = [0, 1, 100, 4096, 65536, 300_000, 1 << 20, 4 << 20] * 4
            bufs = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]

            async def one(i: int, b: bytes) -> None:
                r = await client.call(7, f"m{i}".encode(), [b])  # type: ignore[attr-defined]
                assert r.status == 0 and bytes(r.meta) == f"m{i}".encode()
                assert bytes(r.buffers[0]) == b[::-1] if b else not r.buffers[0]

            await asyncio.gather(*(one(i, b) for i, b in enumerate(bufs)))
            for i, b in enumerate(bufs[:8]):  # and one after another
                await one(i, b)
            assert ucx._RUNTIME.progress is not None and not ucx._RUNTIME.progress.closed

            t0 = time.process_time()
            await asyncio.sleep(IDLE_S)  # a connection, the server's receive posted, nothing sent
            idle_cpu = time.process_time() - t0
            assert idle_cpu < IDLE_CPU_MAX_S, f"{idle_cpu:.2f} CPU s in {IDLE_S} s idle: busy-polling"
            await one(99, b"after the idle spell")
        finally:
            await client.close()  # type: ignore[attr-defined]
            await server.stop()  # type: ignore[attr-defined]

    run(go())


@pytest.mark.cluster
def test_the_context_stays_for_its_loop_without_leaking_and_a_new_loop_starts_again() -> None:
    """A client, the process's only UCX user, that drops its endpoint (close, a deadline, a dead
    peer) reconnects on the same context: no teardown per drop (one cost 0.1-0.3 s and leaked
    the old worker's descriptors). A later loop gets a new context and progress."""
    from services.gcache import ucx
    from services.gcache.node import OP_GET
    from services.gcache.ucx import UcxClient

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with gcache_node("gcache-reuse", "--ucx-port", str(ucx_port := free_port()), "--dram", "32MiB"):

        async def go() -> object:
            client = UcxClient("127.0.0.1", ucx_port, timeout_s=10.0)
            assert (await client.call(OP_GET)).status == 0  # no pages asked: an empty reply
            progress = ucx._RUNTIME.progress
            assert progress is not None
            await client.close()
            before = fds()
            for _ in range(CYCLES):  # connect, call, drop
                assert (await client.call(OP_GET)).status == 0
                await client.close()
            assert client.connects == CYCLES + 1
            assert ucx._RUNTIME.progress is progress and not progress.closed
            grown = fds() - before
            assert grown < CYCLES // 2, f"{grown} descriptors more after {CYCLES} reconnects"
            return progress

        first = run(go())
        second = run(go())  # a new loop: the old context torn down, a new one made
        assert first is not second and first.closed  # type: ignore[attr-defined]


@pytest.mark.cluster
def test_a_call_that_fails_with_its_endpoint_gets_a_transport_error_not_a_cancellation() -> None:
    """A sibling call's deadline drops the shared endpoint: the others fail with
    ``UcxTransportError`` (nobody cancelled them), and the client reconnects after."""
    from services.gcache.node import OP_GET
    from services.gcache.ucx import UcxClient, UcxTransportError

    with gcache_node("gcache-sibling", "--ucx-port", str(ucx_port := free_port()), "--dram", "32MiB") as (
        proc,
        _,
    ):

        async def go() -> None:
            client = UcxClient("127.0.0.1", ucx_port, timeout_s=10.0)
            assert (await client.call(OP_GET)).status == 0
            proc.kill(signal.SIGSTOP)
            try:
                short = asyncio.create_task(client.call(OP_GET, timeout_s=0.3))
                others = [asyncio.create_task(client.call(OP_GET)) for _ in range(4)]
                got = await asyncio.gather(short, *others, return_exceptions=True)
            finally:
                proc.kill(signal.SIGCONT)
            assert all(isinstance(g, UcxTransportError) for g in got), got
            assert "no reply within 0.3 s" in str(got[0])
            assert (await client.call(OP_GET)).status == 0
            await client.close()

        run(go())


FOREIGN = """
import asyncio, ucxx
from services.gcache.ucx import UcxClient, UcxServer, _RUNTIME
from services.gcache.ucx_ep import LoopProgress
from services.gcache.ucx_wire import Reply
from swaserve.procs import free_port

async def echo(op, meta, bufs):
    return Reply(0, meta, [bytes(b) for b in bufs])

async def go():
    ucxx.init(progress_mode="thread", enable_python_future=True)  # someone else's context
    server = UcxServer(echo, port=0)
    await server.start()
    client = UcxClient("127.0.0.1", server.port, timeout_s=10.0)
    for n in (10, 1 << 20):
        r = await client.call(5, b"m", [bytes(n)])
        assert bytes(r.buffers[0]) == bytes(n)
    assert _RUNTIME.progress is None and not isinstance(
        ucxx._lib_async.application_context.ProgressTasks.get(asyncio.get_running_loop()), LoopProgress)
    await client.close()
    await server.stop()

asyncio.run(go())
print("done", flush=True)
"""


@pytest.mark.cluster
def test_a_context_made_elsewhere_in_the_process_is_used_with_its_own_waits() -> None:
    run_script(FOREIGN)


@pytest.mark.cluster
def test_connecting_to_a_stopped_node_waits_without_spinning_a_core() -> None:
    """The connection handshake is awaited through the loop's progress: ucxx's own polls
    ``asyncio.sleep(0)`` in a loop (a whole core for the deadline, or ucxx's 5 s connect
    timeout), and freed its receive buffer while UCX could still write into it."""
    from services.gcache.ucx import UcxClient, UcxServer, UcxTransportError

    with gcache_node("gcache-stopped", "--ucx-port", str(ucx_port := free_port()), "--dram", "32MiB") as (
        proc,
        _,
    ):

        async def go() -> None:
            here = UcxServer(_echo, port=0)
            await here.start()  # this loop's ucxx context made here, outside the measure
            c = UcxClient("127.0.0.1", ucx_port, timeout_s=DEADLINE_S)
            proc.kill(signal.SIGSTOP)
            try:
                t0 = time.process_time()
                with pytest.raises(UcxTransportError, match="no connection within"):
                    await c.call(1, b"x")
                spent = time.process_time() - t0
            finally:
                proc.kill(signal.SIGCONT)
            assert spent < DEADLINE_S / 3, f"{spent:.2f} CPU s in a {DEADLINE_S} s connect: busy-polling"
            await c.close()
            await here.stop()

        run(go())


class _Req:
    """A ucxx request as LoopProgress sees it: ``completed``, ``check_error``."""

    def __init__(self, completed: bool = False, error: Exception | None = None) -> None:
        self.completed, self.error = completed, error

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Worker:
    """A ucxx worker as LoopProgress drives it: an epoll fd (a pipe's read end), progress, arm."""

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        self.epoll_file_descriptor = self.r
        self.progressed = 0

    def init_blocking_progress_mode(self) -> None:
        pass

    def progress(self) -> None:
        self.progressed += 1

    def arm(self) -> bool:
        return True


def test_a_request_future_holds_its_buffer_until_ucx_completes_the_request_even_when_cancelled() -> None:
    import gc
    import weakref

    from services.gcache.ucx_ep import LoopProgress

    class Buf(bytearray):
        pass

    async def go() -> None:
        worker = _Worker()
        lp = LoopProgress(worker, asyncio.get_running_loop())
        try:
            done_at_post = lp.watch(_Req(completed=True), Buf(8))
            assert done_at_post.done() and done_at_post.result() is None
            failed = lp.watch(_Req(completed=True, error=ConnectionResetError("peer gone")))
            with pytest.raises(ConnectionResetError, match="peer gone"):
                failed.result()

            req, buf = _Req(), Buf(8)
            ref = weakref.ref(buf)
            fut = lp.watch(req, buf)
            del buf
            fut.cancel()  # the waiter leaves; UCX still owns the buffer
            for _ in range(3):
                await asyncio.sleep(0)
            gc.collect()
            assert ref() is not None and worker.progressed >= 1
            req.completed = True  # UCX completes it (an abort cancels it): the buffer goes
            lp.kick()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
            gc.collect()
            assert ref() is None and not lp._waiting

            late = _Req()
            pending = lp.watch(late, Buf(8))
            late.error, late.completed = ConnectionAbortedError("aborted"), True
            with pytest.raises(ConnectionAbortedError):
                await asyncio.wait_for(pending, 1.0)  # no event on the fd: the kick or the tick
        finally:
            lp.close()
            os.close(worker.r)
            os.close(worker.w)

    run(go())
