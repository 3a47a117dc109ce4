"""``swaserve up``: the disaggregated cluster (router + prefill and decode workers) as local processes.

Each service (``python -m services.prefill|decode|router``) runs on 127.0.0.1 and a free port (the
routers' HTTP on ``host``; the first on ``port`` when given, checked before any worker starts; an
API key and an admin token reach the routers through their environment, never their command lines),
output prefixed by its name (``[prefill-0] ...``). Workers are ready when ``grpc.health.v1`` says
SERVING (a TLS worker, ``--grpc-tls-cert`` among its arguments: on its plaintext ``--health-port``,
one picked here unless given), the router when ``GET /health`` answers 200 (HTTPS with
``--ssl-certfile`` among the router's arguments). Every child has its own process group and gets SIGTERM when the
launcher dies (``PR_SET_PDEATHSIG``); ``Cluster.stop`` terminates all (SIGKILL after a grace period).

With ``gcache`` nodes (``python -m services.gcache``, the L3 KV cache) the launcher starts them
before the workers, on free ports, registered in the cluster's Redis under the routers' namespace
(``--namespace``, default ``swaserve``), NVMe slot files under the run's temporary directory
unless ``gcache_nvme_dir`` is given, and gives every prefill worker ``--l3-url
redis://...?namespace=NS``, the weights' identity (``--weights-id``: their digest, computed once
here) and a host tier when it has none (L3 sits behind it). Routers credit L3 hits in precise
index mode (the nodes' block events are in their index)."""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from swaserve.cpus import usable_cpus
from swaserve.front_options import ADMIN_TOKEN_ENV, API_KEY_ENV
from swaserve.procs import ClusterError, ServiceProcess, free_port, grpc_ready, http_ready, stop_all

DEFAULT_NAMESPACE = "swaserve"  # the routers' --namespace default
L3_HOST_CACHE = "256MiB"  # a prefill worker's --host-cache-memory with GCache when none is given


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Raise ClusterError unless ``host:port`` can be bound now (with SO_REUSEADDR, as uvicorn
    binds: a port some old connection left in TIME_WAIT counts as free, a listening one not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ClusterError(
                f"router port {host}:{port} is not available: {e.strerror or e} "
                "(pass --port with a free port, or --port 0 for any)"
            ) from e


def connect_host(host: str) -> str:
    """The address to reach a server bound to ``host`` on this machine (a wildcard: loopback)."""
    wildcard = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}
    host = wildcard.get(host, host)
    return f"[{host}]" if ":" in host else host


def l3_url(redis_url: str, namespace: str) -> str:
    """The engine's ``--l3-url`` for the GCache nodes registered in ``redis_url`` under ``namespace``."""
    return f"{redis_url}{'&' if '?' in redis_url else '?'}namespace={namespace}"


