"""ShmEmbeddingCache: the per-machine tier in shared memory (one process, then two)."""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import random
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swaserve.encoder.cache import Embedding
from swaserve.encoder.shm_cache import ShmEmbeddingCache

HIDDEN = 16


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def content(j: int, dtype: torch.dtype = torch.float32) -> Embedding:
    """The embedding every process derives for item ``j`` (rows vary: 1 to 40)."""
    g = torch.Generator().manual_seed(j)
    rows = 1 + j * 7 % 40
    return Embedding(torch.randn(rows, HIDDEN, generator=g).to(dtype), {"j": j, "frames": [rows, 1]})


def same(a: Embedding | None, b: Embedding) -> bool:
    if a is None or a.data.dtype != b.data.dtype or a.data.shape != b.data.shape:
        return False
    return a.data.view(-1).view(torch.uint8).equal(b.data.view(-1).view(torch.uint8)) and a.meta == b.meta


@pytest.fixture
def make(tmp_path: Path) -> Iterator:
    made: list[ShmEmbeddingCache] = []

    def make(capacity: int = 64 << 10, block_bytes: int = 1024) -> ShmEmbeddingCache:
        c = ShmEmbeddingCache.create(
            f"swaserve-test-{uuid.uuid4().hex[:12]}", capacity, tmp_path, block_bytes
        )
        made.append(c)
        return c

    yield make
    for c in made:
        c.unlink()
        c.close()


def test_round_trip_is_bitwise_and_keeps_meta(make) -> None:
    c = make()
    stored = [content(j, dt) for j, dt in enumerate((torch.float32, torch.bfloat16, torch.float16))]
    stored.append(Embedding(torch.zeros(0, HIDDEN), {}))  # no rows
    for j, e in enumerate(stored):
        assert c.put(key(j), e)
        assert same(c.get(key(j)), e)
    assert c.get(key(99)) is None
    s = c.stats()
    assert (s.entries, s.hits, s.misses, s.corrupt) == (4, 4, 1, 0)
    meta_bytes = [len(b'{"frames":[%d,1],"j":%d}' % (1 + j * 7 % 40, j)) for j in range(3)] + [len(b"{}")]
    assert s.bytes == sum(e.data.nbytes for e in stored) + sum(meta_bytes)
    assert s.used_bytes == 4 * 1024 and s.capacity == 64 << 10  # each under one block
    assert key(0) in c and key(99) not in c and b"short" not in c and len(c) == 4


def test_attach_in_the_same_process_shares_entries(make, tmp_path: Path) -> None:
    c = make()
    with ShmEmbeddingCache.attach(c.name, tmp_path) as other:
        assert other.put(key(1), content(1))
        assert same(c.get(key(1)), content(1))
        assert other.pop(key(1)) and not other.pop(key(1))
        assert c.get(key(1)) is None
    with pytest.raises(ValueError, match="closed"):
        other.get(key(1))
    other.close()  # idempotent


def test_bad_inputs(make, tmp_path: Path) -> None:
    c = make()
    with pytest.raises(ValueError, match="16 bytes"):
        c.get(b"abc")
    with pytest.raises(ValueError, match="dtype"):
        c.put(key(0), Embedding(torch.zeros(2, 2, dtype=torch.complex64)))
    with pytest.raises(ValueError, match="JSON"):
        c.put(key(0), Embedding(torch.zeros(2, 2), {"x": object()}))
    with pytest.raises(FileExistsError):
        ShmEmbeddingCache.create(c.name, 4096, tmp_path, 1024)
    with pytest.raises(FileNotFoundError):
        ShmEmbeddingCache.attach(f"swaserve-test-missing-{uuid.uuid4().hex[:8]}", tmp_path)
    with pytest.raises(ValueError, match="name"):
        ShmEmbeddingCache.create("a/b", 4096, tmp_path)
    with pytest.raises(ValueError, match="capacity"):
        make(capacity=100, block_bytes=1024)


def test_corrupt_arena_is_a_miss_and_removed(make) -> None:
    c = make(capacity=16 << 10)
    assert c.put(key(1), content(1)) and c.put(key(2), content(2))
    with open(f"/dev/shm/{c.name}-arena", "r+b") as f:  # another writer scribbles on entry 1
        f.seek(8)
        f.write(b"\xde\xad\xbe\xef" * 4)
    assert c.get(key(1)) is None
    assert key(1) not in c and len(c) == 1
    assert same(c.get(key(2)), content(2))
    s = c.stats()
    assert (s.corrupt, s.hits, s.misses) == (1, 1, 1)
    assert c.put(key(1), content(1)) and same(c.get(key(1)), content(1))  # stored again, served


