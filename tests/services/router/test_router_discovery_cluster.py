"""A router process with ``--discovery kubernetes`` (kubeconfig to the fake API server,
``bench.fake_kube``) over real worker processes published as pods: 503
``no_worker_available`` before any pod (scale to zero), requests served once a prefill and a decode
pod are Ready, a deleted pod's worker leaves while requests go on on the others."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from bench.fake_kube import FakeKube
from swaserve.procs import ServiceProcess, free_port, grpc_ready
from tests.helpers.cluster import CLIENT_TIMEOUT, FAST_POLLS, WORKER_ARGS, metric, wait_for, workers


def _workers_answer(url: str) -> bool:
    try:
        return httpx.get(f"{url}/workers", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.cluster
@pytest.mark.slow  # deployment: the Kubernetes discovery path (as tests/deploy/test_kubelet.py)
@pytest.mark.timeout(180)
def test_a_router_follows_the_pods_it_discovers(tiny_dir: Path, tmp_path: Path) -> None:
    fake = FakeKube()
    fake.start_in_thread()
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    ports = {"p0": free_port(), "p1": free_port(), "d0": free_port()}
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode"}
    procs: dict[str, ServiceProcess] = {}
    for name, port in ports.items():
        cmd = [sys.executable, "-m", f"services.{roles[name]}", "--model", str(tiny_dir), "--port", str(port),
               "--num-threads", "1", *WORKER_ARGS]  # fmt: skip
        procs[name] = ServiceProcess(name, cmd, grpc_ready(f"127.0.0.1:{port}"))
    rport = free_port()
    url = f"http://127.0.0.1:{rport}"
    cmd = [sys.executable, "-m", "services.router", "--model", str(tiny_dir), "--port", str(rport),
           "--discovery", "kubernetes", "--discovery-namespace", "default", *FAST_POLLS]  # fmt: skip
    # KUBERNETES_SERVICE_HOST emptied: the kubeconfig even when the tests run in a pod
    env = {"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""}
    procs["router"] = ServiceProcess("router", cmd, lambda: _workers_answer(url), env=env)
    req = {"model": tiny_dir.name, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0}
    try:
        for p in procs.values():
            p.start()
        procs["router"].wait_ready(60)
        r = httpx.post(f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available", r.text
        assert httpx.get(f"{url}/health", timeout=5).status_code == 503  # /health: no worker yet
        for name in ports:
            procs[name].wait_ready(90)
        fake.add_pod("p0", role="prefill", port=ports["p0"])
        fake.add_pod("d0", role="decode", port=ports["d0"])
        fake.add_pod("p1", role="prefill", port=ports["p1"], ready=False)  # not Ready yet: not used
        addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}

        def states() -> dict[str, str]:
            return {a: w["state"] for a, w in workers(url).items()}

        wait_for("p0 and d0 up", lambda: states() == {addr["p0"]: "up", addr["d0"]: "up"}, 20)
        assert {w["source"] for w in workers(url).values()} == {"kubernetes"}
        r = httpx.post(f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]

        fake.set_ready("p1")
        wait_for("p1 up", lambda: states().get(addr["p1"]) == "up", 20)
        fake.terminate("p0")  # scale-down: deletionTimestamp, then the pod is gone
        wait_for("p0 leaves", lambda: addr["p0"] not in states(), 20)
        fake.delete_pod("p0")
        for _ in range(3):
            r = httpx.post(f"{url}/v1/completions", json=req, timeout=CLIENT_TIMEOUT)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == text, r.text
        assert states() == {addr["p1"]: "up", addr["d0"]: "up"}
        assert metric(url, "swaserve:router_discovery_workers", role="prefill") == 1
        assert metric(url, "swaserve:router_discovery_relists_total", reason="start") == 1
    finally:
        for p in procs.values():
            p.stop()
        fake.stop_thread()
