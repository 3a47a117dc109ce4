"""Workers that hang, and workers added and removed at runtime, on a real cluster: two routers on
the launcher's Redis (their own key namespace), 2 prefill + 1 decode workers on the tiny
checkpoint, a short poll deadline (``--poll-timeout 2 --hung-polls 2``: a stopped worker is marked
down within about 2 x 2.2 s) and a request timeout of 120 s that every client here undercuts (60 s):
a request that completes completed before the request timeout.

In file order on one cluster: a SIGSTOPped prefill worker (its requests finish on the other one,
token-identical); the SIGSTOPped only decode worker mid-stream (not resumed on it: an error event
at once, not a hang); bad ``/workers`` input; a prefill worker added on router A that router B routes to, removed on B and
left alone by A (its index entries gone); a decode worker with a shorter --max-model-len lowering
the router's (/v1/models, default max_tokens, the context check); a decode worker removed while a stream runs on it (the
stream finishes: a drain); a worker of another model (a copy of the checkpoint with another RoPE
base) and a worker already registered under another name (``localhost:P``) refused; a third
router started with those as flag workers, keeping them out, then left without a usable prefill
worker (503 ``no_worker_available``); a worker removed while Redis is down (this router only,
said in the response; the other router follows once Redis is back, empty). Stopped workers are
continued and extra ones stopped, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from transformers import AutoTokenizer

from swaserve.config import ModelConfig
from swaserve.launcher import Cluster
from swaserve.model.identity import model_identity
from swaserve.model.multimodal import media_digest
from swaserve.procs import ServiceProcess, free_port, http_ready
from swaserve.redis_server import RedisServer
from tests.helpers.cluster import (
    CLIENT_TIMEOUT,
    MODEL,
    WORKER_ARGS,
    extra_worker,
    metric,
    prompt,
    retried,
    running,
    scrape,
    wait_for,
    wait_idle,
    workers,
)

pytestmark = pytest.mark.cluster  # starts routers, workers and Redis (``Cluster``) as child processes

NS = f"test-workers-{uuid.uuid4().hex[:8]}"
ROUTER_ARGS = ["--request-timeout", "120", "--poll-interval", "0.2", "--poll-timeout", "2", "--hung-polls", "2",
               "--block-tokens", "16", "--namespace", NS]  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Cluster]:
    monkeypatch_module.delenv("REDIS_URL", raising=False)  # the last test restarts the launcher's Redis
    c = Cluster(tiny_dir, prefill=2, decode=1, routers=2, worker_args=WORKER_ARGS, router_args=ROUTER_ARGS)
    with running(c):
        yield c


def body(prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body(prompt, max_tokens), timeout=CLIENT_TIMEOUT)
    assert r.status_code == 200, r.text
    return dict(r.json())


def stream_events(url: str, prompt: list[int], max_tokens: int = 8) -> list[Any]:
    events = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body(prompt, max_tokens, stream=True), timeout=CLIENT_TIMEOUT
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_ids(events: list[Any]) -> list[int]:
    return [
        t for e in events if e != "[DONE]" and "choices" in e for t in e["choices"][0].get("token_ids") or []
    ]


def dispatched(url: str, role: str, addr: str) -> float:
    return metric(url, "swaserve:router_dispatches_total", role=role, worker=addr)


def all_up(c: Cluster) -> None:
    """Every router sees every worker of the cluster up."""
    addrs = [a for role in ("prefill", "decode") for a in c.worker_addresses[role]]
    for u in c.urls:
        wait_for(
            f"workers up on {u}", lambda u=u: all(workers(u).get(a, {}).get("state") == "up" for a in addrs)
        )


def leases_left(c: Cluster) -> int:
    assert c.redis_url is not None
    r = redis.Redis.from_url(c.redis_url, decode_responses=True)
    return sum(int(r.hlen(k)) for k in r.scan_iter(match="{" + NS + "}:lease:*"))


# ---------------------------------------------------------------------------------------------
# hung workers


def test_requests_on_a_hung_prefill_worker_finish_on_the_other(cluster: Cluster) -> None:
    url = cluster.urls[0]
    p = prompt(1, 90)
    before = {a: dispatched(url, "prefill", a) for a in cluster.worker_addresses["prefill"]}
    want = complete(url, p)  # unaffected: on one worker, which now has the prompt cached
    target = next(a for a in before if dispatched(url, "prefill", a) > before[a])
    other = next(a for a in before if a != target)
    name = f"prefill-{cluster.worker_addresses['prefill'].index(target)}"
    base = {a: dispatched(url, "prefill", a) for a in before}
    down_before = retried(url, "worker_down")

    cluster.services[name].kill(signal.SIGSTOP)  # the router still believes it is up
    try:

        async def both() -> tuple[dict[str, Any], list[Any]]:
            return await asyncio.gather(
                asyncio.to_thread(complete, url, p), asyncio.to_thread(stream_events, url, p)
            )

        got, events = asyncio.run(both())
        # both went to the stopped worker (cache affinity), were cancelled there when the router
        # marked it down, and finished on the other one
        assert dispatched(url, "prefill", target) - base[target] == 2
        assert dispatched(url, "prefill", other) - base[other] == 2
        assert retried(url, "worker_down") - down_before == 2
        assert workers(url)[target]["state"] == "down"
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        assert got["usage"]["completion_tokens"] == 8
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
        assert streamed_ids(events) == want["choices"][0]["token_ids"]
    finally:
        cluster.services[name].kill(signal.SIGCONT)
    all_up(cluster)
    wait_idle(cluster)  # the stopped worker dropped the cancelled requests when it resumed
    wait_for("leases released", lambda: leases_left(cluster) == 0, 30)


def test_a_hung_decode_worker_ends_a_started_stream_with_an_error_event(cluster: Cluster) -> None:
    # the only decode worker: once a poll finds it down, the request is not resumed on it (a retry
    # never goes back to the worker that failed it) and the stream ends with a 503-class error
    # event at once (tests/services/router/test_router_resume.py: resumes that succeed)
    url = cluster.urls[0]
    unavailable = metric(url, "swaserve:router_requests_total", status="unavailable")
    resumed = retried(url, "resumed")
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body(prompt(2, 20), 3000, stream=True), timeout=CLIENT_TIMEOUT
    ) as r:
        assert r.status_code == 200
        events: list[Any] = []
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 3:  # decoding: tokens reached the client
                    cluster.services["decode-0"].kill(signal.SIGSTOP)
                    break
        try:
            rest = [ln[len("data: ") :] for ln in lines if ln.startswith("data: ")]
        finally:
            cluster.services["decode-0"].kill(signal.SIGCONT)
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert "marked down" in err["message"] and err["type"] == "server_error", err
    assert "interrupted after" in err["message"] and err["code"] == "no_worker_available", err
    assert sum(len(e["choices"][0]["token_ids"] or []) for e in events) < 3000
    after = metric(url, "swaserve:router_requests_total", status="unavailable")
    assert "no other decode worker to retry it on" in err["message"], err
    assert after - unavailable == 1 and retried(url, "resumed") - resumed == 0
    all_up(cluster)
    wait_idle(cluster)
    wait_for("leases released", lambda: leases_left(cluster) == 0, 30)


# ---------------------------------------------------------------------------------------------
# workers added and removed at runtime


def test_bad_worker_requests_are_4xx(cluster: Cluster) -> None:
    url = cluster.urls[0]
    p0, d0 = cluster.worker_addresses["prefill"][0], cluster.worker_addresses["decode"][0]
    cases = [
        ({"url": "127.0.0.1:1", "role": "encoder"}, 400, "invalid_role"),
        ({"url": "http://127.0.0.1:5000", "role": "prefill"}, 400, "invalid_worker_url"),
        ({"url": "127.0.0.1", "role": "prefill"}, 400, "invalid_worker_url"),
        ({"url": f"127.0.0.1:{free_port()}", "role": "prefill"}, 400, "worker_unreachable"),
        ({"url": d0, "role": "prefill"}, 409, "worker_exists"),
        ({"url": p0, "role": "decode"}, 409, "worker_exists"),
    ]
    for req, status, code in cases:
        r = httpx.post(f"{url}/workers", json=req, timeout=30)
        assert r.status_code == status and r.json()["error"]["code"] == code, (req, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(f"{url}/workers", json={"url": p0}, timeout=10)
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.delete(f"{url}/workers", params={"url": "127.0.0.1:1"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
    r = httpx.delete(f"{url}/workers", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    again = httpx.post(f"{url}/workers", json={"url": f"grpc://{p0}", "role": "prefill"}, timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "already registered", again.text
    assert set(workers(url)) == {*cluster.worker_addresses["prefill"], *cluster.worker_addresses["decode"]}


def test_worker_added_on_one_router_and_removed_on_the_other(cluster: Cluster) -> None:
    a, b = cluster.urls
    addr, svc = extra_worker(cluster, "prefill", "prefill-extra", "--schedule-policy", "compute")
    try:
        r = httpx.post(f"{a}/workers", json={"url": addr, "role": "decode"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "role_mismatch", r.text
        r = httpx.post(f"{a}/workers", json={"url": addr, "role": "prefill"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "added" and r.json()["shared"] is True and "note" not in r.json()
        # the check's GetLoad is its first poll: the response shows it as it is
        added = r.json()["worker"]
        assert (added["state"], added["reason"], added["running"], added["waiting"]) == ("up", None, 0, 0), (
            added
        )
        assert added["queue_order"] == "compute" and added["boot_id"], added
        assert added["model_fingerprint"] == httpx.get(f"{a}/workers", timeout=10).json()["model_fingerprint"]
        for u in (a, b):  # B learns it from the shared registry
            wait_for(f"{addr} up on {u}", lambda u=u: workers(u).get(addr, {}).get("state") == "up")
        w = workers(b)[addr]
        assert (w["role"], w["instance"], w["source"], w["bucket"]) == (
            "prefill",
            addr,
            "registry",
            [0, None],
        )
        assert workers(b)[cluster.worker_addresses["prefill"][1]]["source"] == "flag"  # [0] was re-added

        async def burst(url: str, seed: int) -> None:  # load counted at dispatch spreads a burst
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
                rs = await asyncio.gather(
                    *(
                        client.post(f"{url}/v1/completions", json=body(prompt(seed + k, 40), 4))
                        for k in range(6)
                    )
                )
            assert all(x.status_code == 200 for x in rs), [x.text for x in rs]

        asyncio.run(burst(b, 100))
        assert dispatched(b, "prefill", addr) >= 1  # router B routes to the worker added on A
        assert redis.Redis.from_url(cluster.redis_url or "").hlen("{" + NS + "}:i:" + addr) > 0

        r = httpx.delete(f"{b}/workers", params={"url": addr}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] in ("removed", "draining"), r.text
        for u in (a, b):  # drained (nothing was in flight) and gone on both routers
            wait_for(f"{addr} gone from {u}", lambda u=u: addr not in workers(u))
        assert redis.Redis.from_url(cluster.redis_url or "").hlen("{" + NS + "}:i:" + addr) == 0
        before = dispatched(a, "prefill", addr)
        asyncio.run(burst(a, 200))
        assert dispatched(a, "prefill", addr) == before  # router A stopped using it
        up = [dict(labels)["worker"] for name, labels in scrape(a) if name == "swaserve:worker_up"]
        assert sorted(up) == sorted(cluster.worker_addresses["prefill"] + cluster.worker_addresses["decode"])
        r = httpx.delete(f"{a}/workers", params={"url": addr}, timeout=10)
        assert r.status_code == 404  # already removed
    finally:
        svc.stop()
    wait_idle(cluster)


def model_len(url: str) -> int:
    return int(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"])


def test_the_router_takes_the_least_max_model_len_of_its_workers(cluster: Cluster) -> None:
    """A worker whose context is shorter (its --max-model-len, or what its KV cache holds) lowers
    the router's: /v1/models, the default max_tokens and the up-front context check follow it."""
    a, _ = cluster.urls
    before = model_len(a)
    assert before > 160
    addr, svc = extra_worker(cluster, "decode", "decode-short", "--max-model-len", "160")
    try:
        r = httpx.post(f"{a}/workers", json={"url": addr, "role": "decode"}, timeout=30)
        assert r.status_code == 200, r.text
        wait_for("the router's max_model_len lowered", lambda: model_len(a) == 160)
        tokens = metric(a, "swaserve:prompt_tokens_total")
        r = httpx.post(f"{a}/v1/completions", json=body(prompt(7, 150), 20), timeout=CLIENT_TIMEOUT)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert "160" in err["message"], err
        assert metric(a, "swaserve:prompt_tokens_total") == tokens  # refused before any worker ran it
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        for _ in range(3):  # no max_tokens: the rest of 160, on either decode worker
            r = httpx.post(f"{a}/v1/chat/completions", json=chat, timeout=CLIENT_TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["total_tokens"] <= 160
        r = httpx.delete(f"{a}/workers", params={"url": addr}, timeout=30)
        assert r.status_code == 200, r.text
        wait_for("the router's max_model_len back", lambda: model_len(a) == before)
    finally:
        svc.stop()
    wait_idle(cluster)


def test_removing_a_decode_worker_lets_its_streams_finish(cluster: Cluster) -> None:
    a, b = cluster.urls
    addr, svc = extra_worker(cluster, "decode", "decode-extra")
    try:
        r = httpx.post(f"{b}/workers", json={"url": addr, "role": "decode"}, timeout=30)
        assert r.status_code == 200, r.text
        for u in (a, b):
            wait_for(f"{addr} up on {u}", lambda u=u: workers(u).get(addr, {}).get("state") == "up")
        n = 200

        async def run() -> tuple[list[list[int]], dict[str, Any]]:
            opened = asyncio.Event()
            seen = [0, 0]

            async def one(i: int, client: httpx.AsyncClient) -> list[int]:
                ids: list[int] = []
                req = body(prompt(300 + i, 20), n, stream=True)
                async with client.stream("POST", f"{a}/v1/completions", json=req) as s:
                    async for line in s.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[len("data: ") :])
                        assert "error" not in ev, ev
                        ids += ev["choices"][0]["token_ids"] or []
                        seen[i] += 1
                        if min(seen) >= 2:
                            opened.set()
                return ids

            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT) as client:
                tasks = [asyncio.create_task(one(i, client)) for i in range(2)]
                await asyncio.wait_for(opened.wait(), CLIENT_TIMEOUT)  # both are decoding
                removed = (await client.delete(f"{a}/workers", params={"url": addr})).json()
                return list(await asyncio.gather(*tasks)), removed

        streams, removed = asyncio.run(run())
        # the two streams went one to each decode worker (the second saw the first's lease)
        assert removed["status"] == "draining" and removed["worker"]["state"] == "draining", removed
        assert [len(s) for s in streams] == [n, n]  # the drained worker finished its stream
        for u in (a, b):
            wait_for(f"{addr} gone from {u}", lambda u=u: addr not in workers(u))
        assert len(complete(a, prompt(400, 20))["choices"][0]["token_ids"]) == 8
    finally:
        svc.stop()
    wait_idle(cluster)
    wait_for("leases released", lambda: leases_left(cluster) == 0, 30)


