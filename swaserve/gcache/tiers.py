"""GCache storage tiers: fixed-size slots carved per size class out of a byte capacity.

``DramTier``: host memory (a list of chunk buffers per class). ``NvmeTier``: a directory with one
preallocated file per class (``class-<slot bytes>.slots``), slots 4 KiB-aligned, ``O_DIRECT`` where
the filesystem allows it (tmpfs does not: buffered I/O then). A class grows by chunks while the
tier has capacity left; space given to a class stays with it (one model's full and SWA pages make
two classes). A slot is ``(slot_size, index)``. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ALIGN = 4096
CHUNK_SLOTS = 64

Slot = tuple[int, int]  # (slot size in bytes, index in its class)


@dataclass
class _Class:
    size: int
    slots: int = 0
    free: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # slots per chunk, in order


class Tier:
    """Slot accounting shared by the tiers. ``capacity``: bytes; ``align``: slot size granularity."""

    name = "tier"

    def __init__(self, capacity: int, align: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 bytes, got {capacity}")
        self.capacity, self.align = capacity, align
        self.classes: dict[int, _Class] = {}
        self.given = 0  # bytes handed to classes
        self.used = 0  # bytes of slots in use

    def slot_size(self, nbytes: int) -> int:
        return max(self.align, (nbytes + self.align - 1) // self.align * self.align)

    def alloc(self, nbytes: int) -> Slot | None:
        """A free slot for an object of ``nbytes``, growing its class if capacity is left."""
        size = self.slot_size(nbytes)
        c = self.classes.get(size)
        if c is None:
            c = self.classes[size] = _Class(size)
        if not c.free:
            n = min(self._chunk_slots(size), (self.capacity - self.given) // size)
            if n <= 0:
                return None
            self._grow(c, n)
            c.free.extend(range(c.slots + n - 1, c.slots - 1, -1))
            c.slots += n
            c.chunks.append(n)
            self.given += n * size
        self.used += size
        return size, c.free.pop()

    def _chunk_slots(self, size: int) -> int:
        """Slots a class grows by: about 1/32 of the capacity (at least one slot), so that every
        class can still get room while the tier fills."""
        return max(1, min(CHUNK_SLOTS, self.capacity // 32 // size))

    def last_chunk(self, size: int) -> range:
        """Slot indices of class ``size``'s last chunk (empty: none)."""
        c = self.classes.get(size)
        if c is None or not c.chunks:
            return range(0)
        return range(c.slots - c.chunks[-1], c.slots)

    def shrink(self, size: int) -> None:
        """Give class ``size``'s last chunk back to the tier; all its slots must be free."""
        c = self.classes[size]
        span = self.last_chunk(size)
        free = set(c.free)
        if not span or any(i not in free for i in span):
            raise RuntimeError("shrinking a chunk with slots in use (internal error)")
        c.free = [i for i in c.free if i < span.start]
        c.slots = span.start
        c.chunks.pop()
        self.given -= len(span) * size
        self._cut(c)

    def _cut(self, c: _Class) -> None:
        raise NotImplementedError

    def release(self, slot: Slot) -> None:
        c = self.classes[slot[0]]
        if slot[1] in c.free or not 0 <= slot[1] < c.slots:
            raise RuntimeError(f"slot {slot} freed twice or unknown (internal error)")
        c.free.append(slot[1])
        self.used -= slot[0]

    def free_slots(self, size: int) -> int:
        """Slots of class ``size`` available now (free, or growable)."""
        c = self.classes.get(size)
        have = len(c.free) if c else 0
        return have + (self.capacity - self.given) // size

    def _grow(self, c: _Class, n: int) -> None:
        raise NotImplementedError

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        raise NotImplementedError

    def read(self, slot: Slot, nbytes: int) -> bytes:
        raise NotImplementedError

    def view(self, slot: Slot, nbytes: int) -> bytes | memoryview:
        """The slot's bytes without a copy where the tier can (DRAM): valid only while the slot
        is neither freed nor rewritten (the store's leases keep it so)."""
        return self.read(slot, nbytes)

    def close(self) -> None:
        return None


def anonymous_map(n: int) -> mmap.mmap:
    """``n`` bytes of private anonymous memory: zero pages, faulted in when first written (Python's
    default for ``mmap(-1, n)`` is a shared map)."""
    return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


