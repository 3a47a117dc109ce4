"""Child service processes: ``ServiceProcess`` (own process group, SIGTERM when the parent dies
via ``setpriv --pdeathsig``, output prefixed by its name, a readiness check, stop with a grace
period), readiness checks over gRPC health and HTTP ``/health``, and ``free_port``. Used by the
launcher, the local Redis server, the demo, benches and tests.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

import httpx

_ACCESS_LOG = re.compile(r'"(GET|POST) [^"]* HTTP/[0-9.]+" \d{3}')


_HANDED_OUT: set[int] = set()
_LOW_PORT = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take theirs there)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_RANGE_ENV = "SWASERVE_PORT_RANGE"  # "LOW-HIGH": where free_port draws (HIGH excluded)


def port_range() -> tuple[int, int]:
    """[low, high) where ``free_port`` draws: ``SWASERVE_PORT_RANGE`` ("LOW-HIGH", e.g. one slice
    per test worker so parallel runs never draw the same port), else 10000 up to the kernel's
    ephemeral range. Raises ValueError for a malformed or empty range."""
    spec = os.environ.get(PORT_RANGE_ENV)
    if not spec:
        return _LOW_PORT, _ephemeral_low()
    try:
        low, high = (int(x) for x in spec.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LOW-HIGH, e.g. 10000-20000") from None
    if not 0 < low < high <= 65536:
        raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected 0 < LOW < HIGH <= 65536")
    return low, high


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a child to bind later.

    Taken at random from ``port_range()`` (below the kernel's ephemeral range unless
    ``SWASERVE_PORT_RANGE`` says otherwise) and never twice by this process: a port the kernel
    hands out (``bind(0)``) is also where outgoing connections get theirs, so one made between
    this call and the child's bind could take it (a CI run lost a worker to ``Address already in
    use`` that way). Falls back to ``bind(0)`` when the range is smaller than 1000 ports or full.
    """
    low, high = port_range()
    if high - low >= 1000:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(low, high)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    _HANDED_OUT.add(port)
    return port


def _with_parent_death_signal(cmd: list[str]) -> list[str]:
    """``cmd`` run through util-linux ``setpriv --pdeathsig TERM`` where it exists (Linux): the
    child gets SIGTERM when this process dies, set before ``cmd`` is exec'ed. Not a
    ``preexec_fn``: Python code between fork and exec can deadlock in a process with threads
    (it takes the at-fork locks; seen here as a test run hung in ``_fork_exec`` for good), and it
    keeps subprocess off its vfork path. Without setpriv the callers' ``stop()`` is the only guard."""
    setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
    return [setpriv, "--pdeathsig", "TERM", "--", *cmd] if setpriv else cmd


class ClusterError(RuntimeError):
    """A service exited or did not become ready in time."""


class ServiceProcess:
    """One child service with prefixed, filtered output and a readiness check.

    Args:
        name: log prefix, e.g. ``prefill-0``. cmd: the command line.
        ready: returns True once the service is ready (called repeatedly).
        show_access_log: pass HTTP access lines through (normally hidden).
        env: variables set for the child on top of this process's environment (secrets such as
            an API key go here, not on ``cmd``: command lines show in ``ps`` and logs).

    ``TAIL_LINES``: output lines kept in ``tail`` (error reports; None: all of them).
    """

    TAIL_LINES: int | None = 40

    def __init__(
        self,
        name: str,
        cmd: list[str],
        ready: Callable[[], bool],
        show_access_log: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.name, self.cmd, self.ready = name, cmd, ready
        self.show_access_log = show_access_log
        self.env = dict(env or {})
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            _with_parent_death_signal(self.cmd),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._pump, name=f"{self.name}-output", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.tail.append(line)
            if self.show_access_log or not _ACCESS_LOG.search(line):
                print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> None:
        """Raises ClusterError if the process exits or is not ready within ``timeout_s``."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self._join_reader()
                raise ClusterError(
                    f"{self.name} exited with status {code} before it was ready:\n{self._tail()}"
                )
            if self.ready():
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self._tail()}")
            time.sleep(0.25)

    def _tail(self) -> str:
        return "\n".join(f"  | {line}" for line in self.tail) or "  (no output)"

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=2.0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the service's process group (tests: a worker dying)."""
        if self.alive():
            assert self.proc is not None
            os.killpg(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; idempotent."""
        stop_all([self], grace_s)

    def _signal(self, sig: int) -> bool:
        """Signal the process group if the process still runs; returns whether it did."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True


def stop_all(services: Sequence[ServiceProcess], grace_s: float = 15.0) -> None:
    """Stop ``services`` together: SIGTERM every process group, wait up to ``grace_s`` for all of
    them (their drains overlap), SIGKILL the ones left and wait up to 5 s more; idempotent."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        signalled = [svc for svc in services if svc._signal(sig)]
        deadline = time.monotonic() + wait_s
        for svc in signalled:
            assert svc.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                svc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for svc in services:
        svc._join_reader()


def grpc_ready(address: str) -> Callable[[], bool]:
    """Readiness of a worker: its overall ``grpc.health.v1`` status is SERVING."""

    def check() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(address) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2.0
                )
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    return check


def http_ready(url: str) -> Callable[[], bool]:
    """Readiness of a router: ``GET /health`` answers 200. Over ``https://`` the certificate is
    not verified (as a kubelet's HTTPS probe): the probe asks our own child whether it is up."""

    def check() -> bool:
        try:
            verify = not url.startswith("https://")
            return httpx.get(f"{url}/health", timeout=2.0, verify=verify).status_code == 200
        except httpx.HTTPError:
            return False

    return check
