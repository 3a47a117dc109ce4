"""``bench.mtp.by_position``: decode figures per output-position bucket from token times."""

from __future__ import annotations

import pytest

from bench.mtp import by_position


def _times(start: float, step: float, n: int = 256) -> list[float]:
    return [start + step * i for i in range(n)]


def test_concurrent_requests_share_one_span() -> None:
    # two requests side by side, 10 ms a token: together 200 tokens/s
    got = by_position({"a": _times(0.5, 0.01), "b": _times(0.5, 0.01)})
    assert got["0-128"]["tokens_per_s"] == pytest.approx(2 * 127 / (127 * 0.01))
    assert got["128-256"]["tokens_per_s"] == pytest.approx(2 * 128 / (128 * 0.01))
    assert got["0-128"]["itl_mean_s"] == pytest.approx(0.01)


def test_sequential_requests_add_their_own_times() -> None:
    # one after another, each timed from its own start: 10 ms and 20 ms a token
    times = {"a": _times(0.5, 0.01), "b": _times(0.2, 0.02)}
    got = by_position(times, sequential=True)
    assert got["128-256"]["tokens_per_s"] == pytest.approx(256 / (128 * 0.01 + 128 * 0.02))
    assert got["128-256"]["itl_mean_s"] == pytest.approx(0.015)
    # the same times read as concurrent would overlap the two spans
    assert by_position(times)["128-256"]["tokens_per_s"] > got["128-256"]["tokens_per_s"]


def test_short_requests_leave_the_bucket_out() -> None:
    got = by_position({"a": _times(0.0, 0.01, n=100)})
    assert got == {}
