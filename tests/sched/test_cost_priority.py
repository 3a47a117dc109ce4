"""The cost model (``swaserve.sched.cost``) and the compute-aware priority key
(``swaserve.sched.priority``): shortest uncached work first, older first among equals, the wait bound."""

from __future__ import annotations

import pytest

from swaserve.sched.cost import MIMO_V2_FLASH_H200, CostModel, preset
from swaserve.sched.priority import ComputeAwarePriority

COST = CostModel("unit", 0.0, 1e-3, 0.0, 0.01, 1e-3, 0.0)  # 1 ms per prefill token, no base


def test_cost_model() -> None:
    m = CostModel("m", 0.5, 1e-3, 1e-6, 0.01, 1e-3, 1e-6, 100, 1000, 128, 1e6)
    assert m.prefill_s(0, 10) == 0.0
    assert m.prefill_s(10, 20) == pytest.approx(0.5 + 0.01 + 1e-6 * 10 * (20 + 5.5))
    assert m.decode_step_s(4, 1000) == pytest.approx(0.01 + 0.004 + 0.001)
    assert m.transfer_bytes(1000) == 100 * 1000 + 1000 * 128 and m.transfer_s(10) == pytest.approx(0.011)
    # the H200 preset: a 64K prefill takes seconds, not minutes; a cached 60K makes it ~10x cheaper
    assert 0.3 < MIMO_V2_FLASH_H200.prefill_s(65536) < 2.0
    assert MIMO_V2_FLASH_H200.prefill_s(65536 - 60000, 60000) < MIMO_V2_FLASH_H200.prefill_s(65536) / 5
    with pytest.raises(ValueError, match="known"):
        preset("nope")


def test_priority_key_orders_short_first_and_bounds_waiting() -> None:
    pr = ComputeAwarePriority(COST, max_wait_s=10.0, wait_weight=1.0)
    now = 100.0
    long_old = pr.key(arrival=95.0, uncached=8000, cached=0, now=now)  # 8 s of work, waited 5 s
    short_new = pr.key(arrival=100.0, uncached=100, cached=0, now=now)
    assert short_new < long_old
    assert pr.key(95.0, 100, 0, now) < pr.key(99.0, 100, 0, now)  # equal work: older first
    overdue = pr.key(arrival=89.0, uncached=100_000, cached=0, now=now)  # waited 11 s > 10 s
    assert overdue < short_new and overdue[0] == 0
    assert pr.key(88.0, 10**6, 0, now) < pr.key(89.0, 1, 0, now)  # overdue: arrival order
    assert ComputeAwarePriority(COST, max_wait_s=0.0).key(5.0, 1, 0, 5.0) == (0, 5.0)  # FCFS