def test_lru_eviction_and_contiguous_runs(make) -> None:
    c = make(capacity=8 << 10, block_bytes=1024)  # 8 blocks
    two_blocks = [
        Embedding(torch.full((20, HIDDEN), float(i)), {"i": i}) for i in range(6)
    ]  # 1280 + meta bytes
    for i in range(4):
        assert c.put(key(i), two_blocks[i])
    assert c.stats().used_bytes == 8 << 10
    assert c.get(key(0)) is not None  # 1 is now the least recently used
    assert c.put(key(4), two_blocks[4])
    assert [key(i) in c for i in range(5)] == [True, False, True, True, True]
    # four blocks in a row: evicting 2 (blocks 4-5) is not enough, 3 (blocks 6-7) goes too
    big = Embedding(torch.ones(60, HIDDEN), {})
    assert c.put(key(10), big)
    assert [key(i) in c for i in (0, 2, 3, 4, 10)] == [True, False, False, True, True]
    assert same(c.get(key(0)), two_blocks[0]) and same(c.get(key(4)), two_blocks[4])
    assert same(c.get(key(10)), big)
    s = c.stats()
    assert (s.entries, s.evictions, s.used_bytes, s.capacity) == (3, 3, 8 << 10, 8 << 10)
    assert not c.put(key(11), Embedding(torch.ones(200, HIDDEN), {}))  # 12.8 KB > the arena
    assert c.stats().refused == 1 and len(c) == 3


def test_put_of_a_present_key_only_touches(make) -> None:
    c = make(capacity=4 << 10, block_bytes=1024)
    a = [Embedding(torch.full((20, HIDDEN), float(i)), {}) for i in range(3)]
    assert c.put(key(0), a[0]) and c.put(key(1), a[1])
    assert c.put(key(0), a[2])  # same key = same content: kept, now most recent
    assert same(c.get(key(0)), a[0])
    assert c.put(key(2), a[2])
    assert key(1) not in c and key(0) in c


def _child(name: str, lock_dir: str, seconds: float, ready: Any, go: Any) -> None:
    with ShmEmbeddingCache.attach(name, lock_dir) as c:
        got = c.get(key(0))
        if got is None or not same(got, content(0, torch.bfloat16)):
            raise SystemExit(2)
        c.put(key(1), got)  # the parent checks what this process read
        c.put(key(2), content(2))
        ready.set()
        if not go.wait(60):  # the parent has read key 1: the stress may evict it from now on
            raise SystemExit(5)
        raise SystemExit(_stress(c, seconds, seed=1))


def _stress(c: ShmEmbeddingCache, seconds: float, seed: int, rounds: int = 1000) -> int:
    """Puts and gets of 30 items in a cache too small for them, for ``rounds`` and at least
    ``seconds``. Returns 0 if every hit equaled its item, 3 if one did not, 4 on CRC failures."""
    rng = random.Random(seed)
    end = time.monotonic() + seconds
    for n in itertools.count():
        if n >= rounds and time.monotonic() >= end:
            break
        j = 100 + rng.randrange(30)
        if rng.random() < 0.5:
            c.put(key(j), content(j))
        else:
            got = c.get(key(j))
            if got is not None and not same(got, content(j)):
                return 3
    return 4 if c.stats().corrupt else 0


@pytest.mark.cluster  # a spawned child process
def test_two_processes_share_entries_and_never_see_torn_ones(make, tmp_path: Path) -> None:
    c = make(capacity=12 << 10, block_bytes=512)
    assert c.put(key(0), content(0, torch.bfloat16))
    ctx = multiprocessing.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_child, args=(c.name, str(tmp_path), 0.4, ready, go))
    child.start()
    try:
        assert ready.wait(60)
        assert same(c.get(key(1)), content(0, torch.bfloat16))  # what the child read, bitwise
        go.set()
        assert _stress(c, 0.4, seed=2) == 0  # meanwhile the child does the same
    finally:
        go.set()
        child.join(60)
    assert child.exitcode == 0, "2: the first get missed, 3: a hit differed, 4: CRC failures, 5: no go"
    got2 = c.get(key(2))
    assert got2 is None or same(got2, content(2))  # the stress may have evicted it
    s = c.stats()
    assert s.corrupt == 0 and s.hits > 20 and s.evictions > 20, s
    assert s.used_bytes <= c.capacity
