"""UCX progress driven by the asyncio loop itself, and tag send / receive awaited through it.

ucxx 0.52's progress modes each cost something here: ``thread`` (its default) completes every
message through a progress thread, then its notifier thread, then a wake-up of the event loop;
``polling`` and ``blocking`` busy-poll a core even when idle (a pending request is awaited by
``await asyncio.sleep(0)`` in a loop, and ``blocking`` never re-arms the worker). ``LoopProgress``
is the blocking design done fully: the worker's epoll fd is a reader of the loop; when it fires
(or a request was just posted) the loop progresses the worker, completes the futures of the
requests that finished, and re-arms the worker (progressing again while ``arm`` says events are
pending), as ucx-py's blocking mode did. A slow tick (``TICK_S``) progresses the worker anyway,
a backstop. ``exchange_peer_info`` replaces ucxx's connection handshake (same wire bytes), awaited
the same way with its buffers held until UCX is done with them.

``FastEndpoint`` posts tag messages on a ucxx async endpoint with the tags its ``send(buf, tag=)``
/ ``recv(buf, tag=)`` use (the endpoint's tag mixed with the caller's) and awaits them through the
loop's ``LoopProgress``. Uses ucxx's ``Endpoint._ep`` / ``_tags`` and ``ProgressTasks`` (pinned
ucxx 0.52; tests/services/gcache/test_ucx.py)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import struct
from typing import Any

TICK_S = 0.01  # progress at least this often (seconds) while the loop has a LoopProgress
_RESERVED = object()  # a ProgressTasks entry that keeps ucxx from starting its own progress


def retrieve(fut: asyncio.Future[Any], keep: Any = None) -> None:
    """A done-callback that reads a finished future's exception (asyncio would log one nobody
    read); ``keep``: an object held until then (a buffer UCX may still use)."""
    if not fut.cancelled():
        fut.exception()


class RequestWaiter:
    """Awaits a ucxx request with ucxx's own ``wait`` (whatever progress mode its context has)."""

    def watch(self, req: Any, keep: Any = None) -> asyncio.Future[None]:
        """A future done when ucxx request ``req`` completes (its error: ucxx's); cancelling it
        leaves ``keep``, the request's buffer, held until UCX is done with it."""
        return asyncio.ensure_future(self.wait(req, keep))

    async def wait(self, req: Any, keep: Any = None) -> None:
        """Until ucxx request ``req`` completes (``keep``, its buffer, held until then, even when
        the waiter is cancelled first). Raises ucxx's errors (``UCXCanceled``, ``UCXError``: the
        peer is gone) or CancelledError."""
        try:
            await req.wait()
        except asyncio.CancelledError:
            fut = None if req.completed else req.future
            if fut is not None:
                fut.add_done_callback(functools.partial(retrieve, keep=keep))
            raise


