"""Kubernetes discovery's shell (``services.router.discovery``) with the real ``kubernetes_asyncio``
client against the fake API server (``bench.fake_kube``), in process: which pods become
workers, which leave, convergence after a dropped watch, a 410, a missed DELETED (the periodic
resync), API errors (backoff, no hang); then a router in process over discovered workers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client.exceptions import ApiException

from bench.fake_kube import FakeKube
from services.router.discovery import DiscoveryOptions, KubeDiscovery, client_config
from swaserve.routing.discovery import DiscoveredWorker

ROLE = "swaserve.io/role"


class Seen:
    """What discovery handed to its callback."""

    def __init__(self) -> None:
        self.calls: list[dict[str, DiscoveredWorker]] = []

    async def __call__(self, found: dict[str, DiscoveredWorker]) -> None:
        self.calls.append(found)

    @property
    def now(self) -> dict[str, str]:
        return {a: w.role for a, w in (self.calls[-1] if self.calls else {}).items()}


@contextlib.asynccontextmanager
async def discovering(
    tmp_path: Path, fake: FakeKube, sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, **opts: Any
) -> AsyncIterator[tuple[KubeDiscovery, Seen]]:
    """``fake`` started, discovery over it (``opts``: ``DiscoveryOptions`` fields; ``sleep``: its
    backoff sleep) once it watches."""
    await fake.start()
    seen = Seen()
    kubeconfig = str(fake.write_kubeconfig(tmp_path / "kubeconfig"))
    d = KubeDiscovery(DiscoveryOptions(namespace="default", kubeconfig=kubeconfig, **opts), seen, sleep=sleep)
    try:
        await d.start()
        await asyncio.wait_for(d.synced.wait(), 10)
        await until("the first watch", lambda: fake.open_watches == 1)
        yield d, seen
    finally:
        await asyncio.wait_for(d.stop(), 5)
        await fake.stop()


async def until(what: str, cond: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Wait for ``cond``; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


def test_ready_pods_with_a_role_become_workers_others_do_not(tmp_path: Path) -> None:
    async def run() -> None:
        fake = FakeKube()
        fake.add_pod("p0", role="prefill", port=5000)
        fake.add_pod("d0", role="decode", port=5001, ready=False)
        fake.add_pod("router-0", port=8000)  # matched by the selector, no role: not a worker
        fake.add_pod(
            "x0", role="prefill", port=5009, labels={"app.kubernetes.io/name": "other"}
        )  # not matched
        fake.add_pod("p-pending", role="prefill", port=5008, phase="Pending", ready=False, ip=None)
        async with discovering(tmp_path, fake) as (d, seen):
            assert seen.now == {"127.0.0.1:5000": "prefill"}
            fake.set_ready("d0")
            await until("d0", lambda: "127.0.0.1:5001" in seen.now)
            fake.add_pod("p1", role="prefill", ip="127.0.0.2")  # no port annotation: --worker-port
            await until("p1", lambda: "127.0.0.2:50051" in seen.now)
            assert seen.now == {
                "127.0.0.1:5000": "prefill",
                "127.0.0.1:5001": "decode",
                "127.0.0.2:50051": "prefill",
            }
            assert d.workers == {"prefill": 2, "decode": 1}
            assert d.relists == {"start": 1}  # the watch, not a LIST, brought them
            assert d.events["ADDED"] == 1 and d.events["MODIFIED"] == 1
            listed = [r for r in fake.requests if r.verb == "list"]
            assert listed[0].query["labelSelector"] == "app.kubernetes.io/name=swaserve"
            watched = next(r for r in fake.requests if r.verb == "watch").query
            assert watched["allowWatchBookmarks"].lower() == "true" and watched["resourceVersion"] == "6"

    asyncio.run(run())


def test_terminating_deleted_unready_or_unlabelled_pods_leave(tmp_path: Path) -> None:
    async def run() -> None:
        fake = FakeKube()
        for i, name in enumerate(("a", "b", "c", "d", "e")):
            fake.add_pod(name, role="decode", port=6000 + i)
        async with discovering(tmp_path, fake) as (d, seen):
            assert len(seen.now) == 5
            fake.terminate("a")  # deletionTimestamp: out at once, the pod still exists
            fake.delete_pod("b")
            fake.set_ready("c", False)
            fake.set_labels("d", {ROLE: None})
            fake.set_labels("e", {"app.kubernetes.io/name": "other"})  # the selector's watch: DELETED
            await until("all gone", lambda: seen.now == {})
            assert d.events["DELETED"] == 2 and d.workers == {"prefill": 0, "decode": 0}
            assert d.relists == {"start": 1}

    asyncio.run(run())


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_dropped_watch_lists_again_and_converges(tmp_path: Path, how: str) -> None:
    async def run() -> None:
        fake = FakeKube()
        fake.add_pod("p0", role="prefill", port=5000)
        fake.add_pod("p1", role="prefill", port=5001)
        async with discovering(tmp_path, fake, backoff_min_s=0.1) as (d, seen):
            fake.delete_pod("p0", notify=False)  # its DELETED is lost
            fake.add_pod("p2", role="prefill", port=5002, notify=False)
            await asyncio.sleep(0.3)
            assert "127.0.0.1:5000" in seen.now  # nothing told the watch
            fake.drop_watches(how)
            await until(
                "the LIST after the drop",
                lambda: seen.now == {"127.0.0.1:5001": "prefill", "127.0.0.1:5002": "prefill"},
            )
            assert d.relists["error"] == 1 and d.relists["gone"] == 0
            await until("a new watch", lambda: fake.open_watches == 1)

    asyncio.run(run())


def test_410_gone_lists_again_and_converges(tmp_path: Path) -> None:
    async def run() -> None:
        fake = FakeKube()
        fake.add_pod("p0", role="prefill", port=5000)
        async with discovering(tmp_path, fake, backoff_min_s=0.1) as (d, seen):
            fake.delete_pod("p0", notify=False)
            fake.drop_watches("gone")  # an ERROR 410 event on the open stream
            await until("p0 gone", lambda: seen.now == {})
            assert d.relists["gone"] == 1
            fake.add_pod("p1", role="prefill", port=5001, notify=False)
            fake.expire_next_watches(1)  # the watch after the next LIST starts with a 410
            fake.drop_watches("close")
            await until("p1", lambda: seen.now == {"127.0.0.1:5001": "prefill"})
            await until("the second 410", lambda: d.relists["gone"] == 2)
            await until("a watch again", lambda: fake.open_watches == 1)

    asyncio.run(run())


def test_a_missed_deleted_is_repaired_by_the_periodic_resync(tmp_path: Path) -> None:
    """production-stack #1091: a DELETED lost while the watch looks healthy."""

    async def run() -> None:
        fake = FakeKube(bookmark_s=0.2)
        fake.add_pod("p0", role="prefill", port=5000)
        fake.add_pod("d0", role="decode", port=5001)
        async with discovering(tmp_path, fake, resync_s=1.0) as (d, seen):
            fake.delete_pod("p0", notify=False)
            took = await until("the resync", lambda: seen.now == {"127.0.0.1:5001": "decode"}, timeout_s=3.0)
            assert took < 1.5 and d.relists["resync"] >= 1
            assert d.relists["error"] == 0 and d.relists["gone"] == 0 and d.events["BOOKMARK"] >= 1

    asyncio.run(run())


