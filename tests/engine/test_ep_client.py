"""The EP client's failure handling with real rank processes: a hung rank (SIGSTOP) under load
ends the instance after ``ep_timeout_s`` (its peer gives up in the collective and exits; no
survivor waits forever), open requests fail with ``EngineDead`` and ``on_dead`` runs once."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from swaserve.config import EngineConfig
from swaserve.engine.client import EngineDead
from swaserve.engine.ep_client import EPEngineClient
from swaserve.engine.types import SamplingParams

pytestmark = pytest.mark.cluster


@pytest.mark.slow  # waits out the EP timeout, ~13 s (make test-slow, CI)
def test_a_hung_rank_ends_the_instance_after_the_ep_timeout(tiny_dir: Path) -> None:
    cfg = EngineConfig(
        ep_size=2, page_size=4, max_num_batched_tokens=16, kv_cache_memory=16 << 20,
        ep_timeout_s=3.0, engine_step_timeout=0,
    )  # fmt: skip

    async def run() -> tuple[list[str], list[BaseException], float]:
        dead: list[str] = []
        c = EPEngineClient(tiny_dir, cfg, on_dead=dead.append)
        await c.start()
        errors: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
                async for _ in c.generate([5 + i, 9, 13] * 4, params, f"r{i}"):
                    pass
            except BaseException as e:
                errors.append(e)

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        try:
            await asyncio.sleep(1.0)  # both ranks are stepping
            stopped = c.ranks[1].pid
            assert stopped is not None
            os.kill(stopped, signal.SIGSTOP)
            t0 = time.monotonic()
            while not dead:
                assert time.monotonic() - t0 < 30, "a hung rank did not end the instance"
                await asyncio.sleep(0.05)
            took = time.monotonic() - t0
            await asyncio.wait_for(asyncio.gather(*tasks), 15)
            for r in c.ranks:  # every rank process is gone (the stopped one killed)
                await asyncio.wait_for(r._proc.wait(), 15)
            return dead, errors, took
        finally:
            await c.stop()

    dead, errors, took = asyncio.run(run())
    assert len(dead) == 1 and "expert-parallel rank" in dead[0]
    assert len(errors) == 4 and all(isinstance(e, EngineDead) for e in errors)
    assert took < 20, took  # ep_timeout_s 3 s, plus exiting


def _listening(pid: int) -> list[str]:
    """The TCP addresses a process listens on."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]


def test_ep_with_mtp_equals_one_engine_without_it(tmp_path: Path, tiny_dir: Path) -> None:
    """MTP layers are dense (no collective): each rank drafts and verifies its own requests while
    the MoE exchanges keep the ranks in step; greedy tokens equal one engine without MTP. The
    ranks' rendezvous store and gloo pairs listen on loopback only (torch's store server alone
    listens on every interface)."""
    from swaserve.engine.llm_engine import LLMEngine
    from swaserve.model.checkpoint import make_checkpoint

    model = make_checkpoint("tiny", tmp_path / "mimo-v2-tiny-mtp", mtp_layers=3)
    prompts = [[5 + i, 9, 13, 200 + i, 7] * (2 + i) for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    base = dict(page_size=4, max_num_batched_tokens=16, kv_cache_memory=16 << 20)
    want = LLMEngine(str(tiny_dir), EngineConfig(**base)).generate(prompts, params)  # type: ignore[arg-type]

    async def run() -> tuple[list[list[int]], int]:
        c = EPEngineClient(model, EngineConfig(**base, ep_size=2, speculative_num_steps=3))  # type: ignore[arg-type]
        await c.start()
        try:
            pids = [r.pid for r in c.ranks]
            listening = [ip for pid in pids if pid is not None for ip in _listening(pid)]
            assert len(pids) == 2 and listening, (pids, listening)  # rank 0's store, the gloo pairs
            assert all(ipaddress.ip_address(ip).is_loopback for ip in listening), listening

            async def one(i: int, p: list[int]) -> list[int]:
                out: list[int] = []
                async for o in c.generate(p, params, f"r{i}"):
                    out += o.new_token_ids
                return out

            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            spec = c.stats().spec
            return got, spec.drafts if spec is not None else 0
        finally:
            await c.stop()

    got, drafts = asyncio.run(run())
    assert got == want
    assert drafts > 0  # both ranks' verify steps, summed
