"""The shared byte budget and its adaptive split (``kvcache.budget``, ``kvcache.adaptive``).

Exactness, invariants and drain of the shared budget under random streams are in
``test_prefix_cache_props.py`` (``shared``); here: the byte accounting of pools on one budget, the
ghost rules, and the named traffic-shift test where the split must follow the workload."""

from __future__ import annotations

import random

import pytest

from swaserve.kvcache.adaptive import AdaptiveSplit, chain_hashes
from swaserve.kvcache.budget import ByteBudget
from swaserve.kvcache.pool import PagePool
from swaserve.kvcache.radix import RadixNode
from tests.helpers.prefix import PrefixHarness


def test_pools_on_one_budget_share_bytes_and_reservations() -> None:
    b = ByteBudget(100)
    full, swa = PagePool(0, 10, 1, b), PagePool(0, 30, 1, b)
    assert (full.num_pages, swa.num_pages) == (10, 3)
    assert swa.reserve(2) and b.reserved == 60
    assert full.num_available == 4  # 40 B left unpromised
    assert not full.reserve(5)
    pages = swa.allocate(3, from_reserved=2)
    assert pages is not None and b.used == 90 and b.reserved == 0
    assert full.num_free == 1 and full.allocate(2) is None
    f = full.allocate(1)
    assert f is not None and full.num_free == 0 and swa.num_free == 0
    swa.free(pages)
    assert full.num_free == 9 and swa.num_free == 3 and b.used == 10
    with pytest.raises(ValueError):
        swa.free(pages[:1])  # double free
    assert max(full.issued, swa.issued) <= 10  # ids are issued lazily, never past the most held


def _node(key: list[int]) -> RadixNode:
    return RadixNode(key, None)


def test_split_moves_toward_the_side_whose_ghosts_hit() -> None:
    # a window is 2 pages x 60 B = 12 full pages: 6 pages of SWA-ghost hit are 0.5 per unit kept
    s = AdaptiveSplit(1000, 10, 60, 4, 2, initial_swa_share=0.5, step=0.1, max_vote=3.0)
    s.update(gain_swa=6, gain_full=0)
    assert s.target == pytest.approx(550)
    s.update(gain_swa=0, gain_full=36)  # 36 / (36 + 12) = 0.75 per unit kept
    assert s.target == pytest.approx(550 - 0.1 * 1000 * 0.75)
    s.update(gain_swa=24, gain_full=36)  # 24 / 12 - 0.75: the net of both sides
    assert s.target == pytest.approx(475 + 0.1 * 1000 * 1.25)
    s.update(gain_swa=120, gain_full=0)  # 10 per unit, capped at max_vote
    assert s.target == pytest.approx(600 + 0.1 * 1000 * 3.0)
    for _ in range(200):
        s.update(0, 8)
    assert s.target == 0  # clamped
    assert s.swa_first(1) and not s.swa_first(0)
    with pytest.raises(ValueError):
        AdaptiveSplit(1000, 10, 60, 4, 2, max_vote=-1)


def test_full_ghosts_count_only_up_to_a_page_a_hit_could_end_at_and_expire() -> None:
    P = 2
    s = AdaptiveSplit(100, 10, 60, P, 1, horizon=1.0)
    tokens = list(range(1, 13))  # 6 pages
    hashes = chain_hashes(tokens, P, 6)
    s.lost_pages(hashes[2:5], 30)  # pages 2..4 of one node: a hit may end after page 4
    assert s.full_gain(tokens, [], 6) == 0  # the path must reach the ghosts: page 0 is not one
    s2 = AdaptiveSplit(100, 10, 60, P, 1, horizon=1.0)
    s2.lost_pages(hashes[:4], 40)
    assert s2.full_gain(tokens, [], 6) == 4
    s2.lost_pages(chain_hashes([99] * 12, P, 6), 70)  # 70 B lost since: within the horizon
    assert s2.full_gain(tokens, [], 6) == 4
    s2.lost_pages(chain_hashes([98] * 12, P, 6), 40)  # 110 B since: pages 0..3 expire
    assert s2.full_gain(tokens, [], 6) == 0


def test_swa_ghost_is_recent_for_one_horizon_of_losses() -> None:
    s = AdaptiveSplit(120, 10, 60, 2, 1, horizon=1.0)
    x = _node([1, 2])
    s.lost_window(x, 1)  # 60 B
    assert s._recent_window(x)
    s.lost_window(_node([3, 4]), 1)
    assert s._recent_window(x)  # 120 B since its loss: still within the budget's worth
    s.lost_window(_node([5, 6]), 1)
    assert not s._recent_window(x)


# -- the traffic shift ------------------------------------------------------------------------------
def _serve(h: PrefixHarness, rid: str, prompt: list[int]) -> None:
    assert h.admit(rid, prompt, 1), "admission must succeed alone"
    while not h.advance(rid, 16, 1):
        pass
    h.check()


def _share(h: PrefixHarness) -> float:
    split = h.kv.cache.split  # type: ignore[union-attr]
    assert split is not None
    return split.target / split.total


def test_split_follows_a_traffic_shift_from_branchy_prefixes_to_independent_sessions() -> None:
    """Phase 1: long shared prefixes with many branch points (a hit ends at a branch point, which
    needs only that point's SWA window): SWA windows are worth more than full pages, the SWA share
    rises. Phase 2: short independent multi-turn sessions (each next turn hits its own previous
    prompt, whose full pages are what the cache runs short of): the share falls."""
    rng = random.Random(7)
    P, W = 4, 8
    h = PrefixHarness(page=P, window=W, full_pages=160, swa_pages=40, shared=True)
    start = _share(h)
    stems = [[rng.randrange(1, 60) for _ in range(40 * P)] for _ in range(3)]
    n = 0
    for _ in range(300):
        stem = rng.choice(stems)
        cut = rng.randrange(4, 40) * P
        n += 1
        _serve(h, f"a{n}", stem[:cut] + [rng.randrange(60, 90) for _ in range(rng.randrange(2, 3 * P))])
    after_branchy = _share(h)
    assert after_branchy > start + 0.05, (start, after_branchy)
    sessions: list[list[int]] = []
    for _ in range(600):
        if len(sessions) < 12 or rng.random() < 0.1:
            sessions.append([rng.randrange(100, 200) for _ in range(3 * P)])
        i = rng.randrange(max(0, len(sessions) - 12), len(sessions))
        sessions[i] = sessions[i] + [rng.randrange(100, 200) for _ in range(rng.randrange(P, 3 * P))]
        n += 1
        _serve(h, f"b{n}", sessions[i])
    after_sessions = _share(h)
    assert after_sessions < after_branchy - 0.1, (after_branchy, after_sessions)
    h.drain_and_flush()