def test_api_errors_back_off_exponentially_and_a_healthy_stream_resets_it(tmp_path: Path) -> None:
    """The backoff's delays (0.5 s doubling to 30 s) through an injected sleep; nothing is removed
    on errors; a stream that stayed up ``healthy_s`` resets the backoff."""

    async def run() -> None:
        delays: list[float] = []

        async def sleep(s: float) -> None:
            delays.append(s)
            await asyncio.sleep(0.005)

        fake = FakeKube()
        fake.add_pod("p0", role="prefill", port=5000)
        fake.fail_next(8)  # the first LISTs answer 500
        async with discovering(tmp_path, fake, sleep=sleep, healthy_s=1.0) as (d, seen):
            assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30]
            assert d.relists == {"start": 1, "error": 8} and seen.now == {"127.0.0.1:5000": "prefill"}
            fake.fail_next(3)
            fake.drop_watches("abort")  # the watch ends at once: no reset
            await until("the LIST after the drop", lambda: d.relists["error"] == 12)
            assert delays[8:] == [30, 30, 30, 30] and seen.now == {"127.0.0.1:5000": "prefill"}
            await until("a watch", lambda: fake.open_watches == 1)
            await asyncio.sleep(1.2)  # up healthy_s: a healthy stream
            fake.delete_pod("p0", notify=False)
            fake.drop_watches("close")
            await until("p0 gone", lambda: seen.now == {})
            assert delays[12:] == [0.5] and d.relists["error"] == 13

    asyncio.run(run())


