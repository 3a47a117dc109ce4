"""Runtime worker management of one router: what ``POST/DELETE/GET /workers`` (``swaserve.api.workers``)
call. A change is a worker-registry entry, applied here at once and synced through Redis to every
replica (local only without it); adding checks URL, role, reachability, model and process identity
(that ``GetLoad`` is the first poll); removing drains (a warning for the last worker of a role).
Workers found by Kubernetes discovery (``discover``) count as command-line workers.

Design notes: docs/DESIGN.md#servicesrouteradminpy"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from services.router.encoders import EncoderPool
from services.router.routing import RouterRouting
from services.router.worker_handle import WorkerHandle, parse_address
from services.router.workers import WorkerPool, in_routing
from swaserve.api.protocol import ProtocolError
from swaserve.routing.buckets import ALL_LENGTHS
from swaserve.routing.discovery import DiscoveredWorker
from swaserve.routing.registry import ACTIVE, REMOVED, ROLES, RegistryReplica, WorkerEntry
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc


class WorkerAdmin:
    """Args:
    pool: the router's workers. routing: its routing state (shared registry, buckets).
    flags: address -> role of the workers on the router's command line.
    clock: wall-clock seconds (registry stamps; compared across routers).
    check_timeout_s: deadline of the ``GetLoad`` that checks a worker being added (seconds).
    """

    def __init__(
        self,
        pool: WorkerPool,
        routing: RouterRouting,
        flags: dict[str, str],
        clock: Callable[[], float] = time.time,
        check_timeout_s: float = 5.0,
    ) -> None:
        self.pool, self.routing, self.clock = pool, routing, clock
        self.replica = RegistryReplica(flags)  # touched on the routing thread only
        self.check_timeout_s = check_timeout_s
        self.shared = False  # the shared registry answered at the last sync
        self._settled = False  # the first sync waited for the workers' first polls
        self.encoders: EncoderPool | None = None  # the router's media encoders (listed, not managed here)

    def _sync_now(self, entry: WorkerEntry | None) -> tuple[dict[str, str], bool]:
        """(routing thread) apply ``entry``, sync with the shared registry; the effective workers."""
        if entry is not None:
            self.replica.set(entry)
        shared = self.routing.sync_workers(self.replica)
        return self.replica.effective(), shared

    async def sync(self, entry: WorkerEntry | None = None) -> bool:
        """Apply ``entry`` (if any), merge with the shared registry and make the pool follow.
        Returns whether the shared registry answered."""
        effective, self.shared = await in_routing(self.routing, self._sync_now, entry)
        self.pool.apply(effective, self.replica.flags)
        if not self._settled:  # the first sync (start): know which workers to refuse first
            self._settled = True
            await self.pool.settle(self.pool.poll_timeout_s)
        return self.shared

    async def discover(self, found: Mapping[str, DiscoveredWorker]) -> None:
        """The workers Kubernetes discovery finds in use now (``services.router.discovery``): they
        replace the ones it found before, as command-line workers would, then the pool follows."""
        pairs = {addr: (w.role, w.since) for addr, w in found.items()}
        await in_routing(self.routing, self.replica.discover, pairs)
        await self.sync()

    async def _effective(self) -> dict[str, str]:
        return await in_routing(self.routing, self.replica.effective)

    def _note(self, shared: bool) -> str | None:
        if shared:
            return None
        if self.routing.registry is None:
            return "no shared registry (router started without --redis-url): applied on this router only"
        return (
            "the shared registry (Redis) is unreachable: applied on this router only; "
            "written to the registry when Redis is back"
        )

    # -- the endpoints ------------------------------------------------------------------------
    async def add_worker(self, url: str, role: str) -> dict[str, Any]:
        """Add (or re-add) a worker; returns the response body.

        Raises:
            ProtocolError: bad role or URL (400: ``invalid_role``, ``invalid_worker_url``); the
                address already serves the other role, or the worker process is registered
                under another address (409 ``worker_exists``); the worker does not answer
                (400 ``worker_unreachable``), reports another role (400 ``role_mismatch``) or
                another model (400 ``model_mismatch``), another KV format than the workers in
                routing (400 ``kv_format_mismatch``).
        """
        if role not in ROLES:
            raise ProtocolError(
                f"role must be 'prefill' or 'decode', got {role!r}", param="role", code="invalid_role"
            )
        address = self._address(url)
        w = self.pool.handles.get(address)
        if w is not None and w.role != role and not w.draining:
            raise ProtocolError(
                f"worker {address} is registered as a {w.role} worker; remove it first",
                param="url", code="worker_exists", status=409,
            )  # fmt: skip
        load = await self._check(address, w)
        if load.role and load.role != role:
            raise ProtocolError(
                f"worker {address} is a {load.role} worker, not a {role} worker",
                param="role", code="role_mismatch",
            )  # fmt: skip
        mismatch = self.pool.mismatch(load)
        if mismatch is not None:
            raise ProtocolError(f"worker {address}: {mismatch}", param="url", code="model_mismatch")
        mismatch = self.pool.kv_format_mismatch(address, load)
        if mismatch is not None:
            raise ProtocolError(f"worker {address}: {mismatch}", param="url", code="kv_format_mismatch")
        twin = self.pool.same_process(address, load)
        if twin is not None:
            raise ProtocolError(
                f"worker {address} is the same process (boot id {load.boot_id[:12]}) as worker "
                f"{twin.address}, already registered as a {twin.role} worker",
                param="url", code="worker_exists", status=409,
            )  # fmt: skip
        was = w is not None and not w.draining and (await self._effective()).get(address) == role
        shared = await self.sync(WorkerEntry(address, role, ACTIVE, self.clock()))
        now = self.pool.handles.get(address)
        if now is not None and now.role == role and not now.draining:
            await self.pool.record(now, load)  # the check's answer is its first poll
        out = {"status": "already registered" if was else "added", "worker": self.describe(address)}
        return self._with_note(out, shared)

    async def remove_worker(self, url: str) -> dict[str, Any]:
        """Remove a worker: it drains (no new requests; those in flight finish); returns the
        response body.

        The last worker of its role that could serve is removed too, with a ``warning`` in the
        body: requests fail (503 ``no_worker_available``) until one is added.

        Raises:
            ProtocolError: bad URL (400), no such worker in use on this router (404).
        """
        address = self._address(url)
        role = (await self._effective()).get(address)
        if role is None:
            w = self.pool.handles.get(address)
            if w is not None and w.draining:
                return self._with_note({"status": "draining", "worker": self.describe(address)}, self.shared)
            raise ProtocolError(
                f"no worker {address} is in use on this router",
                param="url",
                code="worker_not_found",
                status=404,
            )
        shared = await self.sync(WorkerEntry(address, role, REMOVED, self.clock()))
        gone = address not in self.pool.handles  # nothing in flight here: it left at once
        body = {
            "status": "removed" if gone else "draining",
            "worker": self.describe(address)
            or {"url": address, "instance": address, "role": role, "state": "removed"},
        }
        warning = self._last_of_role(address, role)
        if warning:
            body["warning"] = warning
        return self._with_note(body, shared)

    def _last_of_role(self, removed: str, role: str) -> str | None:
        """A warning when no worker of ``role`` that could serve is left after ``removed`` went
        (None: one is)."""
        others = [
            w
            for w in self.pool.handles.values()
            if w.role == role and w.address != removed and not w.draining
            and (w.refusal is None or w.refusal.code not in ("model_mismatch", "kv_format_mismatch"))
        ]  # fmt: skip
        if not others:
            return (
                f"{removed} was the last {role} worker on this router: requests fail with 503 "
                f"no_worker_available until one is added (POST /workers)"
            )
        if not any(w.healthy or w.refusal is not None for w in others):  # a duplicate takes over
            names = ", ".join(sorted(w.address for w in others))
            return (
                f"no other {role} worker is up ({names}): requests fail with 503 no_worker_available "
                "until one is back or another is added (POST /workers)"
            )
        return None

    def list_workers(self) -> dict[str, Any]:
        """Every worker this router knows (draining ones included) and where changes are kept."""
        model = self.pool.model
        return {
            "object": "list",
            "data": [self.describe(a) for a in sorted(self.pool.handles)],
            "registry": "shared" if self.shared else "local",
            "model_fingerprint": model.fingerprint if model is not None else None,  # the router's
            "model": model.description if model is not None else None,
            "encoders": self.encoders.describe() if self.encoders is not None else [],
        }

    # -- helpers ------------------------------------------------------------------------------
    def _with_note(self, body: dict[str, Any], shared: bool) -> dict[str, Any]:
        body["shared"] = shared
        note = self._note(shared)
        if note:
            body["note"] = note
        return body

    def _address(self, url: str) -> str:
        try:
            return parse_address(url)
        except ValueError as e:
            raise ProtocolError(str(e), param="url", code="invalid_worker_url") from None

    async def _check(self, address: str, w: WorkerHandle | None) -> pb.Load:
        """The worker's ``GetLoad`` (its own channel if the router has one)."""
        ch = None if w is not None else self.pool.dialer.aio_channel(address)
        stub = w.stub if w is not None else wgrpc.WorkerStub(ch)
        try:
            return await stub.GetLoad(pb.GetLoadRequest(), timeout=self.check_timeout_s)
        except grpc.aio.AioRpcError as e:
            raise ProtocolError(
                f"worker {address} does not answer ({e.code().name}: {e.details()}); is it running and ready?",
                param="url", code="worker_unreachable",
            ) from None  # fmt: skip
        finally:
            if ch is not None:
                await ch.close()

    def describe(self, address: str) -> dict[str, Any] | None:
        """One worker as ``GET /workers`` lists it (None if this router has no such worker)."""
        w = self.pool.handles.get(address)
        if w is None:
            return None
        bucket: list[int | None] | None = None
        if w.role == "prefill":
            lo, hi = self.routing.buckets.range_of(address)
            bucket = [lo, None if hi >= ALL_LENGTHS[1] else hi]
        ld = w.load
        return {
            "url": address,
            "instance": address,  # its name in the prefix index, leases and metrics labels
            "role": w.role,
            "state": w.state,
            "source": self.replica.source(address),
            "bucket": bucket,  # prompt tokens [lo, hi) it serves; hi None: no bound (prefill)
            "reason": w.reason,  # why it is down (refused: "model_mismatch: ..." / "duplicate: ...")
            "in_flight": len(w.attempts),  # this router's requests on it
            "running": ld.running if ld is not None else None,
            "waiting": ld.waiting if ld is not None else None,
            "queue_order": (ld.queue_order or "fcfs") if ld is not None else None,  # prefill: fcfs/compute
            "model_fingerprint": (ld.model_fingerprint or None) if ld is not None else None,
            "model": (ld.model_description or None) if ld is not None else None,
            "kv_format": (ld.kv_format or None) if ld is not None else None,  # dtype and page formats
            "boot_id": (ld.boot_id or None) if ld is not None else None,  # its process
            "steps": ld.steps if ld is not None else None,  # its engine's progress: steps run
            "computed_tokens": ld.computed_tokens if ld is not None else None,  # ... tokens computed
            "max_model_len": (ld.max_model_len or None) if ld is not None else None,
            # decode: the longest prompt whose KV fits its whole staging (--staging-memory)
            "max_transfer_tokens": (ld.max_transfer_tokens or None) if ld is not None else None,
        }
