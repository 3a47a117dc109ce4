"""A request survives the loss of its decode worker mid-generation (the router resumes it on
another prefill + decode pair with its generated tokens), on a real cluster: router + 2 prefill + 2
decode workers on the tiny checkpoint, Redis for the leases, a short poll deadline
(``--poll-timeout 2 --hung-polls 2``: a stopped worker is marked down within about 2 x 2.2 s).

In file order: a streamed greedy request whose decode worker is SIGKILLed after some tokens (with
a stop string that the resumed part must match) streams exactly an uninterrupted run's tokens, text
and logprobs, one final chunk and the original usage (the killed worker is restarted); a
non-streaming seeded sampled one with presence and frequency penalties whose decode worker is
SIGSTOPped (marked down) answers exactly the uninterrupted response; one with both decode workers stopped cannot be resumed and gets a 503 that
says so. Each test checks that no lease, request or staged KV is left; stopped workers are
continued and every process is stopped at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from swaserve.launcher import Cluster
from tests.helpers.cluster import (
    CLIENT_TIMEOUT,
    MODEL,
    WORKER_ARGS,
    metric,
    prompt,
    retried,
    running,
    wait_for,
    wait_idle,
    workers,
)

pytestmark = pytest.mark.cluster  # starts router, workers and Redis (``Cluster``) as child processes

NS = f"test-resume-{uuid.uuid4().hex[:8]}"
ROUTER_ARGS = ["--request-timeout", "120", "--poll-interval", "0.2", "--poll-timeout", "2", "--hung-polls", "2",
               "--namespace", NS]  # fmt: skip
N = 400  # tokens to generate: long enough to interrupt after 20 of them


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    with running(
        Cluster(tiny_dir, prefill=2, decode=2, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    ) as c:
        yield c


def body(p: list[int], max_tokens: int = N, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1, **extra}  # fmt: skip


def complete(url: str, req: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def serving_decode(c: Cluster) -> str:
    """The name of the one decode worker with a request of this router in flight."""
    ws = workers(c.url)
    busy = [i for i, a in enumerate(c.worker_addresses["decode"]) if ws[a]["in_flight"]]
    assert len(busy) == 1, ws
    return f"decode-{busy[0]}"


def settled(c: Cluster) -> None:
    """Every worker up, idle (no request, no request page, nothing staged), no lease left."""
    addrs = [a for role in ("prefill", "decode") for a in c.worker_addresses[role]]
    wait_for("workers up", lambda: all(workers(c.url)[a]["state"] == "up" for a in addrs))
    wait_idle(c)
    assert c.redis_url is not None
    r = redis.Redis.from_url(c.redis_url, decode_responses=True)
    wait_for(
        "leases released", lambda: sum(int(r.hlen(k)) for k in r.scan_iter(match="{" + NS + "}:lease:*")) == 0
    )


def same_logprobs(got: dict[str, Any], want: dict[str, Any]) -> None:
    g, w = got["logprobs"], want["logprobs"]
    assert g["tokens"] == w["tokens"] and g["text_offset"] == w["text_offset"]
    assert g["token_logprobs"] == pytest.approx(w["token_logprobs"], abs=1e-4)


def test_a_stream_survives_a_killed_decode_worker(cluster: Cluster) -> None:
    url = cluster.url
    p = prompt(11, 40)
    plain = complete(url, body(p))["choices"][0]
    # a stop string well after the interruption: the resumed part must find it (the router does)
    k = 3 * N // 4
    at = plain["logprobs"]["text_offset"][k]
    stop = plain["text"][at : at + 6]
    assert len(stop) == 6 and plain["text"].find(stop) == at, stop
    want = complete(url, body(p, stop=[stop]))
    assert want["choices"][0]["finish_reason"] == "stop" and want["usage"]["completion_tokens"] < N
    settled(cluster)
    resumed = retried(url, "resumed")

    events: list[Any] = []
    name = ""
    req = body(p, stop=[stop], stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
            if not name and len(events) == 20:  # decoding: tokens reached the client
                name = serving_decode(cluster)
                cluster.services[name].kill(signal.SIGKILL)
    assert name, "the stream ended before it could be interrupted"
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events[-3:]
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = events[-2]["usage"]
    w = want["choices"][0]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"] or []] == w["token_ids"]
    assert "".join(e["choices"][0]["text"] for e in chunks) == w["text"]
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    lps = [e["choices"][0]["logprobs"] for e in chunks if e["choices"][0]["logprobs"]]
    got_lps = {k: [x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs", "text_offset")}
    same_logprobs({"logprobs": got_lps}, w)
    assert (
        usage["prompt_tokens"] == len(p) and usage["completion_tokens"] == want["usage"]["completion_tokens"]
    )
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= len(p)
    assert retried(url, "resumed") - resumed == 1

    svc = cluster.services[name]
    assert svc.proc is not None
    svc.proc.wait(timeout=30)
    svc.start()  # the same port: the router finds it back at its next poll
    svc.wait_ready(300)
    settled(cluster)


# a seeded sampled request with presence and frequency penalties: the resumed workers count the
# tokens sent as output and start the generator that many draws in (``prior_output_tokens``)
SAMPLED: dict[str, Any] = {
    "temperature": 0.75,
    "seed": 2**40 + 3,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
}


def test_a_non_streaming_request_survives_a_stopped_decode_worker(cluster: Cluster) -> None:
    url = cluster.url
    p = prompt(12, 30)
    want = complete(url, body(p, **SAMPLED))
    settled(cluster)
    resumed, down = retried(url, "resumed"), retried(url, "worker_down")
    tokens = metric(url, "swaserve:generation_tokens_total")
    ok = metric(url, "swaserve:router_requests_total", status="ok")
    name = ""
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(complete, url, body(p, **SAMPLED))
            wait_for("tokens relayed", lambda: metric(url, "swaserve:generation_tokens_total") - tokens >= 20)
            name = serving_decode(cluster)
            cluster.services[name].kill(signal.SIGSTOP)  # marked down after its missed polls
            got = fut.result(timeout=CLIENT_TIMEOUT)
    finally:
        if name:
            cluster.services[name].kill(signal.SIGCONT)
    g, w = got["choices"][0], want["choices"][0]
    assert g["token_ids"] == w["token_ids"] and g["text"] == w["text"] and g["finish_reason"] == "length"
    same_logprobs(g, w)
    assert got["usage"]["prompt_tokens"] == len(p) and got["usage"]["completion_tokens"] == N
    assert retried(url, "resumed") - resumed == 1 and retried(url, "worker_down") == down
    assert metric(url, "swaserve:router_requests_total", status="ok") - ok == 1
    settled(cluster)


def test_a_request_that_cannot_be_resumed_is_a_503(cluster: Cluster) -> None:
    url = cluster.url
    p = prompt(13, 30)
    resumed = retried(url, "resumed")
    unavailable = metric(url, "swaserve:router_requests_total", status="unavailable")
    tokens = metric(url, "swaserve:generation_tokens_total")
    decoders = [f"decode-{i}" for i in range(len(cluster.worker_addresses["decode"]))]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            fut = ex.submit(httpx.post, f"{url}/v1/completions", json=body(p), timeout=CLIENT_TIMEOUT)
            wait_for("tokens relayed", lambda: metric(url, "swaserve:generation_tokens_total") - tokens >= 20)
            for name in decoders:
                cluster.services[name].kill(signal.SIGSTOP)
            r = fut.result(timeout=CLIENT_TIMEOUT)
    finally:
        for name in decoders:
            cluster.services[name].kill(signal.SIGCONT)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "no_worker_available", err
    assert "interrupted after" in err["message"] and "marked down" in err["message"], err
    # resumed once, on the other decode worker (stopped too); never again on one that failed it
    assert retried(url, "resumed") - resumed == 1
    assert metric(url, "swaserve:router_requests_total", status="unavailable") - unavailable == 1
    settled(cluster)