def test_an_api_server_down_for_good_is_not_hammered_and_stop_does_not_hang(tmp_path: Path) -> None:
    async def run() -> None:
        fake = FakeKube()
        await fake.start()
        fake.fail_next(1000)
        seen = Seen()
        opts = DiscoveryOptions(namespace="default", kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))
        d = KubeDiscovery(opts, seen)
        try:
            await d.start()
            await asyncio.sleep(1.2)  # LISTs at 0, 0.5, 1.5 s
            assert 2 <= len(fake.requests) <= 3 and d.relists == {"start": 1, "error": len(fake.requests) - 1}
            assert not seen.calls and not d.synced.is_set()
            await asyncio.wait_for(d.stop(), 2.0)  # in a backoff sleep: cancelled at once
        finally:
            await fake.stop()

    asyncio.run(run())


def test_the_fake_serves_the_real_client(tmp_path: Path) -> None:
    """The fake itself: list + label selectors, a watch from an old version after a compaction
    is a 410, a watch without a version starts with the current pods."""

    async def run() -> None:
        fake = FakeKube()
        await fake.start()
        try:
            fake.add_pod("p0", role="prefill")
            fake.add_pod("d0", role="decode", labels={"tier": "b"})
            cfg = await client_config(str(fake.write_kubeconfig(tmp_path / "kc")))
            async with client.ApiClient(cfg) as api:
                v1 = client.CoreV1Api(api)

                async def names(sel: str) -> list[str]:
                    pods = await v1.list_namespaced_pod("default", label_selector=sel)
                    return sorted(p.metadata.name for p in pods.items)

                assert await names(f"{ROLE}=prefill") == ["p0"]
                assert await names(f"{ROLE} in (prefill, decode),tier!=b") == ["p0"]
                assert await names("tier,!nope") == ["d0"]
                assert await names(f"{ROLE} notin (prefill)") == ["d0"]
                assert await v1.list_namespaced_pod("other") is not None
                old = (await v1.list_namespaced_pod("default")).metadata.resource_version
                fake.add_pod("p1", role="prefill")
                fake.compact()
                w = watch.Watch()
                with pytest.raises(ApiException) as e:
                    async with w.stream(
                        v1.list_namespaced_pod, "default", resource_version=old, timeout_seconds=2
                    ) as s:
                        async for _ in s:
                            pass
                assert e.value.status == 410
                w = watch.Watch()
                got = []
                async with w.stream(v1.list_namespaced_pod, "default", timeout_seconds=1) as s:
                    async for ev in s:
                        got.append((ev["type"], ev["object"].metadata.name))
                assert sorted(got) == [("ADDED", "d0"), ("ADDED", "p0"), ("ADDED", "p1")]
        finally:
            await fake.stop()

    asyncio.run(run())