def _option_value(args: list[str], name: str) -> str | None:
    """The value of ``--name V`` / ``--name=V`` in ``args`` (the last one), else None."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


@dataclass
class Cluster:
    """``routers`` routers + ``prefill`` prefill workers + ``decode`` decode workers on 127.0.0.1,
    sharing their routing state in Redis.

    Args:
        model: checkpoint dir (all services load it). prefill, decode, routers: process counts.
        port: first router's HTTP port (0 = a free one; the others always get free ones).
        worker_args / prefill_args / decode_args / router_args: extra command-line arguments.
        redis: share routing state in Redis: ``redis_url`` if given (or ``REDIS_URL``), else a
            local ``redis-server`` started first (``swaserve.redis_server``). Without it each
            router keeps its own state (fine for one router).
        index_mode: "approximate" or "precise" (prefill workers publish cache events to Redis).
        host: the routers' HTTP bind address (``--router-arg=--host=...`` wins).
        api_key: the routers' ``--api-key``, handed over in their environment (``API_KEY_ENV``).
        admin_token: the routers' ``--admin-token``, the same way (``ADMIN_TOKEN_ENV``).
        gcache: GCache (L3) nodes to start (0: none; module docstring); needs Redis.
        gcache_dram / gcache_nvme: each node's DRAM / NVMe tier bytes (None: the node's defaults).
        gcache_nvme_dir: node i's NVMe tier in ``DIR/gcache-i`` (kept: a restart recovers it);
            None: under a temporary directory of this run, removed by ``stop``.
        gcache_args: extra node arguments.
    """

    model: Path
    prefill: int = 1
    decode: int = 1
    port: int = 0
    worker_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    prefill_ranges: list[str] = field(default_factory=list)  # --prompt-len-range of prefill worker i
    routers: int = 1
    redis: bool = True
    redis_url: str | None = None
    index_mode: str = "approximate"
    show_access_log: bool = False
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    admin_token: str | None = field(default=None, repr=False)
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    worker_addresses: dict[str, list[str]] = field(default_factory=dict)  # role -> host:port
    metrics_urls: dict[str, str] = field(default_factory=dict)  # worker name -> Prometheus URL
    url: str = ""  # the first router's
    urls: list[str] = field(default_factory=list)  # every router's
    redis_server: object | None = None  # the RedisServer we started, if any
    gcache: int = 0
    gcache_dram: int | None = None
    gcache_nvme: int | None = None
    gcache_nvme_dir: Path | None = None
    gcache_args: list[str] = field(default_factory=list)
    gcache_addresses: list[str] = field(default_factory=list)  # node i's gRPC host:port
    encoders: int = 0  # media encoder workers (services.encoder)
    encoder_args: list[str] = field(default_factory=list)
    encoder_addresses: list[str] = field(default_factory=list)
    namespace: str = ""  # the routers' Redis namespace (set by ``start``)
    tmp_dir: Path | None = None  # this run's temporary directory (created with GCache nodes)

    def _worker(self, role: str, i: int, extra: list[str]) -> tuple[str, ServiceProcess]:
        port, mport = free_port(), free_port()
        addr = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", f"services.{role}", "--model", str(self.model), "--port", str(port),
               "--metrics-port", str(mport), *self.worker_args, *extra]  # fmt: skip
        if not any(a.startswith("--num-threads") for a in cmd):
            # workers share the machine's cores: more torch threads than cores make OpenMP spin
            # against each other (measured 10-20x slower prefill on 2 cores)
            cmd += ["--num-threads", str(max(1, usable_cpus() // (self.prefill + self.decode)))]
        self.metrics_urls[f"{role}-{i}"] = f"http://127.0.0.1:{mport}/metrics"
        probe = addr
        if _option_value(cmd, "--grpc-tls-cert") is not None:  # TLS: probe its plaintext health port
            hport = _option_value(cmd, "--health-port")
            if hport is None:
                hport = str(free_port())
                cmd += ["--health-port", hport]
            probe = f"127.0.0.1:{hport}"
        return addr, ServiceProcess(f"{role}-{i}", cmd, grpc_ready(probe))

    def start(self, timeout_s: float = 600.0) -> str:
        """Start every service and wait until all are ready; returns the router's URL.

        Raises:
            ClusterError: the router's port is taken (checked before any worker starts), or a
                service exited or was not ready in time.
        """
        host = _option_value(self.router_args, "--host") or self.host
        if self.port:
            check_port_free(self.port, host)
        if self.index_mode not in ("approximate", "precise"):
            raise ClusterError(f"index mode must be 'approximate' or 'precise', got {self.index_mode!r}")
        if self.redis and self.redis_url is None:
            from swaserve.redis_server import RedisServer, redis_url_from_env

            self.redis_url = redis_url_from_env()
            if self.redis_url is None:
                server = RedisServer()
                self.services["redis"] = server.proc
                self.redis_server = server
                server.start(timeout_s)
                self.redis_url = server.url
        if len(self.prefill_ranges) > self.prefill:
            raise ClusterError(
                f"{len(self.prefill_ranges)} prompt-length ranges for {self.prefill} prefill workers"
            )
        if self.index_mode == "precise" and not self.redis_url:
            raise ClusterError("precise index mode needs Redis")
        shared = ["--redis-url", self.redis_url] if self.redis and self.redis_url else []
        if self.index_mode == "precise":
            self.prefill_args = [*self.prefill_args, *shared]
        self.namespace = _option_value(self.router_args, "--namespace") or DEFAULT_NAMESPACE
        if self.gcache:
            self._start_gcache()
            self.prefill_args = [*self.prefill_args, *self._l3_args()]
        if self.encoders:
            self._start_encoders()
        addrs: dict[str, list[str]] = {"prefill": [], "decode": []}
        self.worker_addresses = addrs
        for role, n, extra in (
            ("prefill", self.prefill, self.prefill_args),
            ("decode", self.decode, self.decode_args),
        ):
            for i in range(n):
                bucket = (
                    ["--prompt-len-range", self.prefill_ranges[i]]
                    if role == "prefill" and i < len(self.prefill_ranges)
                    else []
                )
                addr, svc = self._worker(role, i, [*extra, *bucket])
                addrs[role].append(addr)
                self.services[svc.name] = svc
                svc.start()
        for svc in list(self.services.values()):
            svc.wait_ready(timeout_s)
        routers = []
        for i in range(self.routers):
            port = self.port if (i == 0 and self.port) else free_port()
            scheme = "https" if _option_value(self.router_args, "--ssl-certfile") else "http"
            url = f"{scheme}://{connect_host(host)}:{port}"
            self.urls.append(url)
            cmd = [sys.executable, "-m", "services.router", "--model", str(self.model), "--host", host,
                   "--port", str(port)]  # fmt: skip
            for role in ("prefill", "decode"):
                for a in addrs[role]:
                    cmd += [f"--{role}", a]
            for a in self.encoder_addresses:
                cmd += ["--encoder", a]
            cmd += [*shared, "--index-mode", self.index_mode, *self.router_args]
            name = "router" if self.routers == 1 else f"router-{i}"
            secrets = ((API_KEY_ENV, self.api_key), (ADMIN_TOKEN_ENV, self.admin_token))
            env = {name: value for name, value in secrets if value is not None}
            router = ServiceProcess(name, cmd, http_ready(url), self.show_access_log, env)
            self.services[name] = router
            routers.append(router)
            router.start()
        for router in routers:
            router.wait_ready(timeout_s)
        self.url = self.urls[0]
        return self.url

    def _start_encoders(self) -> None:
        """Start the media encoders (readiness is awaited with the workers'); TLS flags given to
        the workers are theirs too."""
        if self.encoders < 0:
            raise ClusterError(f"encoders must be >= 0, got {self.encoders}")
        tls = []
        for flag in ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-tls-ca"):
            v = _option_value(self.worker_args, flag)
            if v is not None:
                tls += [flag, v]
        threads = max(1, usable_cpus() // (self.prefill + self.decode + self.encoders))
        for i in range(self.encoders):
            port, mport = free_port(), free_port()
            name = f"encoder-{i}"
            cmd = [sys.executable, "-m", "services.encoder", "--model", str(self.model), "--host", "127.0.0.1",
                   "--port", str(port), "--metrics-port", str(mport), "--num-threads", str(threads),
                   *tls, *self.encoder_args]  # fmt: skip
            self.encoder_addresses.append(f"127.0.0.1:{port}")
            probe = f"127.0.0.1:{port}"
            if tls:  # TLS: probe its plaintext health port, as the workers'
                hport = str(free_port())
                cmd += ["--health-port", hport]
                probe = f"127.0.0.1:{hport}"
            svc = ServiceProcess(name, cmd, grpc_ready(probe))
            self.metrics_urls[name] = f"http://127.0.0.1:{mport}/metrics"
            self.services[name] = svc
            svc.start()

    def _start_gcache(self) -> None:
        """Start the GCache nodes (readiness is awaited with the workers')."""
        if self.gcache < 0:
            raise ClusterError(f"GCache nodes must be >= 0, got {self.gcache}")
        if not (self.redis and self.redis_url):
            raise ClusterError("GCache nodes need Redis (they register there): drop --no-redis")
        base = self.gcache_nvme_dir
        if base is None:
            self.tmp_dir = Path(tempfile.mkdtemp(prefix="swaserve-up-"))
            base = self.tmp_dir
        sizes = [
            (flag, v)
            for flag, v in (("--dram", self.gcache_dram), ("--nvme", self.gcache_nvme))
            if v is not None
        ]
        for i in range(self.gcache):
            port, mport = free_port(), free_port()
            name = f"gcache-{i}"
            cmd = [sys.executable, "-m", "services.gcache", "--host", "127.0.0.1", "--port", str(port),
                   "--metrics-port", str(mport), "--redis-url", self.redis_url, "--namespace", self.namespace,
                   "--node-id", name, "--nvme-dir", str(Path(base) / name)]  # fmt: skip
            for flag, v in sizes:
                cmd += [flag, str(v)]
            svc = ServiceProcess(name, [*cmd, *self.gcache_args], grpc_ready(f"127.0.0.1:{port}"))
            self.gcache_addresses.append(f"127.0.0.1:{port}")
            self.metrics_urls[name] = f"http://127.0.0.1:{mport}/metrics"
            self.services[name] = svc
            svc.start()

    def _l3_args(self) -> list[str]:
        """What the prefill workers need for the GCache nodes, unless given: ``--l3-url``,
        ``--weights-id`` (the weights' digest, read once here rather than by every worker) and a
        host tier (``L3_HOST_CACHE``)."""
        assert self.redis_url is not None
        given = [*self.worker_args, *self.prefill_args]
        out = []
        if _option_value(given, "--l3-url") is None:
            out += ["--l3-url", l3_url(self.redis_url, self.namespace)]
        if _option_value(given, "--weights-id") is None:
            from swaserve.model.identity import weights_digest

            try:
                out += ["--weights-id", weights_digest(self.model)]
            except OSError as e:
                raise ClusterError(f"cannot read the weights of {self.model} for their digest: {e}") from e
        if _option_value(given, "--host-cache-memory") is None:
            out += ["--host-cache-memory", L3_HOST_CACHE]
        return out

    def watch(self) -> int:
        """Block until every router has exited (returns the last one's status). A worker, a router
        or Redis that exits is reported and left out: routers fail over to the other workers (and
        answer 503 when a role has none), clients to the other routers, and routers without Redis
        go on with their local routing state."""
        reported: set[str] = set()
        while True:
            code: int | None = None
            for name, svc in self.services.items():
                if svc.alive() or name in reported:
                    continue
                code = svc.proc.returncode if svc.proc is not None else None
                reported.add(name)
                print(f"{name} exited with status {code}; the others go on", flush=True)
            routers = [n for n in self.services if n.startswith("router")]
            if all(n in reported for n in routers):
                return code if code is not None else 1
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the routers first (no new requests), then the workers (their last writes to L3),
        then the GCache nodes, then Redis; remove this run's temporary directory."""
        rank = {"router": 0, "gcache": 2, "redis": 3}
        groups: dict[int, list[ServiceProcess]] = {}
        for name, svc in self.services.items():
            groups.setdefault(rank.get(name.split("-")[0], 1), []).append(svc)
        for _, group in sorted(groups.items()):  # each group's drains overlap
            stop_all(group)
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            self.tmp_dir = None

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
