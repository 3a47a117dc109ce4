"""Helpers for tests that run a whole cluster (``swaserve.launcher.Cluster``): start and stop it,
wait for its workers to go idle, read a router's /metrics and /workers."""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from swaserve.launcher import Cluster
from swaserve.procs import ServiceProcess, free_port, grpc_ready
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

MODEL = "mimo-v2-tiny-v2"
WORKER_ARGS = ["--max-num-batched-tokens", "32", "--kv-cache-memory", "16MiB", "--page-size", "4"]


def extra_worker(
    c: Cluster, role: str, name: str, *args: str, model: Path | None = None
) -> tuple[str, ServiceProcess]:
    """A worker the routers were not started with (ready when this returns); ``model``: another
    checkpoint than the cluster's."""
    port = free_port()
    addr = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", f"services.{role}", "--model", str(model or c.model), "--port", str(port),
           "--metrics-port", str(free_port()), "--num-threads", "1", *WORKER_ARGS, *args]  # fmt: skip
    svc = ServiceProcess(name, cmd, grpc_ready(addr))
    svc.start()
    try:
        svc.wait_ready(300)
    except BaseException:
        svc.stop()
        raise
    return addr, svc


CLIENT_TIMEOUT = 60.0  # < the routers' --request-timeout
# a short poll deadline: a worker that does not answer is marked down within about 2 x 1.2 s
FAST_POLLS = [
    "--request-timeout",
    "120",
    "--poll-interval",
    "0.2",
    "--poll-timeout",
    "1",
    "--hung-polls",
    "2",
]


def one_pair(model: Path, prefill_args: list[str]) -> Cluster:
    """A router (``FAST_POLLS``, no Redis) over 1 prefill + 1 decode worker (``WORKER_ARGS``, then
    ``prefill_args`` for the prefill worker)."""
    return Cluster(
        model, prefill=1, decode=1, worker_args=WORKER_ARGS, prefill_args=prefill_args,
        router_args=FAST_POLLS, redis=False,
    )  # fmt: skip


@contextlib.contextmanager
def running(cluster: Cluster, timeout_s: float = 300) -> Iterator[Cluster]:
    """Start ``cluster`` and stop it afterwards, resuming stopped (SIGSTOP) processes first: a
    stopped process does not act on SIGTERM."""
    try:
        cluster.start(timeout_s=timeout_s)
        yield cluster
    finally:
        for name, svc in cluster.services.items():
            if name != "redis":
                svc.kill(signal.SIGCONT)
        cluster.stop()


def loads(c: Cluster) -> dict[str, pb.Load]:
    out = {}
    for role, addrs in c.worker_addresses.items():
        for i, a in enumerate(addrs):
            if not c.services[f"{role}-{i}"].alive():
                continue
            with grpc.insecure_channel(a) as ch:
                out[f"{role}-{i}"] = wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
    return out


def wait_idle(c: Cluster, timeout_s: float = 30.0) -> dict[str, pb.Load]:
    """Every live worker has no request, no request-owned page and nothing staged."""
    deadline = time.monotonic() + timeout_s
    while True:
        ls = loads(c)
        busy = {
            n: (x.running, x.waiting, x.staged_bytes, {k: p.request_pages for k, p in x.pools.items()})
            for n, x in ls.items()
            if x.running or x.waiting or x.staged_bytes or any(p.request_pages for p in x.pools.values())
        }
        if not busy:
            return ls
        if time.monotonic() > deadline:
            raise AssertionError(f"workers still hold requests or pages: {busy}")
        time.sleep(0.2)


# -- a router's /metrics and /workers --------------------------------------------------------------
def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (smp.name, frozenset(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
    }


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model_name": "mimo-v2-tiny-v2", **labels}.items())), 0.0)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a router's /metrics (``model_name`` added to ``labels``; 0 if absent)."""
    return value(scrape(url), name, **labels)


def retried(url: str, reason: str) -> float:
    return metric(url, "swaserve:router_retries_total", reason=reason)


def workers(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{url}/workers", timeout=10)
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["data"]}


def wait_for(what: str, cond: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]
