"""This router's workers: one ``WorkerHandle`` per worker address, one ``GetLoad`` poll loop each,
hung-worker detection that cancels the calls in flight, and the drain of a removed worker.

A refused poll marks a worker down at once, ``hung_polls`` missed ``poll_timeout_s`` deadlines in a
row too; each answer is vetted (another model, or a process already in use under another address:
refused, kept out of routing with its reason). Attempts registered on a worker marked down are
cancelled. A worker that says it is draining (shutting down: ``Load.draining``, or a Generate
refused as draining) gets no new requests; its attempts in flight go on. Channels: ``Dialer``
(plaintext or TLS). Liveness, cancellation, drain, refusal: docs/DESIGN.md#servicesrouterworkerspy"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grpc

from services.convert import ENGINE_NOT_RUNNING
from services.router.routing import RouterRouting
from services.router.worker_handle import Attempt, Refusal, WorkerHandle
from services.tls import Dialer
from swaserve.model.identity import ModelIdentity
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.router")
POLL_TIMEOUT_S = 10.0  # GetLoad deadline: a CPU engine step can take seconds
HUNG_POLLS = 3  # deadlines in a row before a worker that accepts connections counts as down
ABORT_TIMEOUT_S = 5.0
MAX_PENDING_ABORTS = 4096  # per worker: missed aborts kept for its return (more: its TTLs free them)
R = TypeVar("R")


def _addr(w: WorkerHandle) -> str:
    return w.address


async def in_routing(routing: RouterRouting, fn: Callable[..., R], *args: Any) -> R:
    """Run a (blocking: Redis) routing call on the routing thread."""
    return await asyncio.get_running_loop().run_in_executor(routing.executor, fn, *args)


def _boot(w: WorkerHandle) -> str:
    return w.load.boot_id[:12] if w.load is not None and w.load.boot_id else "?"


def _duplicate(boot_id: str, used: str) -> Refusal:
    return Refusal(
        "duplicate",
        f"the same worker process (boot id {boot_id[:12]}) as {used}, which is used instead; remove "
        "one of the two names",
    )


class WorkerPool:
    """The workers of one router (module docstring).

    Args:
        routing: the routing state (heartbeats, buckets, index entries of workers).
        poll_s: seconds between a worker's polls. poll_timeout_s: a poll's deadline (seconds).
        hung_polls: deadlines missed in a row that mark a worker down.
        model: the router's model; workers reporting another are refused (None: not checked).
        dialer: how channels to workers are opened (default: plaintext).

    Raises:
        ValueError: bad poll settings.
    """

    def __init__(
        self,
        routing: RouterRouting,
        poll_s: float = 1.0,
        poll_timeout_s: float = POLL_TIMEOUT_S,
        hung_polls: int = HUNG_POLLS,
        model: ModelIdentity | None = None,
        dialer: Dialer | None = None,
    ) -> None:
        if poll_timeout_s <= 0 or hung_polls < 1:
            raise ValueError("poll_timeout_s must be > 0 and hung_polls >= 1")
        self.routing, self.model = routing, model
        self.dialer = dialer or Dialer()
        self.poll_s, self.poll_timeout_s, self.hung_polls = poll_s, poll_timeout_s, hung_polls
        self.handles: dict[str, WorkerHandle] = {}  # address -> handle, draining ones included
        self._tasks: set[asyncio.Task[Any]] = set()  # background work (drain ends)

    # -- membership ---------------------------------------------------------------------------
    def add(self, address: str, role: str, healthy: bool = True) -> WorkerHandle:
        """Start using a worker (its poll loop starts now; needs a running loop). ``healthy``:
        whether it counts as up before its first poll."""
        ch = self.dialer.aio_channel(address)
        w = WorkerHandle(address, role, wgrpc.WorkerStub(ch), ch, healthy=healthy)
        self.handles[address] = w
        w.poller = asyncio.create_task(self._poll_worker(w), name=f"poll-{address}")
        return w

    def apply(self, effective: Mapping[str, str], flags: Mapping[str, str]) -> None:
        """Make the handles follow ``effective`` (address -> role: the registry over the flags):
        add new workers (flag workers count as up before their first poll, registry ones not),
        drain the ones no longer there, take back a draining one that was re-added. A worker
        re-added under another role is drained first and added once it has left."""
        for addr, role in effective.items():
            w = self.handles.get(addr)
            if w is None:
                log.info("%s worker %s added", role, addr)
                self.add(addr, role, healthy=addr in flags)
            elif w.role != role:
                self.drain(w)
            elif w.draining:
                log.info("%s worker %s is back in use", role, addr)
                w.draining = False
        for addr, w in list(self.handles.items()):
            if addr not in effective:
                self.drain(w)

    def drain(self, w: WorkerHandle) -> None:
        """No new requests to ``w``; it leaves when its requests in flight have finished."""
        if w.draining:
            return
        w.draining = True
        log.info("%s worker %s removed: draining %d requests", w.role, w.address, len(w.attempts))
        if w.role == "prefill":
            self._spawn(in_routing(self.routing, self.routing.drop_index, w.address))
        self._maybe_leave(w)

    def _maybe_leave(self, w: WorkerHandle) -> None:
        if w.draining and not w.attempts and self.handles.get(w.address) is w:
            del self.handles[w.address]
            self._spawn(self._leave(w))

    async def _leave(self, w: WorkerHandle) -> None:
        if w.poller is not None:
            w.poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await w.poller
        await in_routing(self.routing, self.routing.forget, w.address, w.role)
        await w.channel.close()
        log.info("%s worker %s drained and left", w.role, w.address)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every poll loop and close every channel."""
        for w in self.handles.values():
            if w.poller is not None:
                w.poller.cancel()
        for w in list(self.handles.values()):
            if w.poller is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await w.poller
            await w.channel.close()
        self.handles = {}
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until every worker has been polled once, so the ones to
        refuse are known before requests come (start)."""
        waits = [asyncio.create_task(w.polled.wait()) for w in self.handles.values() if not w.polled.is_set()]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # -- selection ----------------------------------------------------------------------------
    def up(self, role: str) -> bool:
        """Some worker of ``role`` is in use, not shutting down, and looked reachable at its last
        poll or call."""
        return any(
            w.role == role and w.healthy and not w.draining and not w.shutting_down
            for w in self.handles.values()
        )

    def max_model_len(self, default: int) -> int:
        """The longest prompt + output every worker in use takes (``Load.max_model_len``, the
        least of theirs; a worker lowers it to what its KV cache holds); ``default`` (the model's)
        before any has reported one."""
        lens = [
            w.load.max_model_len
            for w in self.handles.values()
            if not w.draining
            and not w.shutting_down
            and w.refusal is None
            and w.load is not None
            and w.load.max_model_len
        ]
        return min([default, *lens])

    def max_transfer_tokens(self, reachable: bool = False) -> int | None:
        """The longest prompt some decode worker in use can stage (``Load.max_transfer_tokens``,
        the most of theirs; ``reachable``: of those that looked reachable at their last poll or
        call); None before any has reported one."""
        lens = [
            w.load.max_transfer_tokens
            for w in self.handles.values()
            if w.role == "decode"
            and not w.draining
            and not w.shutting_down
            and w.refusal is None
            and (w.healthy or not reachable)
            and w.load is not None
            and w.load.max_transfer_tokens
        ]
        return max(lens) if lens else None

    def missing(self, role: str) -> str | None:
        """Why no worker of ``role`` can take requests now, for the client (None: one can)."""
        if self.up(role):
            return None
        mine = sorted((w for w in self.handles.values() if w.role == role and not w.draining), key=_addr)
        if not mine:
            return (
                f"no {role} worker is in use on this router (none given, discovered or added, or the "
                f"last one left): requests fail until one is (a Ready pod, or POST /workers)"
            )
        states = "; ".join(f"{w.address}: {w.reason}" for w in mine)
        return f"no {role} worker can take requests ({states})"

    def candidates(
        self, role: str, avoid: set[WorkerHandle], transfer_tokens: int = 0
    ) -> dict[str, WorkerHandle]:
        """Workers of ``role`` a request may go to: the reachable ones not in ``avoid`` (the
        workers that failed this request), else the unreachable-looking ones not in it (a poll may
        be behind). Never one in ``avoid``, even when it is the only one; never a draining (removed
        or shutting down) or refused worker; with ``transfer_tokens``, never a decode worker whose
        whole staging holds less (``Load.max_transfer_tokens``). Empty: the request cannot go
        anywhere (docs/DESIGN.md#servicesrouterclusterpy)."""
        mine = [
            w
            for w in self.handles.values()
            if w.role == role
            and not w.draining
            and not w.shutting_down
            and w.refusal is None
            and w not in avoid
            and (
                w.load is None
                or not w.load.max_transfer_tokens
                or w.load.max_transfer_tokens >= transfer_tokens
            )
        ]
        pool = [w for w in mine if w.healthy] or mine
        return {w.address: w for w in pool}

    # -- attempts -----------------------------------------------------------------------------
    def begin(self, wire_id: str, *workers: WorkerHandle) -> Attempt:
        """Register a new attempt on ``workers``."""
        att = Attempt(wire_id)
        for w in workers:
            att.on.add(w)
            w.attempts.add(att)
        return att

    def leave(self, att: Attempt, w: WorkerHandle) -> None:
        """``att`` no longer occupies ``w`` (a prefill whose part is done)."""
        att.on.discard(w)
        w.attempts.discard(att)
        self._maybe_leave(w)

    def end(self, att: Attempt) -> None:
        """``att`` is over (finished, failed or cancelled)."""
        for w in list(att.on):
            self.leave(att, w)
        att.call = None

    def mark_down(self, w: WorkerHandle, why: str) -> None:
        """``w`` is down: cancel the calls of every attempt on it (module docstring)."""
        if w.healthy:
            log.warning("%s worker %s %s", w.role, w.address, why)
        w.healthy, w.down_reason = False, why
        if w.attempts:
            log.warning("%s worker %s down: cancelling %d requests on it", w.role, w.address, len(w.attempts))
        for att in list(w.attempts):
            att.lose(w)

    # -- polls --------------------------------------------------------------------------------
    async def _poll_worker(self, w: WorkerHandle) -> None:
        """One worker's poll loop (a hung worker delays only its own polls)."""
        while True:
            await self.poll_one(w)
            await asyncio.sleep(self.poll_s)

    async def poll_one(self, w: WorkerHandle) -> None:
        """One ``GetLoad`` of ``w``: load, liveness and refusal (module docstring), then the
        routing state's heartbeat."""
        try:
            load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=self.poll_timeout_s)
        except grpc.aio.AioRpcError as e:
            w.missed += 1
            hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.missed >= self.hung_polls
            if hung:
                self.mark_down(w, f"not answering for {w.missed} polls")
            elif e.code() == grpc.StatusCode.UNAVAILABLE:  # refused, or its engine is not running
                details = e.details() or ""
                self.mark_down(w, details if details.startswith(ENGINE_NOT_RUNNING) else "unreachable")
            await self._observe(w)
        else:
            await self.record(w, load)
            if w.pending_aborts and w.healthy:
                await self._resend_aborts(w)

    async def abort(self, w: WorkerHandle, wire_id: str, timeout_s: float = ABORT_TIMEOUT_S) -> None:
        """Abort ``wire_id`` on ``w`` (its engine request, a decode worker's staged KV). One that
        ``w`` cannot take now (hung, unreachable) is kept and sent again after its next answered
        poll: else a worker back from a stall kept that request's staged KV until its TTL."""
        try:
            await w.stub.Abort(pb.AbortRequest(request_id=wire_id), timeout=timeout_s)
        except grpc.aio.UsageError:  # its channel was closed: removed
            return
        except grpc.aio.AioRpcError as e:
            transient = e.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            if transient and len(w.pending_aborts) < MAX_PENDING_ABORTS and w.address in self.handles:
                w.pending_aborts.add(wire_id)
            return
        w.pending_aborts.discard(wire_id)

    async def _resend_aborts(self, w: WorkerHandle) -> None:
        for wire_id in sorted(w.pending_aborts):
            w.pending_aborts.discard(wire_id)
            await self.abort(w, wire_id, self.poll_timeout_s)

    async def record(self, w: WorkerHandle, load: pb.Load) -> None:
        """``w`` answered ``GetLoad`` with ``load`` (a poll, or the check of ``POST /workers``):
        vet it, take the load, then the routing state's heartbeat."""
        refusal = self.vet(w.address, load)
        if refusal is not None:
            self._refuse(w, refusal)
        elif not w.healthy:
            back = w.missed or w.load is not None  # else: a new worker's first poll
            log.info("%s worker %s is %s", w.role, w.address, "back" if back else "up")
            w.refusal, w.healthy, w.down_reason = None, True, None
        w.load, w.missed = load, 0
        self.shutdown_seen(w, load.draining)
        await self._observe(w)
        if refusal is None:  # names of the same process after this one, up until now, go at once
            for o in self._twins(w.address, load):
                if o.healthy and o.address > w.address:
                    self._refuse(o, _duplicate(load.boot_id, w.address))
                    await self._observe(o)

    def shutdown_seen(self, w: WorkerHandle, draining: bool) -> None:
        """``w`` says whether it is shutting down (its ``GetLoad``, or a Generate it refused as
        draining): no new requests while it is; its attempts in flight are left to finish."""
        if draining and not w.shutting_down:
            log.info(
                "%s worker %s is draining (shutting down): no new requests, %d in flight finish",
                w.role, w.address, len(w.attempts),
            )  # fmt: skip
        elif w.shutting_down and not draining:
            log.info("%s worker %s takes requests again (boot id %s)", w.role, w.address, _boot(w))
        w.shutting_down = draining

    def _refuse(self, w: WorkerHandle, refusal: Refusal) -> None:
        if refusal != w.refusal:
            log.error("%s worker %s kept out of routing: %s", w.role, w.address, refusal.message)
        w.refusal, w.healthy = refusal, False

    async def _observe(self, w: WorkerHandle) -> None:
        try:
            await in_routing(self.routing, self.routing.observe, w.address, w.role, w.load, w.healthy)
        finally:
            w.polled.set()

    # -- vetting ------------------------------------------------------------------------------
    def mismatch(self, load: pb.Load) -> str | None:
        """Why a worker reporting ``load`` serves another model than this router (None: the same,
        or it does not say)."""
        fp = load.model_fingerprint
        if self.model is None or not fp or fp == self.model.fingerprint:
            return None
        theirs = f"{load.model_description or 'a model'} (fingerprint {fp})"
        return (
            f"it serves {theirs}, this router serves {self.model}: every worker must serve the "
            "router's model (config and tokenizer)"
        )

    def kv_format_mismatch(self, address: str, load: pb.Load) -> str | None:
        """Why a worker reporting ``load`` cannot join the workers in routing: another KV format
        (``Load.kv_format``: dtype, page formats and page size). Prefill pages go to any decode
        worker as they are (never converted or re-paged), so one router's workers share one
        format; the first in routing sets it (None: the same, or either does not say)."""
        mine = load.kv_format
        if not mine:
            return None
        for o in sorted(self.handles.values(), key=lambda h: h.address):
            theirs = o.load.kv_format if o.load is not None else ""
            if o.address != address and o.healthy and theirs and theirs != mine:
                return (
                    f"its KV format is {mine!r}, the workers in routing use {theirs!r} ({o.address}): "
                    "prefill pages are never converted, so give every worker the same --dtype, "
                    "--page-size, --kv-layout, --kv-cache-dtype, --kv-cache-dtype-swa, "
                    "--kv-quant-group, --kv-kivi-group and --kv-kivi-residual"
                )
        return None

    def _twins(self, address: str, load: pb.Load) -> list[WorkerHandle]:
        """The workers not draining under other addresses than ``address`` whose last answer
        came from the process that answered ``load`` (same ``boot_id``)."""
        if not load.boot_id:
            return []
        return [
            o
            for o in self.handles.values()
            if o.address != address
            and not o.draining
            and o.load is not None
            and o.load.boot_id == load.boot_id
        ]

    def same_process(self, address: str, load: pb.Load) -> WorkerHandle | None:
        """The worker in use under another address than ``address`` that is the process which
        answered ``load`` (same ``boot_id``), if any; one in routing is named first."""
        return min(self._twins(address, load), key=lambda o: (not o.healthy, o.address), default=None)

    def _first_name(self, address: str, load: pb.Load) -> WorkerHandle | None:
        """Of the other names of the process that answered ``load`` at ``address`` that answer
        (up, or kept out only as a duplicate), the one with the smallest address."""
        answering = [
            o
            for o in self._twins(address, load)
            if o.healthy or (o.refusal is not None and o.refusal.code == "duplicate")
        ]
        return min(answering, key=lambda o: o.address, default=None)

    def vet(self, address: str, load: pb.Load) -> Refusal | None:
        """Whether the worker at ``address`` must be kept out of routing given ``load`` (module
        docstring): another model, or the same process as a worker in routing."""
        why = self.mismatch(load)
        if why is not None:
            return Refusal("model_mismatch", why)
        why = self.kv_format_mismatch(address, load)
        if why is not None:
            return Refusal("kv_format_mismatch", why)
        twin = self._first_name(address, load)
        if twin is not None and twin.address < address:
            return _duplicate(load.boot_id, twin.address)
        return None
