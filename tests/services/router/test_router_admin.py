"""The worker URLs the router accepts, and a router without Redis (``/workers`` in process:
changes applied locally, said in the response; bad input 4xx; a role without a worker named)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from services.router.worker_handle import parse_address


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("127.0.0.1:5000", "127.0.0.1:5000"),
        (" grpc://worker-3.svc:50051/ ", "worker-3.svc:50051"),
        ("[::1]:7", "[::1]:7"),
        ("localhost:0080", "localhost:80"),
    ],
)
def test_worker_urls(url: str, want: str) -> None:
    assert parse_address(url) == want


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:5000", "gRPC"),
        ("127.0.0.1", "host:port"),
        ("127.0.0.1:http", "port"),
        ("127.0.0.1:70000", "port"),
        ("host/path:5", "host:port"),
        (":5000", "host:port"),
        ("", "host:port"),
    ],
)
def test_bad_worker_urls(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_address(url)


def test_a_router_without_redis_applies_changes_locally_and_says_so(tiny_dir: Path) -> None:
    """The router's app in process (no Redis); nothing listens on its workers' ports, so their
    handles just poll in vain (and removing needs no answer from the worker)."""
    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app
    from swaserve.api.workers import install_worker_routes

    async def run() -> None:
        engine = ClusterEngine(tiny_dir, ["127.0.0.1:1"], ["127.0.0.1:2"], poll_s=0.05)
        engine.admin.check_timeout_s = 0.5
        app = build_app(engine)  # type: ignore[arg-type]
        install_worker_routes(app, engine.admin)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c,
        ):
            listed = (await c.get("/workers")).json()
            assert [w["url"] for w in listed["data"]] == ["127.0.0.1:1", "127.0.0.1:2"]
            assert listed["registry"] == "local" and listed["data"][0]["source"] == "flag"
            r = await c.request("DELETE", "/workers", json={"url": "grpc://127.0.0.1:1"})  # a JSON body
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["status"] == "removed" and body["shared"] is False, body
            assert "applied on this router only" in body["note"] and "--redis-url" in body["note"]
            assert [w["url"] for w in (await c.get("/workers")).json()["data"]] == ["127.0.0.1:2"]
            r = await c.delete("/workers", params={"url": "127.0.0.1:1"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "worker_not_found"
            r = await c.post("/workers", json={"url": "127.0.0.1:1", "role": "prefill"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "worker_unreachable", r.text
            r = await c.post("/workers", json={"url": "127.0.0.1:1", "role": "prefill", "weight": 2})
            assert r.status_code == 400 and "weight" in r.json()["error"]["message"], r.text
            r = await c.request("DELETE", "/workers", content=b"{nope")
            assert r.status_code == 400 and "JSON" in r.json()["error"]["message"], r.text

    asyncio.run(run())


def test_a_router_without_a_worker_of_a_role_says_so(tiny_dir: Path) -> None:
    """In process, nothing listening on the workers' ports: /health and requests are 503
    ``no_worker_available`` naming the role (not ``engine_not_running``), and removing the last
    worker of a role is accepted with a warning."""
    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app
    from swaserve.api.workers import install_worker_routes

    async def run() -> None:
        engine = ClusterEngine(tiny_dir, ["127.0.0.1:1"], ["127.0.0.1:2"], poll_s=0.05)
        app = build_app(engine)  # type: ignore[arg-type]
        install_worker_routes(app, engine.admin)
        req = {"model": engine.model_name, "prompt": [5, 6, 7], "max_tokens": 2}
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c,
        ):
            # started after the workers' first polls: both are known to be down
            for r in (await c.get("/health"), await c.post("/v1/completions", json=req)):
                err = r.json()["error"]
                assert r.status_code == 503 and err["code"] == "no_worker_available", r.text
                assert "no prefill worker" in err["message"] and "127.0.0.1:1: unreachable" in err["message"]
            listed = (await c.get("/workers")).json()
            assert listed["model_fingerprint"] == engine.model.fingerprint
            assert [(w["state"], w["reason"]) for w in listed["data"]] == [("down", "unreachable")] * 2

            r = await c.delete("/workers", params={"url": "127.0.0.1:1"})
            assert r.status_code == 200 and r.json()["status"] == "removed", r.text
            assert (
                "last prefill worker" in r.json()["warning"] and "no_worker_available" in r.json()["warning"]
            )
            for r in (await c.get("/health"), await c.post("/v1/completions", json=req)):
                err = r.json()["error"]
                assert r.status_code == 503 and err["code"] == "no_worker_available", r.text
                assert err["message"].startswith("no prefill worker is in use on this router"), err
                assert "POST /workers" in err["message"]
            r = await c.delete("/workers", params={"url": "127.0.0.1:2"})
            assert r.status_code == 200 and "last decode worker" in r.json()["warning"], r.text

    asyncio.run(run())


def test_stop_applies_the_lease_releases_still_queued(tiny_dir: Path) -> None:
    """A release queued on the routing thread (a stream cancelled at shutdown) is applied before
    the app's shutdown returns: the process then exits without joining threads (``run_app``), and
    a release lost with Redis would leave a phantom lease on the worker for ``lease_ttl_s``."""
    import time

    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app

    released: list[str] = []

    def slow_release(*leases: object) -> None:
        time.sleep(0.5)
        released.extend(str(x) for x in leases)

    async def run() -> None:
        engine = ClusterEngine(tiny_dir, ["127.0.0.1:1"], ["127.0.0.1:2"], poll_s=0.05)
        engine.routing.release = slow_release  # type: ignore[method-assign]
        app = build_app(engine)  # type: ignore[arg-type]
        async with app.router.lifespan_context(app):
            engine._release("lease-a", "lease-b")  # type: ignore[arg-type]
        assert released == ["lease-a", "lease-b"]

    asyncio.run(run())
