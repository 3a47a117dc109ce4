"""A worker as one router sees it (``WorkerHandle``: its channel, last ``GetLoad``, health, the
attempts in flight on it and why it is kept out of routing), one request's ``Attempt`` on its
workers, and ``parse_address`` for worker URLs. ``services.router.workers`` polls and keeps them."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import grpc

from swaserve.kvcache.stats import PoolStats
from swaserve.metrics_router import WorkerStats
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

_HOST = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)$")


def parse_address(url: str) -> str:
    """The ``host:port`` of a worker URL: ``host:port`` or ``grpc://host:port`` (IPv6 hosts in
    brackets, ``[::1]:50051``).

    Raises:
        ValueError: not of that form (another scheme, a path, no or a bad port), with the reason.
    """
    text = url.strip()
    if "://" in text:
        scheme, text = text.split("://", 1)
        if scheme.lower() != "grpc":
            raise ValueError(f"worker URL {url!r}: workers speak gRPC, use host:port or grpc://host:port")
    text = text.rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not _HOST.match(host):
        raise ValueError(f"worker URL {url!r}: expected host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker URL {url!r}: port must be a number in 1..65535")
    return f"{host}:{int(port)}"


@dataclass(eq=False)
class Attempt:
    """One attempt of a request on a prefill and a decode worker: ``wire_id`` is its request id
    on the workers (unique per attempt, so a retry never meets an earlier attempt's KV);
    ``on`` the workers it occupies; ``call`` the gRPC call being read; ``lost`` the worker
    whose going down cancelled it (None while it runs)."""

    wire_id: str
    on: set[WorkerHandle] = field(default_factory=set)
    call: grpc.aio.UnaryStreamCall | None = None
    lost: WorkerHandle | None = None

    def lose(self, w: WorkerHandle) -> None:
        """``w`` went down under this attempt: cancel its current call."""
        if self.lost is None:
            self.lost = w
        if self.call is not None:
            self.call.cancel()


@dataclass(frozen=True)
class Refusal:
    """Why a worker that answers is kept out of routing: ``code`` ``model_mismatch``,
    ``kv_format_mismatch`` or ``duplicate``; ``message`` says it for people."""

    code: str
    message: str


@dataclass(eq=False)
class WorkerHandle:
    """A worker as the router sees it."""

    address: str
    role: str
    stub: wgrpc.WorkerStub
    channel: grpc.aio.Channel
    outstanding: int = 0  # tokens of requests this router dispatched and that are not done
    healthy: bool = True
    missed: int = 0  # GetLoad polls in a row that failed
    draining: bool = False  # removed: no new requests, the ones in flight finish
    shutting_down: bool = False  # the worker drains (SIGTERM): no new requests, the ones in flight finish
    load: pb.Load | None = field(default=None, repr=False)
    attempts: set[Attempt] = field(default_factory=set, repr=False)  # this router's, in flight
    poller: asyncio.Task[None] | None = field(default=None, repr=False)
    refusal: Refusal | None = None  # kept out of routing although it answers (module docstring)
    down_reason: str | None = None  # why the last poll or call found it down
    polled: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # a poll has ended
    # request ids whose Abort it missed (hung or unreachable then): sent again once it answers
    pending_aborts: set[str] = field(default_factory=set, repr=False)

    @property
    def state(self) -> str:
        """``draining`` (removed here, or shutting down), ``up`` or ``down`` (as of the last poll
        or call; a refused worker is ``down``)."""
        if self.draining:
            return "draining"
        if not self.healthy:
            return "down"
        return "draining" if self.shutting_down else "up"

    @property
    def reason(self) -> str | None:
        """Why it is down or shutting down (None when it is up, or removed here)."""
        if self.refusal is not None:
            return f"{self.refusal.code}: {self.refusal.message}"
        if self.healthy:
            if self.shutting_down and not self.draining:
                return (
                    "shutting down: the worker drains (no new requests; its requests in flight "
                    "finish, within its --shutdown-timeout)"
                )
            return None
        if self.down_reason:
            return self.down_reason
        return "not polled yet" if self.load is None and not self.missed else "unreachable"

    def stats(self) -> WorkerStats:
        """The last ``GetLoad`` as ``/metrics`` shows it."""
        ld = self.load
        if ld is None:
            return WorkerStats(self.role, self.address, self.healthy, draining=self.state == "draining")
        pools = {
            name: PoolStats(
                total_pages=p.total_pages,
                used_pages=p.used_pages,
                peak_used_pages=p.peak_used_pages,
                page_bytes=p.page_bytes,
                num_layers=0,
                cached_pages=p.cached_pages,
                kv_format=p.kv_format or "auto",
            )
            for name, p in ld.pools.items()
        }
        return WorkerStats(
            self.role, self.address, self.healthy, ld.running, ld.waiting, ld.outstanding_tokens,
            ld.staged_bytes, pools, self.state == "draining",
        )  # fmt: skip
