"""Ray as the launcher of an expert-parallel instance (``--ep-launcher ray``): two actors in one
placement group, a local Ray on 127.0.0.1, the same outputs as child-process ranks; killing an
actor ends the instance (every rank gone, ``on_dead`` once, the bundles released)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.ep_client import EPEngineClient
from swaserve.engine.types import SamplingParams

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _prompts() -> list[list[int]]:
    return [[5 + i, 9, 13, 200 + i, 7] * (3 + i) for i in range(4)]


async def _outputs(client: EPEngineClient) -> list[list[int]]:
    async def one(i: int, p: list[int]) -> list[int]:
        toks: list[int] = []
        async for o in client.generate(p, SamplingParams(max_tokens=12, temperature=0.0), f"r{i}"):
            toks += o.new_token_ids
        return toks

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts())))


def test_ray_actor_ranks_equal_child_processes_and_a_killed_actor_ends_the_instance(tiny_dir: Path) -> None:
    cfg = EngineConfig(ep_size=2, max_num_batched_tokens=16, page_size=4, kv_cache_memory=16 << 20)

    async def children() -> list[list[int]]:
        c = EPEngineClient(tiny_dir, cfg)
        await c.start()
        try:
            return await _outputs(c)
        finally:
            await c.stop()

    async def actors() -> tuple[list[list[int]], list[str], float]:
        dead: list[str] = []
        c = EPEngineClient(
            tiny_dir, EngineConfig(**{**cfg.__dict__, "ep_launcher": "ray"}), on_dead=dead.append
        )
        await c.start()
        try:
            assert ray.is_initialized() and ray.util.get_node_ip_address() == "127.0.0.1"
            assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
            group = c._group
            assert group is not None and len(group.actors) == 2
            table = ray.util.placement_group_table(group.pg)
            assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
            out = await _outputs(c)
            ray.kill(group.actors[1])
            t0 = time.monotonic()
            while not dead:
                assert time.monotonic() - t0 < 15, "killing an actor did not end the instance"
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            for r in c.ranks:  # the other rank is killed too
                await asyncio.wait_for(r._proc.wait(), 15)
            assert not c.running
            await asyncio.sleep(0.2)
            assert len(dead) == 1
            return out, dead, took
        finally:
            await c.stop()
            assert not ray.is_initialized()  # the local Ray this client started is gone

    want = asyncio.run(children())
    got, dead, took = asyncio.run(actors())
    assert got == want
    # Either rank may be seen first: the survivor's collective fails and its actor ends too,
    # sometimes before Ray reports the killed one.
    assert re.search(r"rank [01] of 2", dead[0]) and took < 15


def test_a_local_ray_head_that_does_not_report_in_time_is_killed_with_a_clear_error() -> None:
    from swaserve.engine.ray_ranks import LocalRayHead, RayUnavailable

    with pytest.raises(RayUnavailable, match=r"did not start \(killed after 0.05 s"):
        LocalRayHead(num_cpus=1, timeout_s=0.05)


def test_a_local_ray_head_ends_with_its_parent() -> None:
    """The head serves until its stdin closes: a front killed with SIGKILL takes Ray down with it
    (no orphaned GCS or raylet)."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    front = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from swaserve.engine.ray_ranks import LocalRayHead; import time\n"
            "h = LocalRayHead(num_cpus=1); print(h.proc.pid, h.address, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert front.stdout is not None
        pid_s, address = front.stdout.readline().split()
        assert address.startswith("127.0.0.1:")
        head = psutil.Process(int(pid_s))
        ray_procs = head.children(recursive=True)
        assert any("gcs_server" in p.name() for p in ray_procs), [p.name() for p in ray_procs]
        os.kill(front.pid, signal.SIGKILL)
        front.wait(10)
        _, alive = psutil.wait_procs([head, *ray_procs], timeout=60)
        assert not alive, [p.name() for p in alive]
    finally:
        front.kill()
        front.wait()


def test_stopping_a_local_ray_head_that_was_killed_leaves_none_of_its_processes() -> None:
    """SIGKILL on the head leaves Ray's agents running (orphans, for about a minute); ``stop``
    kills what is left of its process group."""
    import os
    import signal

    import psutil

    from swaserve.engine.ray_ranks import LocalRayHead

    head = LocalRayHead(num_cpus=1)
    try:
        procs = psutil.Process(head.proc.pid).children(recursive=True)
        assert procs
        os.kill(head.proc.pid, signal.SIGKILL)
        head.proc.wait(10)
    finally:
        head.stop()
    _, alive = psutil.wait_procs(procs, timeout=10)
    assert not alive, [p.name() for p in alive]
