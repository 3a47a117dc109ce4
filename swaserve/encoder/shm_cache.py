"""``ShmEmbeddingCache``: the per-machine embedding cache tier, shared by the encoder processes and
prefill workers of one host through POSIX shared memory.

Layout (two segments and a lock file; ``name`` chosen by the caller)::

    <name>-index   header (magic, version, block_bytes, n_blocks, clock)
                   n_blocks records: state, key (16 bytes), first block, blocks, data bytes,
                   meta bytes, dtype code, rows, cols, CRC-32, LRU stamp, generation
    <name>-arena   n_blocks blocks of block_bytes: an entry is one contiguous run of blocks
                   holding its tensor bytes (row-major) and then its meta as JSON
    <lock_dir>/<name>.lock   flock(2) over every index read or write

Allocation is first fit over the runs of free blocks, derived from the live records (no separate
free map that a crash could leave stale); when no run is long enough, the least recently used
entries are evicted one by one until one is. An entry never needs more blocks than the arena has,
so a put either fits or is refused at once. At most ``n_blocks`` entries can live (each takes at
least one block), so the record table never fills first. Keys are looked up by a vectorized scan
of the table (tens of microseconds at 64k records), which keeps the table free of tombstones.

Consistency: a put copies the bytes into blocks no live record owns, then fills the record and
sets its state to live last, all under the lock, so a reader never sees a torn entry, and a writer
that dies in between leaves only free blocks. A get copies the bytes out under the lock and checks
the CRC-32 (over tensor and meta bytes) after releasing it: a mismatch is a miss and the entry is
removed. The lock is held for memory copies only (CRCs and JSON outside it). One instance may be
shared by threads (a thread lock is taken with the file lock).

The segments are opened without ``multiprocessing``'s resource tracker: its ``SharedMemory``
registers every attach on Python < 3.13, starts a tracker process, and the tracker of a process
that only attached unlinks the segments when that process exits. Here the creator owns them and
``unlink`` ends them. As SGLang's ``SGLANG_MM_CACHE_SHM`` mode of ``MultiModalStaticCache`` (an
index + LRU order + lock shared by encoder processes; python/sglang/srt/mem_cache/
multimodal_cache.py), but one arena instead of a segment per entry, and a checksum per entry."""

from __future__ import annotations

import _posixshmem
import fcntl
import json
import math
import mmap
import os
import re
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swaserve.encoder.cache import Embedding