class LoopProgress(RequestWaiter):
    """Progress of ucxx worker ``worker`` in ``loop`` (see the module doc). ``close`` stops it.
    Register it in ucxx's ``ProgressTasks`` before ucxx makes a listener or endpoint, so ucxx
    does not start its own (``install``)."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.worker, self.loop = worker, loop
        worker.init_blocking_progress_mode()
        self.fd = int(worker.epoll_file_descriptor)
        # every posted request until it completes, with its future and its buffer: a future
        # cancelled first leaves the buffer here, as UCX may still write into or read from it
        # until the request completes (an abort cancels it)
        self._waiting: dict[Any, tuple[asyncio.Future[None], Any]] = {}
        self._orphans: dict[Any, Any] = {}  # requests still posted when this closed
        self._scheduled = False
        self.closed = False
        loop.add_reader(self.fd, self._progress)
        self._tick = loop.call_later(TICK_S, self._on_tick)

    @staticmethod
    def reserve(loop: asyncio.AbstractEventLoop) -> None:
        """Before ``ucxx.init``: keep ucxx from starting its own progress task for ``loop`` (its
        context starts one at init; ``blocking``'s would progress the worker behind ours)."""
        from ucxx._lib_async import application_context as app

        app.ProgressTasks.setdefault(loop, _RESERVED)
        _patch_exchange()

    @classmethod
    def install(cls, ctx: Any, loop: asyncio.AbstractEventLoop) -> LoopProgress:
        """The ``LoopProgress`` of ``loop`` for ucxx application context ``ctx``, made and
        registered in ucxx's ``ProgressTasks`` if there is none yet."""
        from ucxx._lib_async import application_context as app

        have = app.ProgressTasks.get(loop)
        if isinstance(have, cls) and not have.closed:
            return have
        made = cls(ctx.worker, loop)
        app.ProgressTasks[loop] = made
        _patch_exchange()
        return made

    # ucxx's ProgressTasks entries are hashed by loop and closed through these
    def __hash__(self) -> int:
        return hash(self.loop)

    def __eq__(self, other: object) -> bool:
        return hash(self) == hash(other)

    def close(self) -> None:
        """Stop progressing (in ``loop``'s thread). Waiting requests fail with ``UCXCanceled``;
        the buffers of requests still in flight stay held by this object (drop it only after
        ucxx's context is reset)."""
        if self.closed:
            return
        from ucxx._lib.libucxx import UCXCanceled

        self.closed = True
        self._tick.cancel()
        if not self.loop.is_closed():
            self.loop.remove_reader(self.fd)
        for req, (fut, keep) in self._waiting.items():
            if not fut.done():
                fut.set_exception(UCXCanceled("UCX progress closed"))
            if not req.completed:
                self._orphans[req] = keep
        self._waiting.clear()

    def kick(self) -> None:
        """Progress soon (in this loop's next round)."""
        if not self._scheduled and not self.closed:
            self._scheduled = True
            self.loop.call_soon(self._progress)

    def _on_tick(self) -> None:
        if self.closed:
            return
        try:
            self._progress()
        finally:
            if not self.closed:
                self._tick = self.loop.call_later(TICK_S, self._on_tick)

    def _progress(self) -> None:
        self._scheduled = False
        if self.closed:
            return
        self.worker.progress()
        if self._waiting:
            for req in [r for r in self._waiting if r.completed]:
                fut, _ = self._waiting.pop(req)
                if not fut.done():
                    _settle(fut, req)
        if self._orphans:
            for req in [r for r in self._orphans if r.completed]:
                del self._orphans[req]
        if not self.worker.arm():  # events came in since: progress again before sleeping
            self.kick()

    def watch(self, req: Any, keep: Any = None) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = self.loop.create_future()
        if req.completed:
            _settle(fut, req)
        elif self.closed:
            from ucxx._lib.libucxx import UCXCanceled

            self._orphans[req] = keep
            fut.set_exception(UCXCanceled("UCX progress closed"))
        else:
            self._waiting[req] = (fut, keep)
            self.kick()
        return fut

    async def wait(self, req: Any, keep: Any = None) -> None:
        await self.watch(req, keep)


def _settle(fut: asyncio.Future[None], req: Any) -> None:
    """Complete ``fut`` as completed ucxx request ``req`` ended: its error, or None."""
    try:
        req.check_error()
    except Exception as e:
        fut.set_exception(e)
    else:
        fut.set_result(None)


class FastEndpoint:
    """``send(buf, tag=)`` / ``recv(buf, tag=)`` over ucxx async endpoint ``ep`` through
    ``progress`` (a ``LoopProgress``, or a ``RequestWaiter``): each posts its request at once and
    returns a future (no task: a message costs no task of its own). ``abort`` closes."""

    def __init__(self, ep: Any, progress: RequestWaiter) -> None:
        from ucxx._lib.arr import Array
        from ucxx._lib.libucxx import UCXCloseError
        from ucxx._lib_async.utils import hash64bits
        from ucxx.types import Tag, TagMaskFull

        self.ep, self.progress = ep, progress
        self._array, self._tag, self._mask, self._hash = Array, Tag, TagMaskFull, hash64bits
        self._closed_error = UCXCloseError

    def _raw(self) -> Any:
        raw = self.ep._ep
        if raw is None or self.ep.closed:
            raise self._closed_error("Endpoint closed")
        raw.raise_on_error()
        return raw

    def _tagged(self, side: str, tag: int | None) -> Any:
        base = self.ep._tags[side]
        return self._tag(base if tag is None else self._hash(base, hash(tag)))

    def send(self, buf: Any, tag: int | None = None) -> asyncio.Future[None]:
        arr = self._array(buf)
        return self.progress.watch(self._raw().tag_send(arr, self._tagged("msg_send", tag)), arr)

    def recv(self, buf: Any, tag: int | None = None) -> asyncio.Future[None]:
        arr = self._array(buf)
        req = self._raw().tag_recv(arr, self._tagged("msg_recv", tag), self._mask)
        return self.progress.watch(req, arr)

    def abort(self, **kw: Any) -> None:
        self.ep.abort(**kw)


def _waiter() -> RequestWaiter:
    from ucxx._lib_async import application_context as app

    have = app.ProgressTasks.get(asyncio.get_running_loop())
    return have if isinstance(have, LoopProgress) and not have.closed else RequestWaiter()


async def exchange_peer_info(
    endpoint: Any, msg_tag: int, listener: bool, connect_timeout: float = 5.0
) -> dict[str, int]:
    """ucxx's connection handshake (each side sends its message tag and the tag's hash as two u64
    over the UCX stream API; the listener sends first), awaited through the loop's progress
    (ucxx's own polls ``asyncio.sleep(0)`` in a loop: a core busy while a peer is slow) with the
    16-byte buffers held until UCX completes their requests, and the half-made endpoint closed
    when the handshake fails or is cancelled (ucxx's freed a receive buffer still posted: UCX
    wrote the peer's bytes into freed memory). Raises TimeoutError, ucxx's errors, RuntimeError
    (bad checksum)."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits

    mine = struct.pack("QQ", msg_tag, hash64bits(msg_tag))
    theirs = bytearray(len(mine))
    out, into = Array(mine), Array(theirs)
    waiter = _waiter()
    try:
        async with asyncio.timeout(connect_timeout):
            if listener:
                await waiter.wait(endpoint.stream_send(out), out)
                await asyncio.sleep(0)  # an await between the two stream calls, as ucxx has
                await waiter.wait(endpoint.stream_recv(into), into)
            else:
                await waiter.wait(endpoint.stream_recv(into), into)
                await asyncio.sleep(0)
                await waiter.wait(endpoint.stream_send(out), out)
    except BaseException:
        with contextlib.suppress(Exception):
            endpoint.close_blocking(period=100_000_000, max_attempts=1)  # cancels what is posted
        raise
    tag, checksum = struct.unpack("QQ", theirs)
    if hash64bits(tag) != checksum:
        raise RuntimeError(f"UCX handshake: checksum {checksum:#x} does not match tag {tag:#x}")
    return {"msg_tag": tag, "checksum": checksum}


def _patch_exchange() -> None:
    """ucxx 0.52 imports ``exchange_peer_info`` by name into the modules that connect: ours there."""
    from ucxx._lib_async import application_context as app
    from ucxx._lib_async import listener as lis

    app.exchange_peer_info = exchange_peer_info  # type: ignore[assignment]
    lis.exchange_peer_info = exchange_peer_info  # type: ignore[assignment]
