"""EmbeddingCache (LRU by bytes) and InFlight (one computation per key)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.encoder.cache import ENTRY_OVERHEAD_BYTES, Embedding, EmbeddingCache, InFlight


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def emb(rows: int, hidden: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32) -> Embedding:
    g = torch.Generator().manual_seed(seed)
    return Embedding(torch.randn(rows, hidden, generator=g).to(dtype), {"rows": rows})


def size(rows: int, hidden: int = 8, itemsize: int = 4) -> int:
    return rows * hidden * itemsize + ENTRY_OVERHEAD_BYTES


def test_embedding_checks_its_tensor() -> None:
    with pytest.raises(ValueError, match="2-D"):
        Embedding(torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        Embedding(torch.zeros(4, 3).t())
    with pytest.raises(ValueError, match="mapping"):
        Embedding(torch.zeros(4, 3), [1, 2])  # type: ignore[arg-type]
    assert emb(3).nbytes == size(3)


def test_hit_is_bitwise_what_was_put_and_counts() -> None:
    c = EmbeddingCache(10_000)
    e = emb(5, dtype=torch.bfloat16, seed=3)
    assert c.get(key(1)) is None
    assert c.put(key(1), e)
    got = c.get(key(1))
    assert got is not None and got.meta == {"rows": 5}
    assert torch.equal(got.data.view(torch.int16), e.data.view(torch.int16))
    s = c.stats()
    assert (s.entries, s.bytes, s.capacity, s.hits, s.misses) == (1, size(5, itemsize=2), 10_000, 1, 1)
    assert key(1) in c and key(2) not in c and len(c) == 1


def test_lru_evicts_least_recently_used_with_exact_bytes() -> None:
    c = EmbeddingCache(3 * size(4))
    for i in range(3):
        assert c.put(key(i), emb(4, seed=i))
    assert c.bytes == 3 * size(4)
    assert c.get(key(0)) is not None  # 1 is now the least recently used
    assert c.put(key(3), emb(4, seed=3))
    assert key(1) not in c and all(key(i) in c for i in (0, 2, 3))
    assert c.put(key(4), emb(8, seed=4))  # twice the size: evicts 2 then 0
    assert [k in c for k in map(key, range(5))] == [False, False, False, True, True]
    assert c.bytes == size(4) + size(8)
    assert c.stats().evictions == 3
    assert c.pop(key(3)) is not None and c.pop(key(3)) is None
    assert c.bytes == size(8) and len(c) == 1


def test_too_big_is_refused_and_changes_nothing() -> None:
    c = EmbeddingCache(2 * size(4))
    c.put(key(0), emb(4))
    c.put(key(1), emb(4))
    assert size(20) > 2 * size(4)
    assert not c.put(key(2), emb(20))
    assert len(c) == 2 and c.bytes == 2 * size(4)
    s = c.stats()
    assert (s.refused, s.evictions) == (1, 0)


def test_put_of_a_present_key_replaces_it() -> None:
    c = EmbeddingCache(10 * size(4))
    c.put(key(0), emb(4))
    c.put(key(1), emb(4))
    c.put(key(0), emb(6, seed=9))
    assert c.bytes == size(4) + size(6) and len(c) == 2
    got = c.get(key(0))
    assert got is not None and got.data.shape == (6, 8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "pop"]), st.integers(0, 7), st.integers(0, 6))))
def test_byte_accounting_matches_a_model(ops: list[tuple[str, int, int]]) -> None:
    """After any mix of puts, gets and pops: bytes == the entries' sizes, within capacity, and
    the survivors are exactly the most recently used ones a reference LRU keeps."""
    cap = 5 * size(3)
    c = EmbeddingCache(cap)
    model: dict[bytes, int] = {}  # insertion order = LRU order, value = size
    for op, i, rows in ops:
        k = key(i)
        if op == "put":
            s = size(rows)
            ok = c.put(k, emb(rows, seed=i))
            assert ok == (s <= cap)
            if ok:
                model.pop(k, None)
                while sum(model.values()) + s > cap:
                    model.pop(next(iter(model)))
                model[k] = s
        elif op == "get":
            assert (c.get(k) is not None) == (k in model)
            if k in model:
                model[k] = model.pop(k)
        else:
            assert (c.pop(k) is not None) == (k in model)
            model.pop(k, None)
        assert c.bytes == sum(model.values()) <= cap
        assert set(model) == {k for k in map(key, range(8)) if k in c}


def test_in_flight_dedupe_one_computation_both_released() -> None:
    f = InFlight()
    computed = []
    for req in ("a", "b"):
        if f.claim(key(1)):
            computed.append(req)
        f.wait(key(1), req)
    assert computed == ["a"] and key(1) in f and len(f) == 1
    assert f.waiters(key(1)) == ["a", "b"]
    f.wait(key(1), "b")  # registered twice, released once
    assert f.finish(key(1)) == ["a", "b"]
    assert key(1) not in f and f.waiters(key(1)) == []
    assert (f.claims, f.joins) == (1, 1)
    with pytest.raises(KeyError):
        f.finish(key(1))
    with pytest.raises(KeyError):
        f.wait(key(2), "c")


def test_in_flight_fail_releases_waiters_and_allows_a_retry() -> None:
    f = InFlight()
    assert f.claim(key(1)) and not f.claim(key(1))
    f.wait(key(1), "x")
    err = RuntimeError("encoder died")
    assert f.fail(key(1), err) == ["x"]
    assert f.last_error is err and f.failures == 1
    assert f.claim(key(1))  # a later request computes it again
    assert f.finish(key(1)) == []


def test_in_flight_many_keys_interleaved() -> None:
    rng = random.Random(0)
    f = InFlight()
    owners: dict[bytes, str] = {}
    for r in range(200):
        k = key(rng.randrange(10))
        if f.claim(k):
            owners[k] = f"r{r}"
        f.wait(k, f"r{r}")
    total = sum(len(f.finish(k)) for k in list(owners))
    assert total == 200 and len(f) == 0 and f.claims == len(owners)