@pytest.fixture(scope="module")
def odd_worker(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A prefill worker on another model than the cluster's: the tiny checkpoint with another RoPE
    base (same shapes: it loads and runs, its outputs would silently differ). (address, its
    model fingerprint)."""
    odd = tmp_path_factory.mktemp("models") / "mimo-v2-tiny-odd"
    shutil.copytree(cluster.model, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["rope_parameters"]["full_attention"]["rope_theta"] = 1e6
    (odd / "config.json").write_text(json.dumps(cfg))
    fp = model_identity(
        ModelConfig.from_pretrained(odd), AutoTokenizer.from_pretrained(str(odd)), odd.name, media_digest(odd)
    )
    addr, svc = extra_worker(cluster, "prefill", "prefill-odd", model=odd)
    try:
        yield addr, fp.fingerprint
    finally:
        svc.stop()


def alias(addr: str) -> str:
    """Another name of the worker at ``addr`` (127.0.0.1:P -> localhost:P)."""
    return "localhost:" + addr.rsplit(":", 1)[1]


def test_a_worker_of_another_model_or_a_registered_process_is_refused(
    cluster: Cluster, odd_worker: tuple[str, str]
) -> None:
    a, b = cluster.urls
    odd, odd_fp = odd_worker
    mine = httpx.get(f"{a}/workers", timeout=10).json()["model_fingerprint"]
    assert mine and odd_fp != mine
    r = httpx.post(f"{a}/workers", json={"url": odd, "role": "prefill"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "model_mismatch", r.text
    assert odd_fp in err["message"] and mine in err["message"] and "mimo-v2-tiny-odd" in err["message"], err
    for addr, role in (
        (cluster.worker_addresses["prefill"][0], "prefill"),
        (cluster.worker_addresses["decode"][0], "decode"),
    ):
        r = httpx.post(f"{a}/workers", json={"url": alias(addr), "role": role}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 409 and err["code"] == "worker_exists" and addr in err["message"], r.text
    everyone = {*cluster.worker_addresses["prefill"], *cluster.worker_addresses["decode"]}
    seen = [workers(u) for u in (a, b)]
    for ws in seen:  # nothing was added; each worker's queue order, model and process are shown
        assert set(ws) == everyone
        for w in ws.values():
            assert (w["state"], w["reason"], w["queue_order"], w["model_fingerprint"]) == (
                "up",
                None,
                "fcfs",
                mine,
            )
            assert w["model"].startswith(f"{MODEL}: vocab 512"), w
        assert len({w["boot_id"] for w in ws.values()}) == len(everyone)
    assert {x: w["boot_id"] for x, w in seen[0].items()} == {x: w["boot_id"] for x, w in seen[1].items()}


def test_a_router_keeps_refused_flag_workers_out_and_names_a_missing_role(
    cluster: Cluster, odd_worker: tuple[str, str]
) -> None:
    """A router (no Redis) started with one prefill worker under two names and one of another
    model: it uses one name, keeps the others out (errors, not failed requests); without a
    usable prefill worker, requests and /health are 503 no_worker_available naming the role."""
    odd, odd_fp = odd_worker
    p0, d0 = cluster.worker_addresses["prefill"][0], cluster.worker_addresses["decode"][0]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "services.router", "--model", str(cluster.model), "--port", str(port),
           "--prefill", p0, "--prefill", alias(p0), "--prefill", odd, "--decode", d0, "--poll-interval", "0.2",
           "--poll-timeout", "2", "--hung-polls", "2", "--block-tokens", "16", "--request-timeout", "120"]  # fmt: skip
    svc = ServiceProcess("router-flags", cmd, http_ready(url))
    svc.start()
    try:
        svc.wait_ready(120)
        ws = workers(url)  # vetted before the router served anything
        used = [x for x in (p0, alias(p0)) if ws[x]["state"] == "up"]
        assert used == [min(p0, alias(p0))], ws  # the smallest name: every router picks the same
        twin = alias(p0) if used[0] == p0 else p0
        assert ws[twin]["state"] == "down" and ws[twin]["reason"].startswith("duplicate: "), ws[twin]
        assert used[0] in ws[twin]["reason"] and ws[twin]["boot_id"] == ws[used[0]]["boot_id"]
        assert ws[odd]["state"] == "down" and ws[odd]["reason"].startswith("model_mismatch: "), ws[odd]
        assert odd_fp in ws[odd]["reason"]
        for k in range(3):
            assert len(complete(url, prompt(600 + k, 30))["choices"][0]["token_ids"]) == 8
        assert dispatched(url, "prefill", used[0]) == 3
        assert dispatched(url, "prefill", twin) == dispatched(url, "prefill", odd) == 0

        r = httpx.delete(f"{url}/workers", params={"url": used[0]}, timeout=30)
        assert r.status_code == 200 and "warning" not in r.json(), r.text
        wait_for(f"{twin} used instead", lambda: workers(url)[twin]["state"] == "up", 30)
        r = httpx.delete(f"{url}/workers", params={"url": twin}, timeout=30)
        assert r.status_code == 200 and "last prefill worker" in r.json()["warning"], r.text
        for r in (
            httpx.post(f"{url}/v1/completions", json=body(prompt(610, 30)), timeout=CLIENT_TIMEOUT),
            httpx.get(f"{url}/health", timeout=10),
        ):
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == "no_worker_available", r.text
            assert err["message"].startswith("no prefill worker") and "model_mismatch" in err["message"], err
        assert dispatched(url, "prefill", odd) == 0

        r = httpx.post(f"{url}/workers", json={"url": p0, "role": "prefill"}, timeout=30)
        assert r.status_code == 200 and r.json()["worker"]["state"] == "up", r.text
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        assert len(complete(url, prompt(611, 30))["choices"][0]["token_ids"]) == 8
    finally:
        svc.stop()
    wait_idle(cluster)


def test_a_change_made_while_redis_is_down_reaches_the_other_router_when_it_is_back(cluster: Cluster) -> None:
    a, b = cluster.urls
    p1 = cluster.worker_addresses["prefill"][1]
    server = cluster.redis_server
    assert isinstance(server, RedisServer)
    server.stop()
    r = httpx.delete(f"{a}/workers", params={"url": p1}, timeout=30)
    assert r.status_code == 200 and r.json()["shared"] is False, r.text
    assert "unreachable" in r.json()["note"] and "this router only" in r.json()["note"]
    wait_for(f"{p1} gone from {a}", lambda: p1 not in workers(a))
    assert httpx.get(f"{a}/workers", timeout=10).json()["registry"] == "local"
    assert workers(b)[p1]["state"] == "up"  # B cannot know yet
    before = dispatched(a, "prefill", p1)
    assert len(complete(a, prompt(500, 30))["choices"][0]["token_ids"]) == 8  # A serves without it
    assert dispatched(a, "prefill", p1) == before

    again = RedisServer(port=server.port).start()  # empty: no persistence
    cluster.services["redis"] = again.proc
    cluster.redis_server = again
    # A writes its change into the new Redis at its next sync; B merges it and drains the worker
    wait_for(f"{p1} gone from {b}", lambda: p1 not in workers(b))
    r = httpx.post(f"{b}/workers", json={"url": p1, "role": "prefill"}, timeout=30)
    assert r.status_code == 200 and r.json()["shared"] is True, r.text
    all_up(cluster)
    wait_idle(cluster)


def test_a_worker_of_another_kv_format_is_refused(cluster: Cluster) -> None:
    """Prefill pages go to decode workers unconverted and unre-paged: a worker storing int8 KV pages,
    pages of another size or every layer's whole KV cannot join workers storing the model dtype in 4-token pages (400
    kv_format_mismatch naming both); /workers shows each worker's format."""
    a = cluster.urls[0]
    ws = workers(a)
    assert {w["kv_format"] for w in ws.values()} == {"float32 full=auto swa=auto page=4"}, ws
    int8 = "'float32 full=int8/g0/scale=f32-after-data swa=int8/g0/scale=f32-after-data page=4'"
    for name, args, theirs, flag in [
        ("decode-int8", ("--kv-cache-dtype", "int8"), int8, "--kv-cache-dtype"),
        ("decode-page8", ("--page-size", "8"), "'float32 full=auto swa=auto page=8'", "--page-size"),
        (
            "decode-full",
            ("--kv-layout", "full"),
            "'float32 full=auto swa=auto page=4 layout=full'",
            "--kv-layout",
        ),
    ]:
        addr, svc = extra_worker(cluster, "decode", name, *args)
        try:
            r = httpx.post(f"{a}/workers", json={"url": addr, "role": "decode"}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "kv_format_mismatch", r.text
            assert theirs in err["message"] and flag in err["message"], err["message"]
            assert "'float32 full=auto swa=auto page=4'" in err["message"]
            assert set(workers(a)) == set(ws)  # nothing was added
        finally:
            svc.stop()
