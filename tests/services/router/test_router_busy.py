"""A worker busy in a long engine step is not taken down (issue 13): router + 1 prefill + 1 decode
worker on the tiny checkpoint, the prefill worker's engine inline (the mode whose step used to hold
its event loop, and so its ``GetLoad``) with a step budget that takes a whole long prompt at once,
and a router deadline far below that step (``--poll-timeout 1 --hung-polls 2``: a worker that does
not answer is down within about 2 x 1.2 s; the tiny model's 2000-token step takes seconds on CPU).

The router keeps polling the worker through the step, sees the request on it and its load, never
marks it down, and the request completes without a retry.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swaserve.launcher import Cluster
from swaserve.metrics_router import RETRY_REASONS
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

LONG = 2000  # prompt tokens: one engine step (budget 4096) of seconds on the tiny model (CPU)
PREFILL_ARGS = ["--engine-process", "inline", "--max-num-batched-tokens", "4096"]


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    with running(one_pair(tiny_dir, PREFILL_ARGS)) as c:
        yield c


def complete(url: str, p: list[int]) -> httpx.Response:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": p,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT)


def test_a_prefill_worker_in_a_long_step_stays_up(cluster: Cluster) -> None:
    url, addr = cluster.url, cluster.worker_addresses["prefill"][0]
    retries = {r: retried(url, r) for r in RETRY_REASONS}
    ok = metric(url, "swaserve:router_requests_total", status="ok")
    seen: list[dict[str, Any]] = []  # the router's view of the worker while the step runs
    before = workers(url)[addr]  # idle: its progress so far

    def busy() -> bool:
        w = workers(url)[addr]
        if w["state"] == "up" and (w["running"] or w["waiting"]):
            seen.append(w)
        return bool(seen)

    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(complete, url, prompt(7, LONG))
        wait_for("the router to see the request on the worker", lambda: busy() or fut.done(), CLIENT_TIMEOUT)
        r = fut.result(timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (LONG, 4), usage
    # polls answered during the step: the worker was up, with the request on it, no step done yet
    assert seen and seen[0]["running"] + seen[0]["waiting"] == 1, seen
    wait_for(
        "the router to see the prompt computed",
        lambda: workers(url)[addr]["computed_tokens"] - before["computed_tokens"] == LONG,
    )
    assert workers(url)[addr]["steps"] > before["steps"]
    assert {r: retried(url, r) for r in RETRY_REASONS} == retries  # never marked down: no retry
    assert metric(url, "swaserve:router_requests_total", status="ok") - ok == 1
    assert workers(url)[addr]["state"] == "up"
    wait_idle(cluster)
