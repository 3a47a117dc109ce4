"""UCX progress by the event loop (services/gcache/ucx_ep.py): calls of every size complete
(many at once on one endpoint), an idle connection does not busy-poll a core (ucxx's own
``polling`` and ``blocking`` modes do: about one CPU second per second), the loop's reader goes
away with the last user and a later loop starts again, and a ucxx context made by someone else
(ucxx's default thread mode) is used with ucxx's own waits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest

from services.gcache.ucx_wire import Reply
from tests.services.gcache.helpers import run, ucx_or_skip

IDLE_S = 1.0
IDLE_CPU_MAX_S = 0.4  # busy-polling costs ~IDLE_S; the loop's own ticks cost ~0.01-0.05 s


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


def test_the_last_user_stops_the_loop_progress_and_a_new_loop_starts_again() -> None:
    from services.gcache import ucx

    async def go() -> object:
        server, client = await _pair()
        r = await client.call(3, b"x", [b"abc"])  # type: ignore[attr-defined]
        assert bytes(r.buffers[0]) == b"cba"
        progress = ucx._RUNTIME.progress
        loop = asyncio.get_running_loop()
        assert progress is not None and loop._selector.get_map().get(progress.fd) is not None  # type: ignore[attr-defined]
        await client.close()  # type: ignore[attr-defined]
        await server.stop()  # type: ignore[attr-defined]
        assert ucx._RUNTIME.progress is None and progress.closed
        assert loop._selector.get_map().get(progress.fd) is None  # type: ignore[attr-defined]
        return progress

    first = run(go())
    second = run(go())  # a new loop, a new context and progress
    assert first is not second


FOREIGN = """
import asyncio, ucxx
from services.gcache.ucx import UcxClient, UcxServer, _RUNTIME
from services.gcache.ucx_ep import LoopProgress
from services.gcache.ucx_wire import Reply

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
    out = subprocess.run([sys.executable, "-c", FOREIGN], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