MAGIC = 0x43455753  # b"SWEC" little-endian
VERSION = 1
DEFAULT_BLOCK_BYTES = 64 << 10
KEY_BYTES = 16
_EMPTY, _LIVE = 0, 1
_HEADER = np.dtype(
    [("magic", "<u4"), ("version", "<u4"), ("block_bytes", "<u8"), ("n_blocks", "<u8"), ("clock", "<u8")]
)
_HEADER_BYTES = 64
_RECORD = np.dtype(
    [("state", "u1"), ("dtype", "u1"), ("_pad", "<u2"), ("crc", "<u4")]
    + [
        (f, "<u8")
        for f in ("k0", "k1", "first", "blocks", "nbytes", "meta_len", "rows", "cols", "stamp", "gen")
    ]
)
_DTYPES: dict[int, torch.dtype] = dict(
    enumerate((torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8), start=1)
)
_CODES = {dt: code for code, dt in _DTYPES.items()}
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class _Segment:
    """One POSIX shared memory segment, mapped; no resource tracker (see the module docstring)."""

    def __init__(self, name: str, create: bool, size: int = 0) -> None:
        self.name = "/" + name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(self.name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            if create:
                _posixshmem.shm_unlink(self.name)
            raise
        finally:
            os.close(fd)  # the mapping keeps its own reference

    def unlink(self) -> None:
        with suppress(FileNotFoundError):
            _posixshmem.shm_unlink(self.name)


@dataclass(frozen=True)
class ShmCacheStats:
    """``entries``, ``bytes`` (tensor + meta bytes), ``used_bytes`` (whole blocks) and ``capacity``
    (bytes) are the machine's, read under the lock; ``hits``, ``misses``, ``evictions``,
    ``refused`` and ``corrupt`` (entries failing their CRC, removed) count this instance's calls."""

    entries: int
    bytes: int
    used_bytes: int
    capacity: int
    hits: int
    misses: int
    evictions: int
    refused: int
    corrupt: int


class ShmEmbeddingCache:
    """An ``Embedding`` cache in shared memory, LRU by blocks; see the module docstring.

    Build one with ``create`` (the owner, once per machine) or ``attach`` (any process of the
    host), ``close`` each when done, and ``unlink`` once, from the owner, when no one needs it.
    """

    def __init__(self, name: str, index: _Segment, arena: _Segment, lock_fd: int, lock_path: Path) -> None:
        self.name = name
        self._index, self._arena = index, arena
        self._lock_fd, self._lock_path = lock_fd, lock_path
        self._thread_lock = threading.Lock()
        self._header = np.ndarray((), dtype=_HEADER, buffer=index.mm)
        self.block_bytes = int(self._header["block_bytes"])
        self.n_blocks = int(self._header["n_blocks"])
        self._recs = np.ndarray((self.n_blocks,), dtype=_RECORD, buffer=index.mm, offset=_HEADER_BYTES)
        self._data = np.ndarray((self.n_blocks * self.block_bytes,), dtype=np.uint8, buffer=arena.mm)
        self._hits = self._misses = self._evictions = self._refused = self._corrupt = 0
        self._closed = False

    @classmethod
    def create(
        cls,
        name: str,
        capacity_bytes: int,
        lock_dir: str | os.PathLike[str],
        block_bytes: int = DEFAULT_BLOCK_BYTES,
    ) -> ShmEmbeddingCache:
        """Create the segments ``<name>-index`` and ``<name>-arena`` (``capacity_bytes`` rounded
        down to whole blocks of ``block_bytes``) and the lock file ``<lock_dir>/<name>.lock``.

        Raises:
            ValueError: a bad name (letters, digits, ``_.-``; at most 200), or a capacity under one block.
            FileExistsError: the segments exist: ``attach`` them (entries left by a process that
                died are still valid: keyed by content, checked by CRC).
        """
        _check_name(name)
        if block_bytes < 1 or capacity_bytes < block_bytes:
            raise ValueError(
                f"need block_bytes >= 1 and capacity >= one block, got {capacity_bytes}, {block_bytes}"
            )
        n_blocks = capacity_bytes // block_bytes
        lock_fd, lock_path = _open_lock(name, lock_dir)
        try:
            with _flocked(lock_fd):
                index = _Segment(f"{name}-index", True, _HEADER_BYTES + n_blocks * _RECORD.itemsize)
                try:
                    arena = _Segment(f"{name}-arena", True, n_blocks * block_bytes)
                except BaseException:
                    index.unlink()
                    raise
                header = np.ndarray((), dtype=_HEADER, buffer=index.mm)
                header["version"], header["block_bytes"], header["n_blocks"] = VERSION, block_bytes, n_blocks
                header["magic"] = MAGIC  # last: an attach checks it
                del header
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(name, index, arena, lock_fd, lock_path)

    @classmethod
    def attach(cls, name: str, lock_dir: str | os.PathLike[str]) -> ShmEmbeddingCache:
        """Open a cache that ``create`` made (in any process of this host).

        Raises:
            FileNotFoundError: no such cache.
            ValueError: a bad name, or the segment is not a cache of this version.
        """
        _check_name(name)
        lock_fd, lock_path = _open_lock(name, lock_dir)
        try:
            with _flocked(lock_fd):
                index = _Segment(f"{name}-index", False)
                n_blocks = block_bytes = 0
                if index.mm.size() >= _HEADER_BYTES:
                    header = np.ndarray((), dtype=_HEADER, buffer=index.mm)
                    if int(header["magic"]) == MAGIC and int(header["version"]) == VERSION:
                        n_blocks, block_bytes = int(header["n_blocks"]), int(header["block_bytes"])
                    del header
                if n_blocks < 1 or index.mm.size() < _HEADER_BYTES + n_blocks * _RECORD.itemsize:
                    index.mm.close()
                    raise ValueError(f"shared memory {name!r} is not an embedding cache of version {VERSION}")
                arena = _Segment(f"{name}-arena", False)
                if arena.mm.size() < n_blocks * block_bytes:
                    index.mm.close()
                    arena.mm.close()
                    raise ValueError(f"shared memory {name!r}: arena smaller than its index says")
        except BaseException:
            os.close(lock_fd)
            raise
        return cls(name, index, arena, lock_fd, lock_path)

    @property
    def capacity(self) -> int:
        """Arena bytes (whole blocks)."""
        return self.n_blocks * self.block_bytes

    def get(self, key: bytes) -> Embedding | None:
        """A copy of the entry for ``key`` (it becomes the most recently used), or None. An entry
        whose CRC-32 does not match is removed and is a miss.

        Raises:
            ValueError: ``key`` is not 16 bytes.
        """
        k0, k1 = _split_key(key)
        with self._locked():
            i = self._find(k0, k1)
            if i is None:
                self._misses += 1
                return None
            r = self._recs[i]
            rows, cols, code = int(r["rows"]), int(r["cols"]), int(r["dtype"])
            nbytes, meta_len, gen, crc = int(r["nbytes"]), int(r["meta_len"]), int(r["gen"]), int(r["crc"])
            start, blocks = int(r["first"]) * self.block_bytes, int(r["blocks"])
            dtype = _DTYPES.get(code)
            sane = (
                dtype is not None
                and int(r["first"]) + blocks <= self.n_blocks
                and nbytes + meta_len <= blocks * self.block_bytes
                and rows * cols * dtype.itemsize == nbytes
            )
            out = meta_raw = None
            if sane and dtype is not None:
                self._recs["stamp"][i] = self._tick()
                out = torch.empty((rows, cols), dtype=dtype)
                out.view(-1).view(torch.uint8).numpy()[:] = self._data[start : start + nbytes]
                meta_raw = self._data[start + nbytes : start + nbytes + meta_len].tobytes()
        meta = None
        if out is not None and meta_raw is not None:
            payload = out.view(-1).view(torch.uint8).numpy()
            if zlib.crc32(meta_raw, zlib.crc32(payload.data)) == crc:
                meta = _loads(meta_raw)
        if out is None or meta is None:
            self._remove_if(i, gen)
            self._corrupt += 1
            self._misses += 1
            return None
        self._hits += 1
        return Embedding(out, meta)

    def put(self, key: bytes, emb: Embedding) -> bool:
        """Store a copy of ``emb`` under ``key`` (a live entry of that key only becomes the most
        recently used: keys name content), evicting least recently used entries to make room.
        Returns False when the entry needs more blocks than the arena has.

        Raises:
            ValueError: ``key`` is not 16 bytes, an unsupported dtype, or ``meta`` is not JSON-able.
        """
        k0, k1 = _split_key(key)
        code = _CODES.get(emb.data.dtype)
        if code is None:
            raise ValueError(f"unsupported embedding dtype {emb.data.dtype}")
        try:
            meta_raw = json.dumps(dict(emb.meta), sort_keys=True, separators=(",", ":")).encode()
        except (TypeError, ValueError) as e:
            raise ValueError(f"embedding meta is not JSON-able: {e}") from e
        src = emb.data.view(-1).view(torch.uint8).numpy()
        nbytes, size = src.nbytes, src.nbytes + len(meta_raw)
        crc = zlib.crc32(meta_raw, zlib.crc32(src.data))
        blocks = max(1, math.ceil(size / self.block_bytes))
        if blocks > self.n_blocks:
            self._refused += 1
            return False
        with self._locked():
            i = self._find(k0, k1)
            if i is not None:
                self._recs["stamp"][i] = self._tick()
                return True
            while (first := self._free_run(blocks)) is None:
                self._evict_lru()
            slot = int(np.flatnonzero(self._recs["state"] != _LIVE)[0])
            start = first * self.block_bytes
            self._data[start : start + nbytes] = src
            self._data[start + nbytes : start + size] = np.frombuffer(meta_raw, dtype=np.uint8)
            stamp = self._tick()
            rec = self._recs[slot]
            rec["dtype"], rec["crc"], rec["k0"], rec["k1"] = code, crc, k0, k1
            rec["first"], rec["blocks"], rec["nbytes"], rec["meta_len"] = first, blocks, nbytes, len(meta_raw)
            rec["rows"], rec["cols"], rec["stamp"], rec["gen"] = *emb.data.shape, stamp, stamp
            rec["state"] = _LIVE  # last: the entry is published
        return True

    def pop(self, key: bytes) -> bool:
        """Remove the entry for ``key``; False if there was none."""
        k0, k1 = _split_key(key)
        with self._locked():
            i = self._find(k0, k1)
            if i is not None:
                self._recs["state"][i] = _EMPTY
            return i is not None

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            return False
        k0, k1 = _split_key(key)
        with self._locked():
            return self._find(k0, k1) is not None

    def __len__(self) -> int:
        with self._locked():
            return int(np.count_nonzero(self._recs["state"] == _LIVE))

    def stats(self) -> ShmCacheStats:
        with self._locked():
            live = self._recs[self._recs["state"] == _LIVE]
            entries = len(live)
            data = int(live["nbytes"].sum() + live["meta_len"].sum())
            used = int(live["blocks"].sum()) * self.block_bytes
        counts = (self._hits, self._misses, self._evictions, self._refused, self._corrupt)
        return ShmCacheStats(entries, data, used, self.capacity, *counts)

    def close(self) -> None:
        """Unmap the segments and close the lock file (the cache lives on); idempotent."""
        if self._closed:
            return
        self._closed = True
        del self._header, self._recs, self._data  # views into the maps: gone before they close
        self._index.mm.close()
        self._arena.mm.close()
        os.close(self._lock_fd)

    def unlink(self) -> None:
        """Remove the segments' names and the lock file (mappings stay valid until ``close``). Call
        once, when no process needs the cache; idempotent."""
        self._index.unlink()
        self._arena.unlink()
        self._lock_path.unlink(missing_ok=True)

    def __enter__(self) -> ShmEmbeddingCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- under the lock ------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._closed:
            raise ValueError(f"shared memory cache {self.name!r} is closed")
        with self._thread_lock, _flocked(self._lock_fd):
            yield

    def _tick(self) -> int:
        t = int(self._header["clock"]) + 1
        self._header["clock"] = t
        return t

    def _find(self, k0: int, k1: int) -> int | None:
        r = self._recs
        hit = np.flatnonzero((r["state"] == _LIVE) & (r["k0"] == k0) & (r["k1"] == k1))
        return int(hit[0]) if len(hit) else None

    def _free_run(self, blocks: int) -> int | None:
        """The first block of the first run of ``blocks`` free blocks, or None."""
        live = self._recs[self._recs["state"] == _LIVE]
        edges = np.zeros(self.n_blocks + 1, dtype=np.int64)
        first = np.minimum(live["first"], self.n_blocks).astype(np.int64)
        end = np.minimum(first + live["blocks"].astype(np.int64), self.n_blocks)
        np.add.at(edges, first, 1)
        np.add.at(edges, end, -1)
        free = np.cumsum(edges[:-1]) == 0
        runs = np.concatenate(([0], np.cumsum(free)))
        fits = np.flatnonzero(runs[blocks:] - runs[:-blocks] == blocks)
        return int(fits[0]) if len(fits) else None

    def _evict_lru(self) -> None:
        live = np.flatnonzero(self._recs["state"] == _LIVE)
        victim = live[np.argmin(self._recs["stamp"][live])]
        self._recs["state"][victim] = _EMPTY
        self._evictions += 1

    def _remove_if(self, i: int, gen: int) -> None:
        """Remove record ``i`` if it still holds the entry of generation ``gen``."""
        with self._locked():
            if self._recs["state"][i] == _LIVE and int(self._recs["gen"][i]) == gen:
                self._recs["state"][i] = _EMPTY


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"bad shared memory cache name {name!r}: letters, digits and _.- only, at most 200")


def _split_key(key: bytes) -> tuple[int, int]:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"cache keys are {KEY_BYTES} bytes, got {key!r:.40}")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


def _open_lock(name: str, lock_dir: str | os.PathLike[str]) -> tuple[int, Path]:
    path = Path(lock_dir) / f"{name}.lock"
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600), path


@contextmanager
def _flocked(fd: int) -> Iterator[None]:
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _loads(raw: bytes) -> dict[str, Any] | None:
    try:
        meta = json.loads(raw)
    except ValueError:
        return None
    return meta if isinstance(meta, dict) else None
