"""``gcache.l3.Throttle``: the rate limit of the L3 failure warnings (engine and sharded store)."""

from __future__ import annotations

from swaserve.gcache.l3 import Throttle


def test_throttle_lets_one_event_a_period_through_per_key_and_counts_the_rest() -> None:
    t = [0.0]
    throttle = Throttle(60.0, lambda: t[0])
    assert throttle("a") == 0 and throttle("b") == 0  # the first of each key
    assert [throttle("a") for _ in range(3)] == [None, None, None]
    t[0] = 59.9
    assert throttle("a") is None
    t[0] = 60.0
    assert throttle("a") == 4 and throttle("b") == 0  # 4 held back on a since the last; none on b
    assert throttle("a") is None
