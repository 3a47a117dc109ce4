"""GCache's UCX data plane: ``UcxServer`` (in the node's event loop, calling ``GCacheNode.handle_ucx``)
and ``UcxClient``, over ucxx's async tag API with host buffers, the worker progressed by the event
loop (``ucx_ep``; the process's context: ``ucx_runtime``). Importing this module never imports
ucxx; the first server or client does, after setting ``ENV_DEFAULTS`` where they are not set.

Wire format: ``services.gcache.ucx_wire``.

Failures: a call has a deadline; a dead peer, a stopped one (no reply in time) or a malformed reply
raises ``UcxTransportError`` and drops the endpoint (the next call connects again). The server
refuses a bad frame (magic, version, sizes over its limits) with an ``INVALID_ARGUMENT`` reply and
closes that connection; it never raises out of a connection. Design: ../shared/research/gcache_ucx.md
section 3 (ucxx on this machine). ucxx's listener binds every interface: ``host`` is not honoured."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from services.gcache.ucx_ep import FastEndpoint, retrieve
from services.gcache.ucx_runtime import _RUNTIME, ABORT_PERIOD_NS, ENV_DEFAULTS, available
from services.gcache.ucx_wire import (
    INLINE_BYTES,
    INTERNAL,
    INVALID_ARGUMENT,
    MAX_BUFFER_BYTES,
    MAX_BUFFERS,
    MAX_MESSAGE_BYTES,
    MAX_META_BYTES,
    OP_REFUSED,
    PACKED,
    REPLY_HEAD_BYTES,
    Buffer,
    Frame,
    FrameError,
    Reply,
    UcxTransportError,
    _recv_rest,
    _send,
    _view,
    message_tag,
    parse_header,
)

log = logging.getLogger("swaserve.gcache.ucx")

REFUSE_GRACE_S = 1.0  # after a refusal, how long the server waits for the peer to hang up

Handler = Callable[[int, bytes, list[memoryview]], Awaitable[Reply]]
__all__ = ["ENV_DEFAULTS", "Handler", "Reply", "UcxClient", "UcxServer", "UcxTransportError", "available"]


def _abort(ep: Any) -> None:
    with contextlib.suppress(Exception):
        ep.abort(period=ABORT_PERIOD_NS, max_attempts=1)


# -- server ------------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Conn:
    ep: Any
    refused: bool = False
    closed: bool = False
    requests: set[asyncio.Task[None]] = field(default_factory=set)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _abort(self.ep)


class UcxServer:
    """Serves ``handler(op, meta, buffers) -> Reply`` on a UCX port, in the running event loop.

    Args: handler: the node's ``handle_ucx`` (buffers are fresh per request: it may keep them).
    host: recorded only (ucxx listens on every interface). port: 0 for a free one.
    max_meta_bytes, max_buffers, max_buffer_bytes, max_request_bytes: a request over any is
    refused (bytes; buffers per request). request_timeout_s: seconds a request may take to arrive
    after its header, and its reply to leave (then the connection closes). max_inflight:
    requests per connection handled at once.

    ``start`` then ``port``; ``stop`` closes the listener and every connection (idempotent)."""

    def __init__(
        self,
        handler: Handler,
        host: str = "0.0.0.0",
        port: int = 0,
        *,
        max_meta_bytes: int = MAX_META_BYTES,
        max_buffers: int = MAX_BUFFERS,
        max_buffer_bytes: int = MAX_BUFFER_BYTES,
        max_request_bytes: int = MAX_MESSAGE_BYTES,
        request_timeout_s: float = 60.0,
        max_inflight: int = 64,
    ) -> None:
        self.handler, self.host, self.port = handler, host, port
        self.max_meta_bytes, self.max_buffers = max_meta_bytes, max_buffers
        self.max_buffer_bytes, self.max_request_bytes = max_buffer_bytes, max_request_bytes
        self.request_timeout_s, self.max_inflight = request_timeout_s, max_inflight
        self.refused = 0  # frames refused so far
        self._listener: Any = None
        self._generation = 0
        self._conns: dict[asyncio.Task[None], _Conn] = {}

    async def start(self) -> None:
        """Listen. Raises ImportError (no ucxx) or ``UcxTransportError`` (the port is taken)."""
        if self._listener is not None:
            return
        ucxx, self._generation = _RUNTIME.acquire()
        try:
            self._listener = ucxx.create_listener(self._accept, port=self.port)
        except Exception as e:
            _RUNTIME.release(self._generation)
            raise UcxTransportError(f"cannot listen on UCX port {self.port}: {type(e).__name__}: {e}") from e
        self.port = int(self._listener.port)
        log.info("UCX data plane listening on port %d (%s)", self.port, os.environ.get("UCX_TLS"))

    async def stop(self) -> None:
        """Close the listener and every connection, then release ucxx. Idempotent."""
        listener, self._listener = self._listener, None
        if listener is None:
            return
        listener.close()
        for task, conn in list(self._conns.items()):
            conn.close()
            task.cancel()
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=5.0)
        self._conns.clear()
        del listener
        _RUNTIME.release(self._generation)

    async def _accept(self, ep: Any) -> None:
        if self._listener is None:  # stopping
            _abort(ep)
            return
        conn = _Conn(FastEndpoint(ep, _RUNTIME.waiter()))
        task = asyncio.create_task(self._serve(conn))
        self._conns[task] = conn
        task.add_done_callback(lambda t: self._conns.pop(t, None))

    async def _serve(self, conn: _Conn) -> None:
        """One connection: read headers and start their requests until the peer leaves."""
        slots = asyncio.Semaphore(self.max_inflight)

        def done(t: asyncio.Task[None]) -> None:
            conn.requests.discard(t)
            slots.release()

        try:
            while not conn.refused:
                head = bytearray(INLINE_BYTES)
                await conn.ep.recv(head)  # the next request, or an error once the peer is gone
                try:
                    f = parse_header(head, self.max_meta_bytes, self.max_buffers)
                except FrameError as e:
                    await self._refuse(conn, int.from_bytes(head[8:16], "little"), str(e))
                    break
                await slots.acquire()
                task = asyncio.create_task(self._request(conn, f, head))
                conn.requests.add(task)
                task.add_done_callback(done)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the peer left or sent a message that is not a header
            log.debug("UCX connection ends: %s: %s", type(e).__name__, e)
        finally:
            try:
                if conn.refused and not conn.closed:  # let the peer read the refusal, then close
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.ep.recv(bytearray(INLINE_BYTES)), REFUSE_GRACE_S)
            finally:
                for t in list(conn.requests):
                    t.cancel()
                conn.close()

    async def _refuse(self, conn: _Conn, rid: int, why: str) -> None:
        """Answer a bad frame (INVALID_ARGUMENT, op ``OP_REFUSED``); the connection then closes."""
        self.refused += 1
        conn.refused = True
        log.warning("UCX frame refused: %s", why)
        msg = f"bad UCX frame: {why}".encode()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                _send(conn.ep, OP_REFUSED, INVALID_ARGUMENT, rid, msg, (), False), REFUSE_GRACE_S
            )

    async def _request(self, conn: _Conn, f: Frame, head: bytearray) -> None:
        try:
            try:
                rest = _recv_rest(conn.ep, f, head, self.max_buffer_bytes, self.max_request_bytes)
                if f.inline and not f.nbuf:  # all of it came in the head: nothing to wait for
                    meta, bufs = await rest
                else:
                    async with asyncio.timeout(self.request_timeout_s):
                        meta, bufs = await rest
            except FrameError as e:
                await self._refuse(conn, f.rid, str(e))
                await asyncio.sleep(REFUSE_GRACE_S)
                conn.close()
                return
            try:
                reply = await self.handler(f.op, meta, bufs)
            except Exception as e:  # the node answers every failure itself: this is a bug
                log.exception("UCX handler failed on op %d", f.op)
                reply = Reply(INTERNAL, f"op {f.op} failed: {e!r}".encode())
            try:
                views = [_view(b) for b in reply.buffers]
                sending = _send(conn.ep, f.op, reply.status, f.rid, reply.meta, views, False)
                if not sending.done():  # a small reply is sent as it is posted
                    async with asyncio.timeout(self.request_timeout_s):
                        await sending
                sending.result()
            finally:
                if reply.done is not None:
                    reply.done()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the peer left, or took longer than request_timeout_s
            log.debug("UCX request %d (op %d) dropped: %s: %s", f.rid, f.op, type(e).__name__, e)
            conn.close()


# -- client ------------------------------------------------------------------------------------------
class UcxClient:
    """Calls one UCX server. Args: host, port: its address. timeout_s: a call's default deadline
    (seconds, connecting included). max_reply_bytes: the most buffer bytes one reply may carry.
    Create and use it in one event loop; calls may run concurrently on its one endpoint."""

    def __init__(
        self, host: str, port: int, timeout_s: float = 5.0, max_reply_bytes: int = MAX_MESSAGE_BYTES
    ) -> None:
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self.max_reply_bytes = max_reply_bytes
        self._ep: Any = None
        self._generation = 0
        self._lock: asyncio.Lock | None = None
        self._next_rid = 0
        self.connects = 0  # endpoints made so far (reconnects show here)

    @property
    def connected(self) -> bool:
        return self._ep is not None

    async def call(
        self,
        op: int,
        meta: Buffer = b"",
        buffers: Sequence[Any] = (),
        *,
        into: Sequence[Any] | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """Send ``op`` with ``meta`` and ``buffers``; the reply, whatever its status. Reply buffer
        ``i`` lands in ``into[i]`` (a writable buffer; the reply holds a view of its first bytes)
        when it is large enough, else in a new array. Raises ``UcxTransportError`` (no connection,
        no reply within ``timeout_s`` seconds, the peer died, a malformed reply), ValueError or
        TypeError for bad arguments (op not 1..255, sizes over the protocol's limits)."""
        if not 0 < op < PACKED:
            raise ValueError(f"op {op} not in 1..{PACKED - 1}")
        views = [_view(b) for b in buffers]
        dst = [_view(b, writable=True) for b in into or ()]
        if len(meta) > MAX_META_BYTES or len(views) > MAX_BUFFERS:
            raise ValueError(f"a call carries at most {MAX_META_BYTES} meta bytes and {MAX_BUFFERS} buffers")
        deadline = self.timeout_s if timeout_s is None else timeout_s
        self._next_rid += 1
        rid = self._next_rid
        where = f"UCX {self.host}:{self.port} op {op}"
        ep = None
        try:
            async with asyncio.timeout(deadline):
                ep = await self._endpoint()
                refused, reply = await self._exchange(ep, rid, op, meta, views, dst)
        except TimeoutError as e:
            self._drop(ep)
            raise UcxTransportError(
                f"{where}: no {'reply' if ep else 'connection'} within {deadline} s"
            ) from e
        except FrameError as e:
            self._drop(ep)
            raise UcxTransportError(f"{where}: malformed reply: {e}") from e
        except Exception as e:  # ucxx's errors: the peer is gone, refused, reset
            self._drop(ep)
            raise UcxTransportError(f"{where}: {type(e).__name__}: {e}") from e
        except asyncio.CancelledError:
            self._drop(ep)
            raise
        if refused:
            self._drop(ep)  # the server closes the connection after a refusal
        return reply

    async def _endpoint(self) -> Any:
        if self._ep is not None and self._generation == _RUNTIME.generation and _RUNTIME.loop is not None:
            return self._ep
        self._ep = None  # one of a context torn down since: forgotten, not touched
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._ep is None:
                ucxx, generation = _RUNTIME.acquire()
                try:
                    ep = FastEndpoint(await ucxx.create_endpoint(self.host, self.port), _RUNTIME.waiter())
                except BaseException:
                    _RUNTIME.release(generation)
                    raise
                self._ep, self._generation = ep, generation
                self.connects += 1
            return self._ep

    async def _exchange(
        self, ep: Any, rid: int, op: int, meta: Buffer, views: list[memoryview], into: list[memoryview]
    ) -> tuple[bool, Reply]:
        """(refused, the reply). Raises FrameError for a malformed reply, ucxx's errors."""
        head = np.empty(REPLY_HEAD_BYTES, np.uint8).data  # a packed reply's buffers come in it
        got = asyncio.ensure_future(ep.recv(head, tag=message_tag(rid, 0)))  # posted before sending
        posted = [got]
        try:
            sending = _send(ep, op, 0, rid, meta, views, True)
            posted.append(sending)
            if not sending.done():  # a small request is sent as it is posted
                await asyncio.wait((sending, got), return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                await sending  # raises when the peer is gone
            await got
            f = parse_header(head)
            if f.rid != rid or f.op not in (op, OP_REFUSED):
                raise FrameError(f"a reply to request {f.rid} op {f.op}, expected {rid} op {op}")
            if f.op != OP_REFUSED:
                await sending
        finally:
            for fut in posted:  # a refusal leaves the rest of the request unsent
                if not fut.done():
                    fut.cancel()
                fut.add_done_callback(retrieve)  # the other half's error, unread
        meta_back, bufs = await _recv_rest(ep, f, head, MAX_BUFFER_BYTES, self.max_reply_bytes, into)
        return f.op == OP_REFUSED, Reply(f.status, meta_back, bufs)

    def _drop(self, ep: Any) -> None:
        """Forget ``ep`` (if still current) and close it: the next call connects again."""
        if ep is None or ep is not self._ep:
            return
        self._ep = None
        _abort(ep)
        _RUNTIME.release(self._generation)

    async def close(self) -> None:
        """Close the endpoint (idempotent; a later call connects again)."""
        self._drop(self._ep)
