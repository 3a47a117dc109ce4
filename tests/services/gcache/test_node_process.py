"""``python -m services.gcache`` as a process: health SERVING, a stopped node costs the client's
deadline and a killed one fails fast (``L3Error`` both), SIGTERM exits 0, a restart on the same
``--nvme-dir`` finds the pages it had demoted there, and a corrupted slot byte is a counted miss."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from services.gcache.client import GCacheClient
from swaserve.gcache import codec
from swaserve.gcache.l3 import L3Error
from swaserve.procs import ServiceProcess, free_port, grpc_ready
from tests.services.gcache.helpers import chain, run, tokens, ucx_or_skip

pytestmark = pytest.mark.cluster  # starts GCache nodes as child processes

SLACK_S = 3.0  # a busy 2-core machine: scheduling and process start-up, on top of a deadline


@contextmanager
def gcache_node(name: str, *args: str, port: int | None = None) -> Iterator[tuple[ServiceProcess, str]]:
    port = port or free_port()
    cmd = [sys.executable, "-m", "services.gcache", "--host", "127.0.0.1", "--port", str(port), *args]
    proc = ServiceProcess(name, cmd, grpc_ready(f"127.0.0.1:{port}"))
    proc.start()
    try:
        proc.wait_ready(60)  # health SERVING
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.stop(grace_s=5.0)


@pytest.mark.parametrize("transport", ["grpc", "ucx"])
def test_a_stopped_node_costs_the_deadline_and_a_killed_one_fails_fast(transport: str) -> None:
    if transport == "ucx":
        ucx_or_skip()
    ucx_port = "0" if transport == "ucx" else "-1"
    with gcache_node(f"gcache-{transport}", "--ucx-port", ucx_port, "--dram", "64MiB") as (proc, addr):

        async def go() -> None:
            pages = chain(tokens(64), payload=200_000)
            pids = [p.pid for p in pages]
            # this process's ucxx context is made first, outside the short deadline (ucxx.init
            # took 0.6 s here unloaded, more under a loaded make test)
            warm = GCacheClient(addr, transport, timeout_s=60.0)
            assert await warm.put(chain(tokens(16, seed=9), payload=1000)) == [True] * 4
            short = GCacheClient(addr, transport, timeout_s=1.5)
            assert await short.put(pages) == [True] * 16
            assert short.data_transport == transport
            found = await short.lookup(pids)
            proc.kill(signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(L3Error):
                    await short.get(found, pids)
                assert time.monotonic() - t0 < 1.5 + SLACK_S
            finally:
                proc.kill(signal.SIGCONT)
            # the node is back: the same client works again (the lease may have run out: get anyway)
            assert await short.get(await short.lookup(pids), pids) == [p.obj for p in pages]

            patient = GCacheClient(addr, transport, timeout_s=60.0)
            found = await patient.lookup(pids)
            proc.kill(signal.SIGSTOP)  # the get below is in flight (sent, unanswered) when the node dies
            fetch = asyncio.create_task(patient.get(found, pids))
            await asyncio.sleep(0.3)  # not a synchronisation: the assertions hold whether or not it was sent
            proc.kill(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(L3Error):
                await fetch
            assert time.monotonic() - t0 < SLACK_S  # far from its 60 s deadline
            t0 = time.monotonic()
            with pytest.raises(L3Error):
                await patient.lookup(pids)
            assert time.monotonic() - t0 < SLACK_S
            for c in (warm, short, patient):
                await c.close()

        run(go())


def test_restart_finds_its_nvme_pages_and_a_corrupt_slot_is_a_counted_miss(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    args = ("--ucx-port", "-1", "--dram", "64KiB", "--nvme-dir", str(nvme), "--nvme", "8MiB")
    pages = chain(tokens(4 * 40), payload=4000)  # ~4 KiB objects: DRAM holds a dozen, the rest go down
    pids = [p.pid for p in pages]
    with gcache_node("gcache-nvme", *args) as (proc, addr):

        async def fill() -> int:
            c = GCacheClient(addr, "grpc")
            assert await c.put(pages) == [True] * len(pages)
            tiers = {t.tier: t.pages for t in (await c.info()).tiers}
            await c.close()
            return tiers["nvme"]

        on_nvme = run(fill())
        assert 0 < on_nvme < len(pages)
        proc.stop(grace_s=10.0)  # SIGTERM: drains and exits 0
        assert proc.proc is not None and proc.proc.returncode == 0
    metrics_port = free_port()
    with gcache_node("gcache-nvme-2", *args, "--metrics-port", str(metrics_port)) as (proc, addr):

        async def check() -> None:
            c = GCacheClient(addr, "grpc")
            info = await c.info()
            assert {t.tier: t.pages for t in info.tiers} == {"dram": 0, "nvme": on_nvme}
            found = await c.lookup(pids)
            back = [i for i, ok in enumerate(found.present) if ok]
            assert len(back) == on_nvme
            got = await c.get(found, pids)
            assert all(got[i] == pages[i].obj for i in back)
            # corrupt a payload byte of a recovered leaf (its removal takes nothing else)
            children = {pages[i].parent for i in back}
            leaf = next(i for i in reversed(back) if pages[i].pid[0] not in children)
            f = next(f for f in nvme.glob("class-*.slots") if pages[leaf].pid[0] in f.read_bytes())
            at = f.read_bytes().index(pages[leaf].pid[0]) - 32 + codec.header_size(4) + 7
            with f.open("r+b") as fh:
                fh.seek(at)
                b = fh.read(1)[0]
                fh.seek(at)
                fh.write(bytes([b ^ 0x5A]))
            got = await c.get(await c.lookup(pids), pids)
            assert got[leaf] is None
            assert all(got[i] == pages[i].obj for i in back if i != leaf)
            await c.close()

        run(check())
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert 'swaserve:gcache_corrupt_pages_total{kind="full",tier="nvme"} 1.0' in text
