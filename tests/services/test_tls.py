"""TLS and tokens on a real cluster (``swaserve up``'s ``Cluster``, the flags passed through): a
throwaway CA (``tests.helpers.tls``) issues the workers' certificate (for the one name
``swaserve-worker``, as a chart issues it; pods change IPs) and the router's (127.0.0.1). A
prefill and a decode worker serve gRPC with TLS (``--grpc-tls-cert/key``), push KV to each other
over TLS (``--grpc-tls-ca``, ``--grpc-tls-server-name``) and answer health probes in plaintext on
``--health-port``; the router dials them with the CA and the name, serves HTTPS
(``--ssl-certfile/keyfile``) and has an API key and an admin token (from its environment).

Checked: a completion through all of it; clients without the CA are refused on HTTPS and on the
worker gRPC port (plaintext, another trust store, or the CA without the name the certificate was
issued for); the admin token guards ``/workers`` (401/403) and does not open ``/v1``; neither secret
appears in any process's output, command line or ``/metrics``."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.tls import Dialer
from swaserve.launcher import Cluster, _option_value
from swaserve.procs import ServiceProcess
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc
from tests.helpers.cluster import MODEL, WORKER_ARGS, running
from tests.helpers.tls import CA

pytestmark = pytest.mark.cluster  # starts a router and workers as child processes

KEY = "sk-api-tls-3e8b1d07c4a9f526"
ADMIN = "adm-tls-9f4c2a71e6b3d058"
NAME = "swaserve-worker"  # the one name in the workers' certificate


@dataclass
class TlsCluster:
    cluster: Cluster
    ca: Path
    health: dict[str, str]  # role -> host:port of its plaintext health port

    @property
    def url(self) -> str:
        return self.cluster.url  # https://127.0.0.1:PORT

    @property
    def workers(self) -> dict[str, str]:  # role -> host:port (TLS)
        return {role: a[0] for role, a in self.cluster.worker_addresses.items()}

    @property
    def metrics(self) -> list[str]:  # every /metrics URL, the router's last
        return [*self.cluster.metrics_urls.values(), f"{self.url}/metrics"]

    def client(self, secret: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, verify=ssl.create_default_context(cafile=self.ca),
                            headers=headers, timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def tls(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsCluster]:
    """``swaserve up``'s ``Cluster`` with the TLS flags passed through (it probes TLS workers on a
    health port it adds, and the router over HTTPS); every output line kept."""
    d = tmp_path_factory.mktemp("tls")
    ca = CA(d)
    worker, router = ca.issue("worker", dns=(NAME,)), ca.issue("router", ips=("127.0.0.1",))
    dial = ["--grpc-tls-ca", str(ca.cert), "--grpc-tls-server-name", NAME]
    c = Cluster(
        tiny_dir, prefill=1, decode=1, redis=False, api_key=KEY, admin_token=ADMIN, show_access_log=True,
        worker_args=[*WORKER_ARGS, "--num-threads", "1", "--grpc-tls-cert", str(worker.cert),
                     "--grpc-tls-key", str(worker.key), *dial],
        router_args=["--request-timeout", "60", *dial, "--ssl-certfile", str(router.cert),
                     "--ssl-keyfile", str(router.key)],
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ServiceProcess, "TAIL_LINES", None)  # the secrets check reads every line
        with running(c, timeout_s=300):
            health = {
                role: f"127.0.0.1:{_option_value(c.services[f'{role}-0'].cmd, '--health-port')}"
                for role in ("prefill", "decode")
            }
            yield TlsCluster(c, ca.cert, health)


def test_a_completion_goes_through_tls_end_to_end(tls: TlsCluster) -> None:
    """router -> prefill (TLS), prefill -> decode KV push (TLS), router -> decode (TLS), HTTPS out."""
    req = {
        "model": MODEL,
        "prompt": [5, 6, 7, 8, 9, 10],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    with tls.client(KEY) as c:
        r = c.post("/v1/completions", json=req)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    text = httpx.get(tls.cluster.metrics_urls["decode-0"], timeout=10).text
    received = [ln for ln in text.splitlines() if ln.startswith("swaserve:kv_transfer_received_bytes_total")]
    assert received and float(received[0].split()[-1]) > 0, received


def test_clients_without_the_ca_are_refused(tls: TlsCluster) -> None:
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{tls.url}/health", timeout=10)  # the system's trust store only
    with pytest.raises(httpx.TransportError):
        httpx.get(tls.url.replace("https://", "http://") + "/health", timeout=10)  # plaintext
    with open(tls.ca, "rb") as f:
        ca = f.read()
    refused = {
        "plaintext": grpc.insecure_channel(tls.workers["decode"]),
        "system trust store": grpc.secure_channel(
            tls.workers["decode"], grpc.ssl_channel_credentials(), [("grpc.ssl_target_name_override", NAME)]
        ),
        "CA, but the address as the name": grpc.secure_channel(
            tls.workers["decode"], grpc.ssl_channel_credentials(root_certificates=ca)
        ),
    }
    for why, ch in refused.items():
        with ch, pytest.raises(grpc.RpcError) as e:
            wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, why  # type: ignore[attr-defined]
    for role, addr in tls.workers.items():
        with Dialer.from_flags(tls.ca, NAME).channel(addr) as ch:
            assert wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5).role == role
        with grpc.insecure_channel(tls.health[role]) as ch:  # kubelet's probe: plaintext
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError):  # nothing but health there
                wgrpc.WorkerStub(ch).GetLoad(pb.GetLoadRequest(), timeout=5)


def test_the_admin_token_guards_the_workers_over_https(tls: TlsCluster) -> None:
    for secret, want in ((None, 401), (KEY, 403), ("nope", 403), (ADMIN, 200)):
        with tls.client(secret) as c:
            r = c.get("/workers")
        assert r.status_code == want, (secret, r.text)
    assert [w["state"] for w in r.json()["data"]] == ["up", "up"]
    for secret, want in ((None, 401), (ADMIN, 401), (KEY, 200)):
        with tls.client(secret) as c:
            assert c.get("/v1/models").status_code == want, secret
    with tls.client() as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_no_secret_in_output_command_lines_or_metrics(tls: TlsCluster) -> None:
    texts = [
        httpx.get(u, verify=ssl.create_default_context(cafile=tls.ca), timeout=10).text for u in tls.metrics
    ]
    assert "swaserve:router_requests_total" in texts[-1]
    for svc in tls.cluster.services.values():
        assert svc.proc is not None
        texts.append("\n".join(svc.tail))
        texts.append(Path(f"/proc/{svc.proc.pid}/cmdline").read_bytes().decode(errors="replace"))
    assert any("GET /workers" in t for t in texts)  # the access log was read
    for t in texts:
        assert KEY not in t and ADMIN not in t