def test_a_router_in_process_routes_to_discovered_workers_only(tiny_dir: Path, tmp_path: Path) -> None:
    """No pod: 503 ``no_worker_available``; pods show in /workers (source ``kubernetes``), leave
    when deleted, and DELETE /workers takes one out while its pod lives; /metrics counts."""
    from services.router.cluster import ClusterEngine
    from swaserve.api.server import build_app
    from swaserve.api.workers import install_worker_routes

    with pytest.raises(ValueError, match="at least one prefill"):
        ClusterEngine(tiny_dir, [], [])

    async def run() -> None:
        fake = FakeKube()
        await fake.start()
        opts = DiscoveryOptions(namespace="default", kubeconfig=str(fake.write_kubeconfig(tmp_path / "kc")))
        engine = ClusterEngine(tiny_dir, [], [], poll_s=0.05, poll_timeout_s=0.5, discovery=opts)
        app = build_app(engine)  # type: ignore[arg-type]
        install_worker_routes(app, engine.admin)
        req = {"model": engine.model_name, "prompt": [5, 6, 7], "max_tokens": 2}
        try:
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as c,
            ):

                async def listed() -> dict[str, str]:
                    return {w["url"]: w["source"] for w in (await c.get("/workers")).json()["data"]}

                for r in (await c.get("/health"), await c.post("/v1/completions", json=req)):
                    assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available", r.text
                fake.add_pod("p0", role="prefill", port=1)  # nothing listens there: down, but listed
                fake.add_pod("d0", role="decode", port=2)
                for _ in range(200):
                    if await listed() == {"127.0.0.1:1": "kubernetes", "127.0.0.1:2": "kubernetes"}:
                        break
                    await asyncio.sleep(0.02)
                assert await listed() == {"127.0.0.1:1": "kubernetes", "127.0.0.1:2": "kubernetes"}
                r = await c.delete("/workers", params={"url": "127.0.0.1:1"})
                assert r.status_code == 200 and r.json()["status"] == "removed", r.text
                assert await listed() == {"127.0.0.1:2": "kubernetes"}  # the pod lives, the removal holds
                fake.delete_pod("d0")
                for _ in range(200):
                    if not await listed():
                        break
                    await asyncio.sleep(0.02)
                assert await listed() == {}
                text = (await c.get("/metrics")).text
                m = engine.model_name
                assert f'swaserve:router_discovery_workers{{model_name="{m}",role="prefill"}} 1.0' in text, (
                    text
                )
                assert (
                    f'swaserve:router_discovery_relists_total{{model_name="{m}",reason="start"}} 1.0' in text
                )
                assert (
                    f'swaserve:router_discovery_events_total{{model_name="{m}",type="DELETED"}} 1.0' in text
                )
        finally:
            await fake.stop()

    asyncio.run(run())


def test_router_flags_static_needs_workers_kubernetes_needs_a_client_config(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Usage errors (exit 2) before anything starts; kubernetes mode takes no worker flag."""
    from typer.testing import CliRunner

    from services.router.__main__ import app

    def run(*args: str, kubeconfig: str = "/nonexistent") -> tuple[int, str]:
        env = {"COLUMNS": "200", "NO_COLOR": "1", "KUBECONFIG": kubeconfig, "KUBERNETES_SERVICE_HOST": ""}
        r = CliRunner().invoke(app, ["--model", str(tiny_dir), *args], env=env)
        return r.exit_code, " ".join(r.output.split())

    code, out = run("--decode", "b:1")
    assert code == 2 and "'--prefill'" in out and "--discovery kubernetes" in out, out
    code, out = run("--discovery", "k8s")
    assert code == 2 and "must be 'static' or 'kubernetes'" in out, out
    code, out = run("--discovery", "kubernetes")
    assert code == 2 and "no kubeconfig file at /nonexistent" in out, out
    kubeconfig = FakeKube(namespace="ns1")
    kubeconfig.url = "http://127.0.0.1:9"
    path = str(kubeconfig.write_kubeconfig(tmp_path / "kc"))
    code, out = run("--discovery", "kubernetes", "--policy", "nope", kubeconfig=path)  # got past discovery
    assert code == 2 and "nope" in out and "--prefill" not in out, out