class DramTier(Tier):
    """Slots in chunks of anonymous memory: a new chunk is mapped, not zeroed, so its pages are
    faulted in as puts first write them (a 64 MiB ``bytearray`` was zeroed inside one put)."""

    name = "dram"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, 64)
        self._chunks: dict[int, list[mmap.mmap]] = {}

    def _grow(self, c: _Class, n: int) -> None:
        self._chunks.setdefault(c.size, []).append(anonymous_map(n * c.size))

    def _cut(self, c: _Class) -> None:
        self._chunks[c.size].pop()

    def _locate(self, slot: Slot) -> tuple[mmap.mmap, int]:
        size, i = slot
        for chunk in self._chunks[size]:
            k = len(chunk) // size
            if i < k:
                return chunk, i * size
            i -= k
        raise RuntimeError(f"slot {slot} outside its class (internal error)")

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        buf, off = self._locate(slot)
        buf[off : off + len(data)] = data

    def read(self, slot: Slot, nbytes: int) -> bytes:
        buf, off = self._locate(slot)
        return bytes(buf[off : off + nbytes])

    def view(self, slot: Slot, nbytes: int) -> memoryview:
        buf, off = self._locate(slot)
        return memoryview(buf)[off : off + nbytes]


class DirectoryInUse(OSError):
    """Another open ``NvmeTier`` (another node) holds the directory."""


class NvmeTier(Tier):
    """Args: directory: where the class files live (created; one tier at a time: an exclusive
    ``flock`` on ``DIR/lock``, else ``DirectoryInUse``). capacity: bytes. direct: try
    ``O_DIRECT`` (falls back to buffered I/O where the filesystem refuses it)."""

    name = "nvme"

    def __init__(self, directory: str | Path, capacity: int, direct: bool = True) -> None:
        super().__init__(capacity, ALIGN)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise DirectoryInUse(
                errno.EBUSY,
                f"NVMe directory {self.dir} is in use by another GCache node (its lock file is held)",
            ) from None
        self.want_direct = direct and hasattr(os, "O_DIRECT")
        self.direct = False
        self._fds: dict[int, int] = {}
        for p in sorted(self.dir.glob("class-*.slots")):
            size = int(p.name.split("-")[1].split(".")[0])
            if size % ALIGN or size <= 0:
                continue
            n = p.stat().st_size // size
            if self.given + n * size > capacity:  # the capacity shrank: keep what fits
                n = max(0, (capacity - self.given) // size)
                os.truncate(p, n * size)
            c = self.classes[size] = _Class(size, n, list(range(n - 1, -1, -1)), [n] if n else [])
            self.given += c.slots * size
            self._open(size)

    def _open(self, size: int) -> int:
        fd = self._fds.get(size)
        if fd is not None:
            return fd
        path = self.dir / f"class-{size}.slots"
        flags = os.O_RDWR | os.O_CREAT
        if self.want_direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
        if fd is None:
            fd = os.open(path, flags, 0o644)
        self._fds[size] = fd
        return fd

    def _grow(self, c: _Class, n: int) -> None:
        fd = self._open(c.size)
        end = (c.slots + n) * c.size
        try:
            os.posix_fallocate(fd, 0, end)
        except OSError:
            os.ftruncate(fd, end)

    def _cut(self, c: _Class) -> None:
        os.ftruncate(self._open(c.size), c.slots * c.size)

    def release(self, slot: Slot) -> None:
        """Free a slot and erase its header, so a restart never brings back a page the index
        dropped (evicted, moved to DRAM, corrupt)."""
        super().release(slot)
        with mmap.mmap(-1, ALIGN) as zero, contextlib.suppress(OSError):
            # a failing disk: the stale header fails recovery's CRC check or names a valid page
            os.pwrite(self._open(slot[0]), zero, slot[1] * slot[0])

    def write(self, slot: Slot, data: bytes | memoryview) -> None:
        size, i = slot
        with mmap.mmap(-1, size) as buf:  # page-aligned, as O_DIRECT needs
            buf[: len(data)] = data
            if os.pwrite(self._open(size), buf, i * size) != size:
                raise OSError(errno.EIO, f"short write to slot {slot}")

    def read(self, slot: Slot, nbytes: int) -> bytes:
        size, i = slot
        want = min(size, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with mmap.mmap(-1, want) as buf:
            got = os.preadv(self._open(size), [buf], i * size)
            return bytes(buf[: min(got, nbytes)])

    def scan(self) -> Iterator[tuple[Slot, int]]:
        """Every slot of every class file (for recovery): ``(slot, class size)``."""
        for size, c in sorted(self.classes.items()):
            for i in range(c.slots):
                yield (size, i), size

    def claim(self, size: int, used: set[int]) -> None:
        """After recovery: the slots of class ``size`` found holding valid objects are in use."""
        c = self.classes[size]
        c.free = [i for i in range(c.slots - 1, -1, -1) if i not in used]
        self.used += len(used) * size

    def close(self) -> None:
        for fd in [*self._fds.values(), self._lock]:
            with contextlib.suppress(OSError):
                os.close(fd)  # the lock goes with its descriptor
        self._fds.clear()
        self._lock = -1
