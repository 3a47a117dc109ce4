"""A cancelled request stops computing on its prefill worker, and is never retried on the worker
that failed it (issue 13): router + 1 prefill + 1 decode worker on the tiny checkpoint, prefill
chunks of 16 tokens (a 4000-token prompt is 250 engine steps), a short poll deadline
(``--poll-timeout 1 --hung-polls 2``: a stopped worker is down within about 2 x 1.2 s).

In file order: a client that leaves during the prefill (before any output): the worker's engine
drops the request between two chunks, having computed only part of the prompt; the only prefill
worker SIGSTOPped during a prefill: the router marks it down and answers 503 at once, with no
retry on it, and once continued the worker drops the cancelled request without computing the rest
of the prompt and is up again. Each prompt is new to the worker's prefix cache (a hit would
compute nothing), and each test leaves no request, page or staged KV behind.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from swaserve.launcher import Cluster
from swaserve.metrics_router import RETRY_REASONS
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc
from tests.helpers.cluster import (
    CLIENT_TIMEOUT,
    MODEL,
    metric,
    one_pair,
    prompt,
    retried,
    running,
    wait_for,
    wait_idle,
    workers,
)

pytestmark = pytest.mark.cluster  # starts a router and workers (``Cluster``) as child processes

LONG = 4000  # prompt tokens: 250 chunks of 16
STARTED = 64  # computed tokens that show the prefill is under way
PREFILL_ARGS = ["--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    with running(one_pair(tiny_dir, PREFILL_ARGS)) as c:  # running: continues stopped workers first
        yield c


def body(p: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def prefill_load(c: Cluster) -> pb.Load:
    with grpc.insecure_channel(c.worker_addresses["prefill"][0]) as ch:
        return wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)


def computed(c: Cluster) -> int:
    return prefill_load(c).computed_tokens


def idle(c: Cluster) -> bool:
    ld = prefill_load(c)
    return not (ld.running or ld.waiting or ld.open_requests)


def test_a_client_that_leaves_stops_the_prefill_between_chunks(cluster: Cluster) -> None:
    url = cluster.url
    base = computed(cluster)
    cancelled = metric(url, "swaserve:router_requests_total", status="cancelled")
    data = json.dumps(body(prompt(31, LONG))).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT) as s:
        s.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_for("the prefill under way", lambda: computed(cluster) - base >= STARTED)
    # the router sees the client gone (no response had started), cancels the worker's Generate
    # call and aborts the request there; the engine drops it between two chunks
    wait_for("the prefill worker to drop the request", lambda: idle(cluster))
    done = computed(cluster) - base
    assert STARTED <= done < LONG, done
    assert computed(cluster) - base == done  # nothing computes it any more
    wait_for(
        "the request counted as cancelled",
        lambda: metric(url, "swaserve:router_requests_total", status="cancelled") - cancelled == 1,
    )
    wait_idle(cluster)


def test_the_only_prefill_worker_marked_down_gets_no_retry_and_stops(cluster: Cluster) -> None:
    url, addr = cluster.url, cluster.worker_addresses["prefill"][0]
    retries = {r: retried(url, r) for r in RETRY_REASONS}
    dispatched = metric(url, "swaserve:router_dispatches_total", role="prefill", worker=addr)
    unavailable = metric(url, "swaserve:router_requests_total", status="unavailable")
    base = computed(cluster)
    worker = cluster.services["prefill-0"]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(
                httpx.post, f"{url}/v1/completions", json=body(prompt(32, LONG)), timeout=CLIENT_TIMEOUT
            )
            wait_for("the prefill under way", lambda: computed(cluster) - base >= STARTED)
            worker.kill(signal.SIGSTOP)  # its front and its engine core: it stops answering polls
            r = fut.result(timeout=CLIENT_TIMEOUT)
        assert {x: retried(url, x) for x in RETRY_REASONS} == retries  # not retried on the same worker
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "no_worker_available" and "marked down" in err["message"], err
        assert "no other prefill worker to retry it on" in err["message"], err
        assert metric(url, "swaserve:router_dispatches_total", role="prefill", worker=addr) - dispatched == 1
        assert metric(url, "swaserve:router_requests_total", status="unavailable") - unavailable == 1
        assert workers(url)[addr]["state"] == "down"
    finally:
        worker.kill(signal.SIGCONT)
    # continued: the cancelled call and the router's abort reach it, its engine drops the request
    wait_for("the prefill worker to drop the request", lambda: idle(cluster))
    done = computed(cluster) - base
    assert STARTED <= done < LONG, done
    wait_for("the worker up again", lambda: workers(url)[addr]["state"] == "up")
    wait_idle(cluster)
