"""Graceful drain of a worker on SIGTERM (``--shutdown-timeout``), on a real cluster: router + 1
prefill + 2 decode workers on the tiny checkpoint, one torch thread each, fast polls.

In file order: a decode worker SIGTERMed under a long greedy stream says it drains (GetLoad
``draining``, health NOT_SERVING, new Generate and KVTransfer.Push refused, ``GET /workers`` state
``draining`` with its reason), a new request goes to the other decode worker (no retry), the stream
ends with all its tokens and no resume, and the worker exits 0 long before its timeout; restarted
(a new boot id, ``--shutdown-timeout 1``) the router uses it again. With a stream longer than that
timeout, the worker exits 0 at the timeout and the router resumes the request on the other decode
worker with the uninterrupted greedy output (the first test's stream). A second SIGTERM stops a
draining worker at once. A stream is put on decode-0 by removing decode-1 while it starts
(``DELETE/POST /workers``); signals go to the worker's main process only, as the kubelet's do."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swaserve.launcher import Cluster
from swaserve.procs import ServiceProcess
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc
from tests.helpers.cluster import (
    CLIENT_TIMEOUT,
    FAST_POLLS,
    MODEL,
    WORKER_ARGS,
    loads,
    prompt,
    retried,
    running,
    wait_for,
    wait_idle,
    workers,
)

# starts a router and workers as child processes; slow: ~80 s of drains (make test-slow, CI)
pytestmark = [pytest.mark.cluster, pytest.mark.slow]

N = 1200  # tokens of the long stream: about 13 s of decoding here alone (one thread, ~11 ms a token)


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=1, decode=2, worker_args=[*WORKER_ARGS, "--num-threads", "1"],
        router_args=FAST_POLLS, redis=False,
    )  # fmt: skip
    with running(c) as c:
        yield c


def body(p: list[int], max_tokens: int = N, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def complete(url: str, req: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream(url: str, req: dict[str, Any], got: list[int]) -> dict[str, Any]:
    """Stream ``req``; its token ids land in ``got`` as they come. Returns the last finish reason
    and the error events."""
    finish, errors = None, []
    req = {**req, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            errors += [event] if "error" in event else []
            for choice in event.get("choices", []):
                got += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
    return {"finish": finish, "errors": errors}


def change(url: str, method: str, **kw: Any) -> None:
    r = httpx.request(method, f"{url}/workers", timeout=30, **kw)
    assert r.status_code == 200, r.text


def settled(c: Cluster) -> None:
    addrs = [a for role in ("prefill", "decode") for a in c.worker_addresses[role]]
    wait_for("workers up", lambda: all(workers(c.url)[a]["state"] == "up" for a in addrs))
    wait_idle(c)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return int(
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        )


def get_load(address: str) -> pb.Load:
    with grpc.insecure_channel(address) as ch:
        return wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


def refused(address: str) -> None:
    """A new Generate and a new KVTransfer.Push are refused: UNAVAILABLE, "worker is draining"."""
    from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

    req = pb.GenerateRequest(request_id="new", prompt_token_ids=[5, 6, 7])
    with grpc.insecure_channel(address) as ch:
        for call in (
            lambda: list(wgrpc.WorkerStub(ch).Generate(req, timeout=5)),
            lambda: kvgrpc.KVTransferStub(ch).Push(iter(()), timeout=5),
        ):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            assert e.value.details().startswith("worker is draining")  # type: ignore[attr-defined]


def restart(svc: ServiceProcess, *extra: str) -> None:
    """Start ``svc`` again on its port, with ``extra`` arguments after its own."""
    assert svc.proc is not None and svc.proc.poll() is not None
    svc.cmd = [*svc.cmd, *extra]
    svc.start()
    svc.wait_ready(300)


def start_on_decode_0(
    c: Cluster, ex: concurrent.futures.Executor, req: dict[str, Any], got: list[int]
) -> Any:
    """Stream ``req`` on decode-0 (decode-1 is removed until output flows, then added back)."""
    d1 = c.worker_addresses["decode"][1]
    change(c.url, "DELETE", params={"url": d1})
    fut = ex.submit(stream, c.url, req, got)
    wait_for("decode output", lambda: len(got) >= 10 or fut.done())
    change(c.url, "POST", json={"url": d1, "role": "decode"})
    assert workers(c.url)[c.worker_addresses["decode"][0]]["in_flight"] == 1
    return fut


@pytest.fixture(scope="module")
def outputs() -> dict[str, list[int]]:
    """Token ids of uninterrupted greedy runs, by prompt seed (one test's stream is the next's
    reference)."""
    return {}


def greedy(url: str, seed: int, outputs: dict[str, list[int]]) -> list[int]:
    """The uninterrupted greedy output of ``body(prompt(seed, 30))``."""
    if str(seed) not in outputs:
        outputs[str(seed)] = complete(url, body(prompt(seed, 30)))["choices"][0]["token_ids"]
    return outputs[str(seed)]


def test_sigterm_drains_a_decode_worker_and_its_stream_completes(
    cluster: Cluster, outputs: dict[str, list[int]]
) -> None:
    url = cluster.url
    d0 = cluster.worker_addresses["decode"][0]
    svc = cluster.services["decode-0"]
    assert svc.proc is not None
    settled(cluster)
    resumed, unavailable = retried(url, "resumed"), retried(url, "unavailable")
    boot = get_load(d0).boot_id
    got: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = start_on_decode_0(cluster, ex, body(prompt(21, 30)), got)
        os.kill(svc.proc.pid, signal.SIGTERM)  # as the kubelet does: the main process only
        wait_for("draining in GET /workers", lambda: workers(url)[d0]["state"] == "draining", 10)
        w = workers(url)[d0]
        assert "shutting down" in w["reason"] and w["in_flight"] == 1, w
        load = get_load(d0)  # it still answers GetLoad, and says it drains
        assert load.draining and load.boot_id == boot and load.open_requests == 1
        assert health(d0) == health_pb2.HealthCheckResponse.NOT_SERVING
        refused(d0)
        before = loads(cluster)["decode-1"].computed_tokens
        short = complete(url, body(prompt(22, 20), max_tokens=8))  # goes to decode-1
        assert short["usage"]["completion_tokens"] == 8
        assert loads(cluster)["decode-1"].computed_tokens - before >= 7  # the 1st: the prefill's
        assert svc.alive() and len(got) < N, "the stream ended before the new request: raise N"
        out = fut.result(timeout=CLIENT_TIMEOUT)
    assert not out["errors"] and out["finish"] == "length" and len(got) == N, out
    outputs["21"] = got
    assert svc.proc.wait(timeout=60) == 0
    # drained, not cut at its --shutdown-timeout (30 s): a cut stream is resumed on decode-1 (no
    # wall-clock bound here: on 2 busy cores the stream alone takes 13-40 s)
    assert retried(url, "resumed") == resumed and retried(url, "unavailable") == unavailable
    wait_for("marked down once gone", lambda: workers(url)[d0]["state"] == "down", 10)

    restart(svc, "--shutdown-timeout", "1")  # a new process at the same address: used again
    wait_for("back in use", lambda: workers(url)[d0]["state"] == "up", 10)
    assert workers(url)[d0]["boot_id"] != boot and workers(url)[d0]["reason"] is None
    settled(cluster)


def test_a_stream_longer_than_the_shutdown_timeout_is_resumed_elsewhere(
    cluster: Cluster, outputs: dict[str, list[int]]
) -> None:
    """decode-0 restarted above with ``--shutdown-timeout 1``."""
    url = cluster.url
    d0 = cluster.worker_addresses["decode"][0]
    svc = cluster.services["decode-0"]
    assert svc.proc is not None and svc.cmd[-2:] == ["--shutdown-timeout", "1"]
    want = greedy(url, 21, outputs)
    p = prompt(21, 30)
    settled(cluster)
    resumed = retried(url, "resumed")
    got: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = start_on_decode_0(cluster, ex, body(p), got)
        t0 = time.monotonic()
        os.kill(svc.proc.pid, signal.SIGTERM)
        assert svc.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        out = fut.result(timeout=CLIENT_TIMEOUT)
    assert took >= 1.0, took  # it waited its 1 s timeout; cut then (resumed below), not drained
    assert not out["errors"] and out["finish"] == "length" and got == want, out
    assert retried(url, "resumed") - resumed == 1  # it was cut before its end
    wait_for("marked down once gone", lambda: workers(url)[d0]["state"] == "down", 10)


def test_a_second_sigterm_stops_a_draining_worker_at_once(cluster: Cluster) -> None:
    """On decode-1, the one decode worker left (decode-0 exited above): its stream cannot be
    resumed, and ends with an error event."""
    url = cluster.url
    d1 = cluster.worker_addresses["decode"][1]
    svc = cluster.services["decode-1"]
    assert svc.proc is not None and not cluster.services["decode-0"].alive()
    got: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(stream, url, body(prompt(24, 30)), got)
        wait_for("decode output", lambda: len(got) >= 10 or fut.done())
        os.kill(svc.proc.pid, signal.SIGTERM)
        wait_for("draining in GET /workers", lambda: workers(url)[d1]["state"] == "draining", 10)
        t0 = time.monotonic()
        os.kill(svc.proc.pid, signal.SIGTERM)
        assert svc.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        out = fut.result(timeout=CLIENT_TIMEOUT)
    assert took < 10, took  # not its 30 s
    assert len(got) < N and out["errors"] and out["finish"] is None, out
