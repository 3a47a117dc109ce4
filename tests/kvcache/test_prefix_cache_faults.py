"""One test per KV-cache fault class of ../shared/GUIDE.md section 5 (faults peers shipped).

Reads are checked with slot labels (``tests.helpers.prefix``): a request that reads KV of any other
prefix (a pseudo-hit, a recycled or stale slot) fails the test.
"""

from __future__ import annotations

import pytest

from swaserve.config import SWA
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.prefix_cache import PrefixCache
from tests.helpers.prefix import PrefixHarness, run_stream


def test_window_count_restarts_at_every_tombstone() -> None:
    """Path: 8 live tokens, 4 tombstoned, 2 live (< W = 4). A hit ending after the 2 live tokens
    would read recycled SWA slots; the longest window-safe hit is the first 8 tokens."""
    P, W = 2, 4
    full, swa = PagePool(32, 1, 1), PagePool(32, 1, 1)
    cache = PrefixCache(P, W, full, swa)
    tokens = list(range(1, 21))
    f = full.allocate(4)
    s = swa.allocate(4)
    assert f is not None and s is not None
    cache.tree.insert(tokens[:8], f, list(s))
    f2 = full.allocate(3)
    s2 = swa.allocate(1)
    assert f2 is not None and s2 is not None
    _node, _, tree_swa = cache.tree.insert(tokens[:14], f + f2, [None] * 6 + list(s2))
    assert tree_swa[:4] == s and tree_swa[4:6] == [None, None]  # the middle node is a tombstone
    assert cache.match_length(tokens, 18) == (8, 8)
    acq = cache.acquire(tokens, 18)
    assert acq is not None and acq.length == 8
    cache.release(acq.lock)


def tombstoned_prefix(h: PrefixHarness, rid: str, prompt: list[int]) -> None:
    """Prefill ``prompt[:24]`` in chunks of 8 (page 2, W 3), inserting only after the third chunk:
    by then the request has freed its SWA pages 0-5, so the tree gets [0, 12) as a tombstone and
    [12, 24) live."""
    assert h.admit(rid, prompt, 2)
    h.advance(rid, 8, 7, partial=False)
    h.advance(rid, 8, 7, partial=False)
    h.advance(rid, 8, 7, partial=True)
    h.check()


def test_partial_insert_of_chunked_prefill_keeps_freed_swa_as_tombstone() -> None:
    """Chunked prefill inserts its prefix while running; SWA pages it already freed must enter the
    tree as tombstones, so a later request cannot hit where only full KV survives."""
    h = PrefixHarness(page=2, window=3, full_pages=64, swa_pages=32)
    prompt = list(range(1, 31))
    tombstoned_prefix(h, "a", prompt)
    cache = h.kv.cache
    assert cache is not None
    tomb = [x for x in cache.tree.nodes() if x.swa is None]
    assert [len(x.key) for x in tomb] == [12], "the freed SWA prefix [0, 12) must be one tombstone"
    # b's boundary 20 needs SWA [17, 20): live. c's boundary 8 needs [5, 8): freed -> no hit at all
    assert h.admit("b", [*prompt[:21], 99], 1) and h.live["b"].hit == 20
    assert h.admit("c", [*prompt[:9], 99], 1) and h.live["c"].hit == 0
    h.check()
    h.drain_and_flush()


@pytest.mark.parametrize("seed", range(4))
def test_page_larger_than_window_never_leaves_a_tombstone_leaf(seed: int) -> None:
    """Page 8 > W = 3 under eviction pressure: no tombstone ever becomes a leaf, nothing leaks
    (invariants after every operation; every page free after drain + flush)."""
    cfg = {
        "page": 8, "window": 3, "full_pages": 14, "swa_pages": 9, "layout": "hybrid",
        "host": (6, 3) if seed % 2 else None, "policy": "on_evict",
    }  # fmt: skip
    h = run_stream(cfg, seed, 250)
    assert h.hits > 0


def test_swa_eviction_spares_the_next_chunks_window() -> None:
    """Between chunks of a prefill whose prefix is already in the tree, evict all SWA the cache
    can: the KV the next chunk reads (its last W tokens) must survive."""
    h = PrefixHarness(page=2, window=5, full_pages=64, swa_pages=24)
    prompt = list(range(1, 41))
    assert h.admit("a", prompt, 1)
    cache = h.kv.cache
    assert cache is not None
    tombstoned = 0
    while h.live["a"].computed < len(prompt):
        h.advance("a", 6, 7)
        before = h.kv.swa.pool.num_free
        cache.evict(SWA, h.kv.swa.pool.num_pages)
        tombstoned += h.kv.swa.pool.num_free - before
        h.check()
    assert tombstoned > 0, "nothing was evicted: the test would not cover the fault"
    h.advance("a", 1, 7)  # reads checked by labels
    h.drain_and_flush()


