"""Encoder placement: rendezvous order, movement when an encoder joins, the load bound."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from swaserve.encoder.placement import choose, rank
from swaserve.gcache.l3 import owner


def key(i: int) -> bytes:
    return hashlib.blake2b(b"item" + i.to_bytes(8, "little"), digest_size=16).digest()


ENCODERS = [f"10.0.0.{i}:50061" for i in range(8)]
KEYS = [key(i) for i in range(2000)]


def test_stable_and_independent_of_input_order() -> None:
    for k in KEYS[:50]:
        a = choose(k, ENCODERS, {})
        assert a == choose(k, list(reversed(ENCODERS)), {}) == choose(k, ENCODERS + ENCODERS[:2], {})
        assert sorted(a) == sorted(ENCODERS)
        assert a[0] == owner(k, ENCODERS)  # the same score as the L3 pages' placement
    assert choose(KEYS[0], [], {}) == []
    # pinned: a change of the hash would move every cached item at once
    assert choose(bytes(16), ["a", "b", "c", "d"], {}) == ["d", "c", "a", "b"]


def test_spread_is_even() -> None:
    first = Counter(rank(k, ENCODERS)[0] for k in KEYS)
    assert len(first) == 8 and max(first.values()) < 2000 / 8 * 1.35  # ~250 each, sd ~15


def test_a_joining_encoder_takes_about_its_share_and_nothing_else_moves() -> None:
    new = "10.0.0.99:50061"
    before = {k: rank(k, ENCODERS)[0] for k in KEYS}
    after = {k: rank(k, [*ENCODERS, new])[0] for k in KEYS}
    moved = [k for k in KEYS if before[k] != after[k]]
    assert all(after[k] == new for k in moved)  # keys move only to the newcomer
    # expected 2000/9 = 222, sd = sqrt(2000 * 1/9 * 8/9) = 14: a 5-sd window
    assert 150 < len(moved) < 295
    # and when it leaves again, exactly those keys go back
    assert {k: rank(k, ENCODERS)[0] for k in KEYS} == before


def test_overloaded_encoder_is_demoted_keeping_the_order() -> None:
    k = KEYS[7]
    order = choose(k, ENCODERS, {})
    busy = order[0]
    load = dict.fromkeys(ENCODERS, 2.0)
    load[busy] = 10.0  # mean 3, limit 1.25 * 3 + 1 = 4.75
    got = choose(k, ENCODERS, load)
    assert got == [*order[1:], busy]
    load[busy] = 3.5  # mean 2.1875, limit 3.73: stays first
    assert choose(k, ENCODERS, load)[0] == busy
    two = choose(k, ENCODERS, {order[0]: 50.0, order[1]: 50.0})
    assert two == [*order[2:], order[0], order[1]]


def test_slack_lets_an_idle_fleet_take_one_item() -> None:
    k = KEYS[3]
    order = choose(k, ENCODERS, {})
    assert choose(k, ENCODERS, {order[0]: 1.0}) == order  # 1 <= 1.25/8 + 1
    assert choose(k, ENCODERS, {order[0]: 2.0})[0] == order[1]  # 2 > 2 * 1.25/8 + 1
    tokens = {order[0]: 1000.0}  # loads in tokens: one item is ~1000
    assert choose(k, ENCODERS, tokens)[0] == order[1]
    assert choose(k, ENCODERS, tokens, slack=1000.0) == order


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="bound"):
        choose(KEYS[0], ENCODERS, {}, bound=0.9)
    with pytest.raises(ValueError, match="slack"):
        choose(KEYS[0], ENCODERS, {}, slack=-1.0)
    with pytest.raises(ValueError, match="loads"):
        choose(KEYS[0], ENCODERS, {ENCODERS[0]: -1.0})
