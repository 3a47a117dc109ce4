"""EncodeBatcher (cross-request fusion, wait window, video alone, fairness) and split."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.encoder.batcher import EncodeBatcher, PendingItem, split


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def item(
    name: str, modality: str = "image", cost: int = 10, tokens: int = 4, at: float | None = None
) -> PendingItem:
    return PendingItem(name.encode(), modality, tokens, cost, payload=name, arrival=at)  # type: ignore[arg-type]


def names(batch: list[PendingItem] | None) -> list[str] | None:
    return None if batch is None else [i.payload for i in batch]


def batcher(items: int = 4, tokens: int = 100, wait: float = 0.005) -> tuple[EncodeBatcher, Clock]:
    clock = Clock()
    return EncodeBatcher(items, tokens, wait, clock), clock


def test_fuses_across_requests_up_to_the_item_bound() -> None:
    b, clock = batcher(items=3)
    for n in "abcde":  # five requests' images
        b.submit(item(n))
    assert names(b.next_batch()) == ["a", "b", "c"]  # full at once: no wait
    assert b.next_batch() is None  # d, e: a partial batch waits for the window
    assert b.time_to_next() == pytest.approx(0.005)
    clock.t += 0.005
    assert b.time_to_next() == 0.0
    assert names(b.next_batch()) == ["d", "e"]
    assert b.next_batch() is None and b.time_to_next() is None and len(b) == 0
    s = b.stats()
    assert (s.batches, s.items, s.full, s.timed_out, s.alone) == (2, 5, 1, 1, 0)
    assert s.batch_sizes == {2: 1, 3: 1} and s.batches_by_modality == {"image": 2}


def test_token_bound_stops_a_batch_without_skipping() -> None:
    b, clock = batcher(items=8, tokens=100)
    for n, cost in (("a", 40), ("b", 50), ("c", 30), ("d", 5)):
        b.submit(item(n, cost=cost))
    assert names(b.next_batch()) == ["a", "b"]  # c does not fit; d would, but goes after c
    assert b.next_batch() is None
    clock.t += 0.01
    assert names(b.next_batch()) == ["c", "d"]
    b.submit(item("e", cost=60))
    b.submit(item("f", cost=40))
    assert names(b.next_batch()) == ["e", "f"]  # exactly the bound: full


def test_wait_window_counts_from_the_oldest_item() -> None:
    b, clock = batcher(items=4, wait=0.010)
    b.submit(item("a"))
    clock.t += 0.006
    b.submit(item("b"))
    assert b.next_batch() is None
    assert b.time_to_next() == pytest.approx(0.004)
    clock.t += 0.004
    assert names(b.next_batch()) == ["a", "b"]
    b.submit(item("c", at=50.0))  # an explicit arrival long ago: due at once
    assert names(b.next_batch(now=clock.t)) == ["c"]


def test_zero_wait_releases_whatever_is_queued() -> None:
    b, _ = batcher(wait=0.0)
    b.submit(item("a"))
    b.submit(item("b", "audio"))
    assert names(b.next_batch()) == ["a"] and names(b.next_batch()) == ["b"]


def test_video_goes_alone_and_at_once() -> None:
    b, _ = batcher(items=4)
    for n in "vwx":
        b.submit(item(n, "video", cost=5))
    assert [names(b.next_batch()) for _ in range(3)] == [["v"], ["w"], ["x"]]
    assert b.next_batch() is None
    assert b.stats().alone == 3


def test_oversize_item_goes_alone_at_once() -> None:
    b, clock = batcher(items=4, tokens=100)
    b.submit(item("a", cost=30))
    b.submit(item("huge", cost=500))
    b.submit(item("b", cost=30))
    clock.t += 0.01
    assert names(b.next_batch()) == ["a"]  # huge does not fit after a
    assert names(b.next_batch()) == ["huge"]  # alone, though b is waiting and fits in nothing else
    assert names(b.next_batch()) == ["b"]
    b.submit(item("solo", cost=101))
    assert names(b.next_batch()) == ["solo"]  # alone, no window


def test_one_modality_per_batch_oldest_first() -> None:
    b, clock = batcher(items=4, wait=0.005)
    b.submit(item("img1", "image"))
    clock.t += 0.001
    b.submit(item("aud1", "audio"))
    b.submit(item("img2", "image"))
    clock.t += 0.001
    b.submit(item("vid1", "video"))
    assert names(b.next_batch()) == ["vid1"]  # ready now; the others wait for their window
    clock.t += 0.01
    assert names(b.next_batch()) == ["img1", "img2"]  # both due: the image head is older
    assert names(b.next_batch()) == ["aud1"]
    # a ready audio batch goes before a waiting older image
    b2, _ = batcher(items=2, wait=0.005)
    b2.submit(item("old-img", "image"))
    b2.submit(item("a1", "audio"))
    b2.submit(item("a2", "audio"))
    assert names(b2.next_batch()) == ["a1", "a2"]
    assert b2.time_to_next() == pytest.approx(0.005)


def test_fairness_a_full_stream_does_not_starve_an_older_modality() -> None:
    b, clock = batcher(items=2, wait=0.005)
    b.submit(item("aud", "audio"))
    clock.t += 0.006  # the audio item is due
    for n in range(6):
        b.submit(item(f"i{n}"))  # three full image batches, all younger
    assert names(b.next_batch()) == ["aud"]
    assert [len(b.next_batch() or []) for _ in range(3)] == [2, 2, 2]


def test_submit_checks_and_stamps() -> None:
    b, clock = batcher()
    queued = b.submit(item("a"))
    assert queued.arrival == clock.t
    with pytest.raises(ValueError, match="modality"):
        b.submit(item("x", "text"))
    with pytest.raises(ValueError, match=">= 0"):
        b.submit(item("x", cost=-1))
    with pytest.raises(ValueError):
        EncodeBatcher(0, 10, 0.0, clock)
    assert b.stats().queued == {"image": 1, "audio": 0, "video": 0}


def test_split_by_each_items_rows() -> None:
    batch = [item("a", tokens=3), item("b", tokens=0), item("c", tokens=2)]
    out = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)
    parts = split(batch, out)
    assert [p.shape[0] for p in parts] == [3, 0, 2]
    assert torch.equal(torch.cat(parts), out)
    assert torch.equal(parts[2], out[3:])
    assert split([], torch.zeros(0, 4)) == []
    with pytest.raises(ValueError, match="5 rows"):
        split(batch, torch.zeros(6, 4))
    with pytest.raises(ValueError, match="3\\+0\\+2"):
        split(batch, torch.zeros(4, 4))
    with pytest.raises(ValueError):
        split(batch, torch.zeros(5))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["image", "audio", "video"]), st.integers(0, 150), st.floats(0, 0.004)),
        max_size=40,
    ),
    st.integers(1, 5),
)
def test_invariants_every_item_once_in_order_within_bounds(
    steps: list[tuple[str, int, float]], max_items: int
) -> None:
    b, clock = batcher(items=max_items, tokens=100, wait=0.005)
    submitted: list[PendingItem] = []
    released: list[list[PendingItem]] = []
    for n, (modality, cost, dt) in enumerate(steps):
        submitted.append(b.submit(item(f"x{n}", modality, cost=cost)))
        clock.t += dt
        while (batch := b.next_batch()) is not None:
            released.append(batch)
    clock.t += 0.005
    while (batch := b.next_batch()) is not None:
        released.append(batch)
    assert len(b) == 0 and b.time_to_next() is None
    flat = [i.payload for batch in released for i in batch]
    assert sorted(flat) == sorted(i.payload for i in submitted)  # each exactly once
    for modality in ("image", "audio", "video"):  # FIFO within a modality
        order = [i.payload for i in submitted if i.modality == modality]
        assert [p for p in flat if p in set(order)] == order
    for batch in released:
        assert len({i.modality for i in batch}) == 1 and 1 <= len(batch) <= max_items
        if len(batch) > 1:
            assert batch[0].modality != "video" and sum(i.cost for i in batch) <= 100
