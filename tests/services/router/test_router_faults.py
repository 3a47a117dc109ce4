"""Router failures that are about capacity or reachability, on a real cluster (``Cluster``: router
+ 1 prefill + 1 decode worker, tiny checkpoint): a decode worker whose KV staging is full, and a
decode worker that is gone while the router still believes it is up (its load poll is far apart).
Both are 503s with a clear message (an error event with the same code once a stream started), not
500s, given at once (a retry never goes back to the worker that failed the request, and there is
no other), and the router counts the outcome on /metrics. A prompt whose KV is larger than the
whole staging is a 400: no retry could stage it.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import torch

from swaserve.config import ModelConfig
from swaserve.launcher import Cluster
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc
from tests.helpers.cluster import WORKER_ARGS, extra_worker, scrape, value, wait_idle, workers

pytestmark = pytest.mark.cluster  # starts router and workers (``Cluster``) as child processes

# the tiny model: 384 bytes of full KV per token + the SWA window (8 tokens x 2304 bytes); 48 KiB
# stage a 40-token prompt (33.8 KB), not two at once, and never a 120-token one (64.5 KB)
STAGING = 48 * 1024
TOKEN_BYTES, WINDOW_BYTES = 384, 8 * 2304
SHORT, LONG = 40, 120
MODEL = "mimo-v2-tiny-v2"


@pytest.fixture(scope="module")
def small(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir,
        prefill=1,
        decode=1,
        worker_args=WORKER_ARGS,
        decode_args=["--staging-memory", str(STAGING)],
        router_args=["--request-timeout", "60", "--poll-interval", "3600"],  # the first poll only
    )
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def body(p: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}


def test_staging_sizes(tiny_dir: Path) -> None:
    m = ModelConfig.from_pretrained(tiny_dir)
    per_token = len(m.full_layers) * m.full.num_kv_heads * (m.full.head_dim + m.full.v_head_dim) * 4
    window = len(m.swa_layers) * m.swa.num_kv_heads * (m.swa.head_dim + m.swa.v_head_dim) * 4 * m.window
    assert (per_token, window) == (TOKEN_BYTES, WINDOW_BYTES)
    assert SHORT * per_token + window <= STAGING < 2 * (SHORT * per_token + window)
    assert LONG * per_token + window > STAGING


def stage_hog(c: Cluster, tiny_dir: Path, n: int, addr: str | None = None) -> str:
    """Stage a transfer of ``n`` tokens' KV on the decode worker (``addr``: that one) that no
    Generate claims (as a prefill worker would, over ``KVTransfer.Push``): it holds staging
    until aborted."""
    from services.transport import GrpcKVSender
    from swaserve.config import FULL, SWA
    from swaserve.transfer.kv_transfer import KVPayload

    m = ModelConfig.from_pretrained(tiny_dir)
    layers = {FULL: len(m.full_layers), SWA: len(m.swa_layers)}
    p = KVPayload("hog", n, m.window)
    for kind, shape in ((FULL, m.full), (SWA, m.swa)):
        lo, hi = p.token_range(kind)
        p.kv[kind] = [
            (torch.zeros(hi - lo, shape.num_kv_heads, shape.head_dim),
             torch.zeros(hi - lo, shape.num_kv_heads, shape.v_head_dim))
            for _ in range(layers[kind])
        ]  # fmt: skip
    if addr is None:
        (addr,) = c.worker_addresses["decode"]

    async def send() -> None:
        sender = GrpcKVSender(4, layers)  # WORKER_ARGS' page size
        try:
            await sender.send(addr, p)
        finally:
            await sender.close()

    asyncio.run(send())
    return addr


def test_staging_full_is_a_503_and_an_error_event(small: Cluster, tiny_dir: Path) -> None:
    url = small.url
    ok = httpx.post(f"{url}/v1/completions", json=body(prompt(SHORT, 1)), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6, ok.text
    addr = stage_hog(small, tiny_dir, SHORT)  # staging now has no room for another SHORT prompt
    before = scrape(url)

    r = httpx.post(f"{url}/v1/completions", json=body(prompt(SHORT, 2)), timeout=60)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "overloaded" and err["type"] == "server_error"
    assert "staging full" in err["message"] and "retry later" in err["message"], err

    # streamed: the prefill worker's first token reached the client before the KV was refused
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body(prompt(SHORT, 3), stream=True), timeout=60
    ) as s:
        assert s.status_code == 200
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    first, last = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["finish_reason"] is None  # the first token
    assert last["error"]["code"] == "overloaded" and "staging full" in last["error"]["message"], last
    assert len(events) == 3, events

    after = scrape(url)
    # a retry never goes back to the worker that failed it: the only decode worker refused each
    # request once, and each got its 503 at once
    overloaded = value(after, "swaserve:router_retries_total", reason="overloaded")
    assert overloaded - value(before, "swaserve:router_retries_total", reason="overloaded") == 0
    assert "no other decode worker to retry it on" in err["message"], err
    unavailable = value(after, "swaserve:router_requests_total", status="unavailable")
    assert unavailable - value(before, "swaserve:router_requests_total", status="unavailable") == 2
    assert value(after, "swaserve:router_requests_total", status="failed") == 0

    with grpc.insecure_channel(addr) as ch:  # the hog goes: room again
        wgrpc.WorkerStub(ch).Abort(pb.AbortRequest(request_id="hog"), timeout=10)
    again = httpx.post(f"{url}/v1/completions", json=body(prompt(SHORT, 4)), timeout=60)
    assert again.status_code == 200, again.text  # nothing stayed staged
    wait_idle(small)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_whose_kv_is_larger_than_the_staging_is_a_400(small: Cluster, stream: bool) -> None:
    """No retry can stage it: a 400 naming the limit (a 503 made clients retry in vain), up front
    from the decode worker's reported limit, so a stream gets it before any event too."""
    url = small.url
    before = scrape(url)
    limit = (STAGING - WINDOW_BYTES) // TOKEN_BYTES  # 80 prompt tokens
    reported = {w["role"]: w["max_transfer_tokens"] for w in workers(url).values()}
    assert reported == {"prefill": None, "decode": limit}, reported
    r = httpx.post(f"{url}/v1/completions", json=body(prompt(limit + 1, 5), stream=stream), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "too long for this deployment's decode workers" in err["message"], err
    assert f"at most {limit} prompt tokens, --staging-memory" in err["message"], err
    after = scrape(url)
    invalid = value(after, "swaserve:router_requests_total", status="invalid")
    assert invalid - value(before, "swaserve:router_requests_total", status="invalid") == 1
    retries = [
        sum(v for (n, _), v in m.items() if n == "swaserve:router_retries_total") for m in (before, after)
    ]
    assert retries[0] == retries[1]  # refused before any attempt
    ok = httpx.post(f"{url}/v1/completions", json=body(prompt(limit, 5), stream=stream), timeout=60)
    assert ok.status_code == 200, ok.text  # the longest prompt that fits is served
    assert "error" not in ok.text
    # one token (or none, echo): the prefill worker answers alone, no KV is handed to decode
    for extra in ({"max_tokens": 1}, {"max_tokens": 0, "echo": True, "logprobs": 1}):
        one = httpx.post(
            f"{url}/v1/completions", json=body(prompt(limit + 1, 5), stream=stream, **extra), timeout=60
        )
        assert one.status_code == 200 and "error" not in one.text, (extra, one.text)
    wait_idle(small)


def test_a_prompt_only_a_larger_staging_holds_goes_to_that_decode_worker(
    small: Cluster, tiny_dir: Path
) -> None:
    """A second decode worker with 4x the staging: prompts over the first one's limit go to it
    only (no failed transfer, no retry), streamed or not; its staging full, a 503 "overloaded"
    (a retry cannot go to the small one). With it down, such a prompt is a 503
    before any stream event (not a 400: the deployment takes it once that worker is back)."""
    url = small.url
    limit, big = ((n - WINDOW_BYTES) // TOKEN_BYTES for n in (STAGING, 4 * STAGING))  # 80, 464
    addr, svc = extra_worker(small, "decode", "decode-big", "--staging-memory", str(4 * STAGING))
    try:
        r = httpx.post(f"{url}/workers", json={"url": addr, "role": "decode"}, timeout=60)
        assert r.status_code in (200, 201), r.text
        assert workers(url)[addr]["max_transfer_tokens"] == big
        before = scrape(url)
        for stream in (False, True):
            for seed in range(3):
                r = httpx.post(
                    f"{url}/v1/completions", json=body(prompt(limit + 40, seed), stream=stream), timeout=60
                )
                assert r.status_code == 200 and "error" not in r.text, r.text
        after = scrape(url)
        retries = [
            sum(v for (n, _), v in m.items() if n == "swaserve:router_retries_total") for m in (before, after)
        ]
        assert retries[0] == retries[1]  # never sent to the small one
        stage_hog(small, tiny_dir, 400, addr)  # the big one's staging full for such a prompt now
        r = httpx.post(f"{url}/v1/completions", json=body(prompt(limit + 40, 6)), timeout=60)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "overloaded" and "retry later" in err["message"], err  # not "no worker"
        svc.kill()
        assert svc.proc is not None
        svc.proc.wait(timeout=30)
        # the router has not polled since: the first such request finds it gone (a 503)
        r = httpx.post(f"{url}/v1/completions", json=body(prompt(limit + 40, 7)), timeout=60)
        assert r.status_code == 503, r.text
        assert workers(url)[addr]["state"] == "down"
        for stream in (False, True):
            r = httpx.post(
                f"{url}/v1/completions", json=body(prompt(limit + 40, 8), stream=stream), timeout=60
            )
            assert r.status_code == 503, r.text  # up front: no stream, no first token
            err = r.json()["error"]
            assert err["code"] == "no_worker_available", err
            assert f"at most {limit}" in err["message"] and "reachable" in err["message"], err
        r = httpx.post(f"{url}/v1/completions", json=body(prompt(limit, 9)), timeout=60)
        assert r.status_code == 200, r.text  # the small one still serves what it holds
    finally:
        svc.stop()
        httpx.request("DELETE", f"{url}/workers", json={"url": addr}, timeout=30)
    wait_idle(small)


def test_unreachable_decode_worker_is_a_503(small: Cluster) -> None:
    url = small.url
    decode = small.services["decode-0"]
    decode.kill()
    assert decode.proc is not None
    decode.proc.wait(timeout=30)
    before = scrape(url)
    # the router has not polled since: the prefill runs, its KV push finds no decode worker
    r = httpx.post(f"{url}/v1/completions", json=body(prompt(SHORT, 5)), timeout=60)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_worker_available" and "no decode worker available" in err["message"], err
    assert "no other decode worker to retry it on" in err["message"], err
    after = scrape(url)
    assert (  # not retried on the worker that failed it
        value(after, "swaserve:router_retries_total", reason="unavailable")
        - value(before, "swaserve:router_retries_total", reason="unavailable")
        == 0
    )
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503  # it knows now
