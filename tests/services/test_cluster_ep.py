"""Expert parallelism through ``swaserve serve --ep-size 2`` and ``swaserve up`` (two prefill
workers and a decode worker, each an EP = 2 instance of two engine-core ranks): greedy outputs equal transformers
``generate()`` and one engine; killing a rank under load takes its worker down (NOT_SERVING,
non-zero exit, its other rank gone, within seconds) and the router serves on with the other."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.launcher import Cluster
from swaserve.procs import free_port
from tests.helpers.cluster import FAST_POLLS, MODEL, WORKER_ARGS, running
from tests.services.test_cluster import complete_all, prompts

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # EP in-process: tests/engine/test_ep_*.py

NEW = 16


def _reference(tiny_dir: Path, ps: list[list[int]]) -> list[list[int]]:
    eng = LLMEngine(
        str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
    )
    return eng.generate(ps, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True))


def _hf(hf_tiny, p: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    ids = torch.tensor([p])
    out = hf_tiny.generate(ids, max_new_tokens=NEW, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(p) :].tolist()  # type: ignore[no-any-return]


def core_ranks(pid: int) -> list[int]:
    """Pids of the engine-core processes whose parent is ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{d}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"swaserve.engine.core_proc" in Path(f"/proc/{d}/cmdline").read_bytes():
                out.append(int(d))
    return sorted(out)


def test_serve_ep2_greedy_equals_transformers(tiny_dir: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    cmd = [sys.executable, "-m", "swaserve.cli", "serve", "--model", str(tiny_dir), "--port", str(port),
           "--ep-size", "2", *WORKER_ARGS]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "serve --ep-size 2 did not become healthy"
            time.sleep(0.3)
        assert len(core_ranks(proc.pid)) == 2
        ps = prompts(6, seed=5)
        got = asyncio.run(complete_all(url, ps, NEW))
        want = _reference(tiny_dir, ps)
        assert [r["choices"][0]["token_ids"] for r in got] == want
        for p, w in list(zip(ps, want, strict=True))[:3]:
            assert _hf(hf_tiny, p) == w
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert "swaserve:ep_expert_balance" in metrics
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def ep_cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=2, decode=1, worker_args=[*WORKER_ARGS, "--ep-size", "2"],
        router_args=FAST_POLLS, redis=False,
    )  # fmt: skip
    with running(c, timeout_s=300):
        yield c


def test_up_with_ep_prefill_workers_equals_transformers(ep_cluster: Cluster, tiny_dir: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    ps = prompts(8, seed=6)
    got = asyncio.run(complete_all(ep_cluster.url, ps, NEW))
    want = _reference(tiny_dir, ps)
    assert [r["choices"][0]["token_ids"] for r in got] == want
    for p, w in list(zip(ps, want, strict=True))[:2]:
        assert _hf(hf_tiny, p) == w
    for name in ("prefill-0", "prefill-1", "decode-0"):  # the decode worker imports KV into a rank
        assert len(core_ranks(ep_cluster.services[name].proc.pid)) == 2  # type: ignore[union-attr]


def test_killing_a_rank_takes_its_worker_down_and_the_router_serves_on(ep_cluster: Cluster, tiny_dir: Path) -> None:  # fmt: skip
    svc = ep_cluster.services["prefill-0"]
    assert svc.proc is not None
    ranks = core_ranks(svc.proc.pid)
    assert len(ranks) == 2
    ps = prompts(6, seed=7)
    want = _reference(tiny_dir, ps)
    stop = threading.Event()
    codes: list[int] = []

    def load() -> None:  # requests in flight while the rank dies
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {
                    "model": MODEL,
                    "prompt": ps[len(codes) % len(ps)],
                    "max_tokens": NEW,
                    "temperature": 0,
                }
                with contextlib.suppress(httpx.HTTPError):
                    codes.append(client.post(f"{ep_cluster.url}/v1/completions", json=body).status_code)

    t = threading.Thread(target=load)
    t.start()
    try:
        time.sleep(1.5)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        while svc.proc.poll() is None:
            assert time.monotonic() - killed < 30, "the worker did not exit after one of its ranks died"
            time.sleep(0.1)
        took = time.monotonic() - killed
        assert svc.proc.returncode != 0
        assert (
            not Path(f"/proc/{ranks[0]}").exists()
            or b"Z" in Path(f"/proc/{ranks[0]}/stat").read_bytes().split(b")")[1][:3]
        )
    finally:
        stop.set()
        t.join()
    assert took < 15, took
    got = asyncio.run(complete_all(ep_cluster.url, ps, NEW))  # prefill-1 takes them
    assert [r["choices"][0]["token_ids"] for r in got] == want
