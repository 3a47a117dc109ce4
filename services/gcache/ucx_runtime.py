"""The process's ucxx runtime for GCache's UCX data plane: ucxx imported lazily with
``ENV_DEFAULTS`` (``UCX_TLS=tcp,self``, ``UCX_RNDV_FRAG_MEM_TYPE=host``,
``UCX_RNDV_SCHEME=put_zcopy``, ...) set where the environment has not, ``available()``, and
``_RUNTIME``: one application context per event loop, progressed by that loop
(``ucx_ep.LoopProgress``), kept while the loop lives. ucxx internals used: ``core._ctx``,
``_lib_async`` (pinned ucxx 0.52)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
from typing import Any

from services.gcache.ucx_ep import LoopProgress, RequestWaiter
from services.gcache.ucx_wire import UcxTransportError

log = logging.getLogger("swaserve.gcache.ucx")

ABORT_PERIOD_NS = 100_000_000  # how long closing an endpoint may wait on UCX (twice, at most)
ENV_DEFAULTS = {  # set where not set, before ucxx is imported
    "UCX_TLS": "tcp,self",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",  # ucxx's default, cuda, fails without a GPU
    # rendezvous by zero-copy put: a single 4 MiB reply over tcp took 1.2-2.0 ms here, against
    # 3.8-7.5 ms with UCX's own choice (bench gcache; docs/BENCHMARKS.md)
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_CM_REUSEADDR": "y",  # a node restarted on its port while old connections linger
}


# -- ucxx: imported lazily, one application context per event loop --------------------------------
def _ucxx() -> Any:
    """The ucxx module, imported with this module's UCX environment defaults. Raises ImportError."""
    if "ucxx" not in sys.modules:
        for k, v in ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
    import ucxx

    return ucxx


@functools.cache
def available() -> bool:
    """Whether ucxx imports and a UCX context and worker can be made here (cached)."""
    try:
        _ucxx()
        from ucxx._lib import libucxx

        libucxx.UCXWorker(libucxx.UCXContext({}))
    except Exception as e:  # ImportError, a missing libucx, no usable transport
        log.info("UCX unavailable: %s: %s", type(e).__name__, e)
        return False
    return True


class _Runtime:
    """ucxx's application context (one per process) held for the servers and clients of one event
    loop: made by the first ``acquire`` and progressed by that loop (``progress``, a
    ``ucx_ep.LoopProgress``: no ucxx threads), kept while that loop lives (a reconnect after a
    dropped endpoint reuses it: a teardown cost 0.1-0.3 s and leaked the old worker's fds). A
    second loop may use UCX once the first is closed or has no users left: it is torn down then."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.users = 0
        self.generation = 0
        self.owned = False
        self.progress: LoopProgress | None = None  # ours, when this runtime made the context
        self._exit_hook = False

    def acquire(self) -> tuple[Any, int]:
        """(the ucxx module, this context's generation for ``release``). Raises ImportError, or
        ``UcxTransportError`` when another live event loop holds UCX."""
        loop = asyncio.get_running_loop()
        ucxx = _ucxx()
        if self.loop is not None and self.loop is not loop:
            if self.users and not self.loop.is_closed():
                raise UcxTransportError("UCX is in use by another event loop of this process")
            self._teardown()  # the old loop is gone: its users will not release
        if self.loop is None:
            if getattr(ucxx.core, "_ctx", None) is None:
                # progress by the loop itself (services/gcache/ucx_ep.py), not ucxx's threads
                LoopProgress.reserve(loop)
                ucxx.init(progress_mode="blocking", enable_python_future=False)
                self.owned = True
                self.progress = LoopProgress.install(ucxx.core._ctx, loop)
            else:
                self.owned = False
            self.loop, self.users = loop, 0
            self.generation += 1
            self._register_exit_hook()
        self.users += 1
        return ucxx, self.generation

    def waiter(self) -> RequestWaiter:
        """How requests are awaited: through ``progress``, or ucxx's own ``wait`` when another
        part of this process made ucxx's context (its progress mode then)."""
        return self.progress if self.progress is not None else RequestWaiter()

    def release(self, generation: int) -> None:
        """One user fewer (a stale generation is ignored). Our context stays for its loop; one
        made elsewhere is let go with its last user."""
        if generation != self.generation or self.loop is None:
            return
        self.users -= 1
        if self.users <= 0 and not self.owned:
            self._teardown()

    def _teardown(self) -> None:
        progress, owned = self.progress, self.owned
        self.loop, self.users, self.progress, self.owned = None, 0, None, False
        if progress is not None:
            _close_in_its_loop(progress)  # no more progress from the old loop
        if owned:
            _stop_ucxx(reset=True)  # cancels what is in flight, then resets
        del progress  # buffers of requests that were in flight go only now

    def _register_exit_hook(self) -> None:
        # ucxx's notifier thread (a context in its thread mode, made elsewhere) is not a daemon:
        # a client never closed would keep the process alive. threading's own exit hooks run before it joins non-daemon threads (atexit after).
        if not self._exit_hook:
            self._exit_hook = True
            register = getattr(threading, "_register_atexit", None)
            with contextlib.suppress(RuntimeError):
                (register or __import__("atexit").register)(_stop_ucxx)


def _close_in_its_loop(progress: LoopProgress, timeout_s: float = 5.0) -> None:
    """``progress.close()`` in the thread of its loop when that loop runs in another thread."""
    loop = progress.loop
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if loop.is_closed() or not loop.is_running() or loop is here:
        progress.close()
        return
    done = threading.Event()

    def close() -> None:
        progress.close()
        done.set()

    loop.call_soon_threadsafe(close)
    if not done.wait(timeout_s):
        log.warning("the event loop that held UCX did not stop its progress within %.0f s", timeout_s)


def _stop_ucxx(reset: bool = False) -> None:
    """Stop ucxx's notifier and progress threads; ``reset``: drop its context too (ucxx 0.52 leaves
    the progress thread running after ``reset`` while a progress task still refers to it)."""
    ucxx: Any = sys.modules.get("ucxx")
    ctx = None if ucxx is None else getattr(ucxx.core, "_ctx", None)
    if ctx is None:
        return
    worker = ctx.worker
    del ctx
    from ucxx._lib_async import application_context as app

    # the notifier wakes at once (not at its next 1 s tick); its last wait sets it running again
    steps = [
        worker.stop_request_notifier_thread,
        ucxx.stop_notifier_thread,
        worker.stop_request_notifier_thread,
    ]
    if reset:  # cancelled requests complete through the notifier: first, while it runs
        steps = [functools.partial(worker.cancel_inflight_requests, ABORT_PERIOD_NS, 1), *steps]
        steps += [app.ProgressTasks.clear, worker.stop_progress_thread, ucxx.reset]
    del worker
    for step in steps:
        with contextlib.suppress(Exception):  # reset: UCXError if something still holds the context
            step()


_RUNTIME = _Runtime()
