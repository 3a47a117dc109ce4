"""RecvPool: receive buffers recycled by exact size, never while a view of one is alive."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from services.gcache.recv_pool import RecvPool


def test_buffer_returns_only_when_its_last_view_dies() -> None:
    pool = RecvPool(max_idle_bytes=1 << 20, min_bytes=4096)
    a = pool.take(8192)
    assert a.nbytes == 8192 and not a.readonly
    a[:] = b"\x01" * 8192
    part = a[100:200]  # a slice keeps the buffer in use
    del a
    gc.collect()
    assert pool.idle_bytes == 0
    b = pool.take(8192)  # a new mapping: the first is still held through ``part``
    b[:] = b"\x02" * 8192
    assert bytes(part) == b"\x01" * 100
    assert (pool.mapped, pool.reused) == (2, 0)
    arr = np.frombuffer(part, np.uint8)  # an array over the view holds it as well
    del part
    assert pool.idle_bytes == 0
    del arr
    assert pool.idle_bytes == 8192
    c = pool.take(8192)
    assert (pool.mapped, pool.reused, pool.idle_bytes) == (2, 1, 0)
    assert c.nbytes == 8192
    del b, c


def test_sizes_cap_and_small_buffers() -> None:
    pool = RecvPool(max_idle_bytes=3 * 4096, min_bytes=4096)
    small = pool.take(100)  # under min_bytes: not pooled
    assert small.nbytes == 100 and pool.mapped == 0
    bufs = [pool.take(4096) for _ in range(4)] + [pool.take(8192)]
    assert pool.mapped == 5
    while bufs:
        bufs.pop(0)  # the 4 KiB ones first: three fit the cap, the fourth and the 8 KiB one do not
    assert pool.idle_bytes == 3 * 4096
    got = [pool.take(4096) for _ in range(3)]
    assert pool.reused == 3 and pool.idle_bytes == 0
    assert pool.take(8192).nbytes == 8192 and pool.mapped == 6  # no 8 KiB one was kept
    del got
    pool.clear()
    assert pool.idle_bytes == 0 and pool.take(4096) is not None and pool.mapped == 7


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        RecvPool(max_idle_bytes=-1)
    with pytest.raises(ValueError):
        RecvPool(min_bytes=0)


def test_a_view_freed_inside_the_pools_lock_does_not_deadlock() -> None:
    """A garbage collection inside ``take``'s critical section may free a pooled view on the
    same thread (Python 3.12+ collects between bytecodes): its finalizer takes the lock again."""
    pool = RecvPool(max_idle_bytes=1 << 20, min_bytes=4096)
    done = threading.Event()

    def run() -> None:
        v = pool.take(8192)
        with pool._lock:  # as if inside take()
            del v
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "the finalizer blocked on the pool's lock"
    assert pool.idle_bytes == 8192


@pytest.mark.cluster  # a child interpreter
def test_buffers_still_in_use_at_exit_are_not_handed_out_again() -> None:
    """At interpreter exit a live buffer stays out of the pool: a take() from a later exit hook
    (or a daemon thread still running) gets other memory."""
    script = textwrap.dedent(
        """
        import atexit
        from services.gcache.recv_pool import RecvPool

        pool = RecvPool(min_bytes=4096)
        held = {}

        def late_take():  # registered first: runs after weakref's own exit hook
            b = pool.take(1 << 20)
            b[:] = b"\\x02" * (1 << 20)
            print("held", held["a"][0], "reused", pool.reused)

        atexit.register(late_take)
        a = pool.take(1 << 20)
        a[:] = b"\\x01" * (1 << 20)
        held["a"] = a
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["held", "1", "reused", "0"]
