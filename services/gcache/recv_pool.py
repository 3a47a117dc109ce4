"""``RecvPool``: receive buffers for the UCX data plane, recycled by exact size.

A reply's page objects (or a put's, on the node) land in fresh buffers that the caller keeps. A
buffer newly mapped costs a page fault per 4 KiB when the transport writes it; on a VM that
hands freed memory back to its host (this project's: Firecracker with free-page reporting) each
of those is a host fault too, and a 4 MiB get into fresh memory took 9-16 ms instead of 2-3
(docs/BENCHMARKS.md, GCache). So large buffers here are anonymous maps (not populated up front,
so a header declaring a large buffer commits no memory before its data arrives), and a buffer
whose last view is dropped goes
back to a free list of its size (at most ``max_idle_bytes`` kept), so a steady stream of
same-size pages (a model's full and SWA page objects) reuses memory that is already mapped, as
a registered-buffer pool does for RDMA. The buffer handed out is a view of a numpy array; it
returns to the pool only when that array is freed (``weakref.finalize``, not at interpreter
exit), so a caller can never see its bytes overwritten."""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

from swaserve.gcache.tiers import anonymous_map

MIN_POOLED_BYTES = 64 << 10  # smaller buffers come from malloc (np.empty)
MAX_IDLE_BYTES = 256 << 20  # default: free buffers kept for reuse, bytes over all sizes


class RecvPool:
    """Receive buffers by exact size. ``take(n)``: a writable ``n``-byte memoryview (contents
    undefined). Thread-safe: a buffer may be freed on any thread. Args: max_idle_bytes: free
    buffers kept, bytes (0: none kept); min_bytes: smaller requests bypass the pool. The lock is
    reentrant: a garbage collection inside ``take`` may free a pooled view on the same thread."""

    def __init__(self, max_idle_bytes: int = MAX_IDLE_BYTES, min_bytes: int = MIN_POOLED_BYTES) -> None:
        if max_idle_bytes < 0 or min_bytes < 1:
            raise ValueError("max_idle_bytes must be >= 0 and min_bytes >= 1")
        self.max_idle_bytes, self.min_bytes = max_idle_bytes, min_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.RLock()
        self.idle_bytes = 0
        self.mapped = 0  # buffers mapped so far
        self.reused = 0  # buffers handed out again from a free list

    def take(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes, from the free list of size ``n`` when it has one."""
        if n < self.min_bytes:
            return np.empty(n, np.uint8).data
        block = None
        with self._lock:
            free = self._free.get(n)
            if free:
                block = free.pop()
                self.idle_bytes -= n
                self.reused += 1
        if block is None:
            block = anonymous_map(n)
            with self._lock:
                self.mapped += 1
        arr = np.frombuffer(block, np.uint8)
        # not at exit: a view may still be in use (a daemon thread) while exit handlers run
        weakref.finalize(arr, self._give_back, block).atexit = False
        return arr.data

    def _give_back(self, block: mmap.mmap) -> None:
        n = len(block)
        with self._lock:
            if self.idle_bytes + n <= self.max_idle_bytes:
                self._free.setdefault(n, []).append(block)
                self.idle_bytes += n
        # over the cap: dropped, unmapped once the dying array releases it (no close(): this
        # runs inside the array's deallocation, while it still holds the buffer)

    def clear(self) -> None:
        """Drop every free buffer (unmapped when no longer referenced; buffers in use stay)."""
        with self._lock:
            self._free.clear()
            self.idle_bytes = 0


POOL = RecvPool()  # the process's: the UCX client's replies and the server's requests