def test_reviving_a_tombstone_takes_only_the_reviver_pages() -> None:
    """A tombstoned prefix revived by a request that recomputed it must own exactly that
    request's pages (no live slot freed through a stale mapping): invariants, label-checked hits
    inside the revived range, and a clean drain."""
    h = PrefixHarness(page=2, window=3, full_pages=96, swa_pages=48)
    prompt = list(range(1, 31))
    tombstoned_prefix(h, "a", prompt)
    cache = h.kv.cache
    assert cache is not None
    # r cannot hit inside the tombstone, so it computes [0, 14) itself in one chunk (live SWA for
    # all of it) and inserts it: the tombstone [0, 12) is revived with r's pages
    assert h.admit("r", [*prompt[:14], 99, 98], 1) and h.live["r"].hit == 0
    h.advance("r", 14, 7, partial=False)
    r_swa = list(h.kv.swa.tables["r"].pages)
    assert h.kv.cache_partial("r", prompt[:14])
    h.check()
    revived = [x for x in cache.tree.nodes() if x.key[:2] == prompt[:2]]
    assert len(revived) == 1 and revived[0].swa == r_swa[:6]
    assert not [x for x in cache.tree.nodes() if x.swa is None]
    for cut in (4, 8, 12):  # hits inside the revived range: label-checked by the harness
        assert h.admit(f"x{cut}", [*prompt[: cut + 1], 90], 1) and h.live[f"x{cut}"].hit == cut
        h.finish(f"x{cut}")
        h.check()
    h.drain_and_flush()


def test_branch_point_found_by_traffic_gets_a_window() -> None:
    """A prefix cached with its SWA freed up to near its end cannot serve a hit at an inner page
    boundary. The first request that leaves the tree there (misses past its window-safe hit) ends
    a prefill chunk exactly at the divergence point, and its partial insert keeps that window, so
    the next request branching at the same point hits it."""
    h = PrefixHarness(page=2, window=3, full_pages=64, swa_pages=32)
    prompt = list(range(1, 31))
    assert h.admit("a", prompt, 1)
    while not h.advance("a", 8, 7, partial=False):
        pass
    assert h.admit("b", [*prompt[:12], 99, 98, 97, 96, 95], 1)
    assert h.live["b"].hit == 0 and h.kv.admitted["b"].diverge == 12
    assert h.kv.max_chunk("b", 8, 16) == 4, "the chunk must end at the divergence point"
    while not h.advance("b", 8, 7):
        pass
    assert h.admit("c", [*prompt[:12], 55, 54, 53], 1) and h.live["c"].hit == 12
    while not h.advance("c", 8, 7):
        pass
    h.check()
    h.drain_and_flush()


def _prefill(h: PrefixHarness, rid: str, prompt: list[int]) -> None:
    assert h.admit(rid, prompt, 1)
    while not h.advance(rid, 8, 7):  # chunks of 8, each inserted (windows at 8, 16, 24)
        pass


def test_superseded_chunk_windows_go_before_a_prompts_continuation_point() -> None:
    """A finished prompt's chunk-end windows above its last chunk end serve only a prompt diverging
    exactly there (its next turn diverges at the last chunk end or its end). Under SWA pressure a
    later prompt's such windows go before an earlier prompt's last-chunk window, which plain LRU
    would evict first; a hit ending at a demoted window restamps it."""
    h = PrefixHarness(page=2, window=3, full_pages=128, swa_pages=64)
    cache = h.kv.cache
    assert cache is not None
    a, b = list(range(1, 31)), list(range(101, 131))
    _prefill(h, "a", a)
    _prefill(h, "b", b)

    def hit(prompt: list[int], at: int) -> int:
        return cache.match_length([*prompt[:at], 99, 98], at + 2)[0]

    assert (hit(a, 24), hit(b, 16), hit(b, 8)) == (24, 16, 8)
    while hit(a, 24) == 24 and h.kv.swa.pool.num_used:
        assert cache.evict(SWA, 1) >= 1
        h.check()
        if hit(a, 24) < 24:  # a's continuation point went only after b's superseded windows
            assert hit(b, 16) < 16 and hit(b, 8) < 8
    assert hit(b, 16) < 16, "b's superseded windows were never evicted: the test covers nothing"
    h.drain_and_flush()

    _prefill(h, "a", a)
    _prefill(h, "b", b)
    assert h.admit("c", [*b[:16], 99, 98], 1) and h.live["c"].hit == 16  # restamps b's window at 16
    h.finish("c")
    while hit(b, 16) == 16 and h.kv.swa.pool.num_used:
        assert cache.evict(SWA, 1) >= 1
    assert hit(a, 8) < 8 and hit(b, 8) < 8, "a used window went before unused demoted ones"
    h.drain_and_flush()


def test_a_branch_point_window_is_not_demoted() -> None:
    """A window where the tree branches (a shared system prompt's end, found by traffic) is where
    the next session diverges too: finishing a prompt through it must not demote it."""
    h = PrefixHarness(page=2, window=3, full_pages=128, swa_pages=64)
    cache = h.kv.cache
    assert cache is not None
    system = list(range(1, 13))
    _prefill(h, "a", [*system, *range(200, 218)])
    cache._evict_swa(lambda: False)  # every SWA-only victim: a's inner windows are gone
    _prefill(h, "b", [*system, *range(300, 318)])  # no hit; diverges at 12: its chunk ends there
    assert h.hits == 0
    branch = [x for x in cache.tree.nodes() if len(x.children) == 2]
    assert len(branch) == 1 and branch[0].swa is not None
    assert branch[0].stamp > 0, "the branch point's window was demoted"
    h.drain_and_flush()
