"""The GCache node's store: slots and bytes, heat, prefix-closed eviction, leases, two-phase puts,
tiers, restart recovery."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.gcache import codec
from swaserve.gcache.heat import level
from swaserve.gcache.store import BUSY, EXISTS, FULL, NO_PARENT, PageStore
from swaserve.gcache.tiers import DramTier, NvmeTier
from tests.gcache.helpers import chain, put


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def obj_slot(tier, obj: bytes) -> int:
    return tier.slot_size(len(obj))


def check(store: PageStore) -> None:
    """Exact accounting: each tier's used bytes = its slots in use; every resident page's parent
    link is recorded."""
    for tier in (store.dram, store.nvme):
        if tier is None:
            continue
        want = sum(e.slot[0] for e in store.index.values() if e.tier is tier)
        want += sum(e.slot[0] for e in store.pending.values() if e.tier is tier)
        assert tier.used == want
        slots = {
            (e.slot) for e in list(store.index.values()) + list(store.pending.values()) if e.tier is tier
        }
        assert len(slots) == sum(
            e.tier is tier for e in list(store.index.values()) + list(store.pending.values())
        )
        for size, c in tier.classes.items():
            assert len(c.free) + sum(s[0] == size for s in slots) == c.slots
        assert tier.given <= tier.capacity
    for pid, e in store.index.items():
        assert pid in store.children.get(e.parent_pid, set())
        parent = store.index.get(e.parent_pid)  # a parent is at least as hot (to a heat level)
        assert parent is None or level(parent.score) >= level(e.score)


def test_accounting_and_dedupe() -> None:
    pages = chain(list(range(40)))
    size = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(size * 20))
    for p in pages:
        assert isinstance(put(store, p), int)
    check(store)
    assert store.dram.used == size * 10 and store.usage()["dram"]["pages"] == 10
    assert put(store, pages[3]) == EXISTS
    r = store.reserve((b"k" * 16, 0), pages[0]["parent"], 0, 500)
    assert isinstance(r, int)
    assert store.reserve((b"k" * 16, 0), pages[0]["parent"], 0, 500) == BUSY
    store.abort(r)
    check(store)
    for p in pages:
        assert store.read(p["pid"]) == p["obj"]


def test_commit_checks_the_object_against_its_reservation() -> None:
    pages = chain(list(range(8)))
    store = PageStore(DramTier(1 << 20))
    assert store.reserve(pages[1]["pid"], pages[1]["parent"], 1, len(pages[1]["obj"])) == NO_PARENT
    put(store, pages[0])
    r = store.reserve(pages[1]["pid"], pages[1]["parent"], 1, len(pages[1]["obj"]))
    bad = bytearray(pages[1]["obj"])
    bad[-1] ^= 1
    with pytest.raises(codec.CorruptPage):
        store.commit(r, bytes(bad))
    with pytest.raises(KeyError):
        store.commit(r, pages[1]["obj"])  # aborted
    r = store.reserve(pages[1]["pid"], pages[1]["parent"], 1, len(pages[1]["obj"]))
    with pytest.raises(codec.CorruptPage, match="reservation"):
        store.commit(r, pages[0]["obj"])  # another page's object
    assert store.lookup([pages[1]["pid"]])[0] == [False]
    check(store)


def test_eviction_is_coldest_leaf_first_and_hot_prefix_stays() -> None:
    clock = Clock()
    sys_prompt = list(range(8))  # 2 pages shared by every session
    sessions = [chain(sys_prompt + [100 + 10 * s + i for i in range(8)], seed=s) for s in range(6)]
    size = DramTier(0).slot_size(len(sessions[0][0]["obj"]))
    store = PageStore(DramTier(size * 8), clock=clock)
    for s in sessions:
        for p in s:
            put(store, p)
            clock.t += 1
        check(store)
    # the shared prefix (hottest: every session touched it) is never evicted; parents before children never
    assert store.lookup([sessions[0][0]["pid"], sessions[0][1]["pid"]])[0] == [True, True]
    for e in store.index.values():
        if e.index > 0:
            assert e.parent_pid in store.index
    # the newest session survives whole
    assert all(store.lookup([p["pid"] for p in sessions[-1]])[0])


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "touch", "read", "lease", "tick", "remove"]), st.integers(0, 10**6)
        ),
        max_size=60,
    )
)
def test_prefix_closure_under_random_operations(ops) -> None:
    clock = Clock()
    rng = random.Random(len(ops))
    # a tree of sequences: a few roots, branches sharing prefixes
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(4, 24))] for _ in range(8)]
    chains = [chain(s) for s in seqs]
    size = DramTier(0).slot_size(len(chains[0][0]["obj"]))
    store = PageStore(DramTier(size * 6), clock=clock, lease_s=3)
    dropped_with_children = []
    orig = store._drop

    def drop(e):
        if store.children.get(e.pid) and not removing:
            dropped_with_children.append(e)
        orig(e)

    store._drop = drop
    removing = False
    for op, n in ops:
        c = chains[n % len(chains)]
        if not c:
            continue
        if op == "put":  # parents first, as a prefix is written
            for p in c[: 1 + n % len(c)]:
                put(store, p)
        elif op == "touch":
            store.touch([p["pid"] for p in c])
        elif op == "read":
            store.read(c[n % len(c)]["pid"])
        elif op == "lease":
            store.lookup([p["pid"] for p in c])
        elif op == "tick":
            clock.t += n % 7
        else:
            removing = True
            store.remove([c[n % len(c)]["pid"]])
            removing = False
        check(store)
        assert not dropped_with_children
        for e in store.index.values():  # closure: puts came parents first
            assert e.index == 0 or e.parent_pid in store.index


def test_leases_block_eviction_and_expire() -> None:
    clock = Clock()
    pages = chain(list(range(8)))
    other = chain(list(range(50, 58)), seed=1)
    size = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(size * 2), clock=clock, lease_s=5)
    for p in pages:
        put(store, p)
    present, lease = store.lookup([p["pid"] for p in pages])
    assert present == [True, True] and lease
    clock.t += 1  # within the lease
    assert put(store, other[0]) == FULL  # nothing evictable: both leased
    store.release(lease)
    assert isinstance(put(store, other[0]), int)  # the leaf pages[1] went
    assert store.lookup([pages[0]["pid"], pages[1]["pid"]])[0] == [True, False]
    # expiry without release
    _, lease = store.lookup([pages[0]["pid"]])
    clock.t += 6
    store.maintain()
    assert lease not in store.leases and store.index[pages[0]["pid"]].leased == 0
    check(store)


def test_unfinished_puts_are_reclaimed() -> None:
    clock = Clock()
    pages = chain(list(range(8)))
    store = PageStore(DramTier(1 << 16), clock=clock, put_timeout_s=30)
    r = store.reserve(pages[0]["pid"], pages[0]["parent"], 0, len(pages[0]["obj"]))
    used = store.dram.used
    assert used > 0
    clock.t += 31
    store.maintain()
    assert store.dram.used == 0 and not store.pending
    with pytest.raises(KeyError):
        store.commit(r, pages[0]["obj"])
    assert store.stats[("put_zombies", "dram", "full")] == 1
    assert isinstance(put(store, pages[0]), int)
    check(store)


@pytest.mark.parametrize("direct", [True, False])
def test_nvme_demotion_promotion_and_recovery(tmp_path: Path, direct: bool) -> None:
    clock = Clock()
    pages = chain(list(range(40)), payload=3000)
    dsize = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(dsize * 4), NvmeTier(tmp_path, 1 << 20, direct), clock=clock, promote_reads=2)
    for p in pages:
        put(store, p)
        clock.t += 1
    check(store)
    u = store.usage()
    # a touch raises the ancestors: the chain's head is as hot as its newest page, and ties
    # demote the deepest pages first
    assert u["dram"]["pages"] == 4 and u["nvme"]["pages"] == 6
    # (the newest page went to DRAM after the demotion its put caused)
    in_dram = {p["pid"] for p in pages[:3]} | {pages[-1]["pid"]}
    assert in_dram == {pid for pid, e in store.index.items() if e.tier is store.dram}
    cold = pages[5]["pid"]
    assert store.index[cold].tier is store.nvme
    assert store.read(cold) == pages[5]["obj"]
    assert store.read(cold) == pages[5]["obj"]
    assert store.index[cold].tier is store.dram  # promoted on the second read
    check(store)
    # as a node reads: under the lookup's lease (a leased page moves up too: reads find its
    # slot when they read), and a DRAM page as a view, valid while pinned
    other = next(p for p in pages if store.index[p["pid"]].tier is store.nvme)
    for _ in range(2):
        _, lease = store.lookup([other["pid"]])
        assert store.read(other["pid"]) == other["obj"]
        store.release(lease)
    assert store.index[other["pid"]].tier is store.dram
    pin = store.pin([other["pid"]])
    view = store.read_view(other["pid"])
    assert isinstance(view, memoryview) and view == other["obj"]
    assert store.index[other["pid"]].leased == 1
    store.release(pin)
    check(store)
    nvme_pids = {pid for pid, e in store.index.items() if e.tier is store.nvme}
    store.close()
    # restart: the NVMe pages come back; DRAM ones are gone
    store = PageStore(DramTier(dsize * 4), NvmeTier(tmp_path, 1 << 20, direct), clock=clock)
    assert set(store.index) == nvme_pids and store.recovered == {"pages": len(nvme_pids), "dropped": 0}
    check(store)
    for p in pages:
        if p["pid"] in nvme_pids:
            assert store.read(p["pid"]) == p["obj"]


def test_recovery_drops_torn_and_bad_slots_and_reads_catch_corruption(tmp_path: Path) -> None:
    pages = chain(list(range(24)), payload=5000)
    store = PageStore(DramTier(0), NvmeTier(tmp_path, 1 << 20))
    for p in pages:
        put(store, p)
    slots = {pid: e.slot for pid, e in store.index.items()}
    store.close()
    (f,) = tmp_path.glob("class-*.slots")
    size = slots[pages[0]["pid"]][0]
    with open(f, "r+b") as fh:
        s = slots[pages[5]["pid"]]  # torn: the tail of the payload never written
        fh.seek(s[1] * size + len(pages[5]["obj"]) - 100)
        fh.write(bytes(100))
        s = slots[pages[2]["pid"]]  # a flipped byte in the payload
        fh.seek(s[1] * size + 300)
        b = fh.read(1)
        fh.seek(s[1] * size + 300)
        fh.write(bytes([b[0] ^ 0xFF]))
    store = PageStore(DramTier(0), NvmeTier(tmp_path, 1 << 20))
    assert store.recovered == {"pages": 4, "dropped": 2}
    assert pages[5]["pid"] not in store.index and pages[2]["pid"] not in store.index
    check(store)
    # corruption after start: the read refuses it, deletes it with its descendants, counts it
    s = store.index[pages[1]["pid"]].slot
    with open(f, "r+b") as fh:
        fh.seek(s[1] * size + 400)
        fh.write(b"\x00\x01\x02")
    assert store.read(pages[1]["pid"]) is None
    assert pages[1]["pid"] not in store.index
    assert store.stats[("corrupt_pages", "nvme", "full")] == 1
    check(store)


def test_watermark_demotion(tmp_path: Path) -> None:
    clock = Clock()
    pages = chain(list(range(80)), payload=1000)
    dsize = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(dsize * 20), NvmeTier(tmp_path, 1 << 22), clock=clock, high=0.5, low=0.25)
    for p in pages[:15]:
        put(store, p)
        clock.t += 1
        assert store.dram.used <= 0.5 * store.dram.capacity + dsize  # one put over high at most
    store.maintain()
    assert store.dram.used <= 0.5 * store.dram.capacity
    assert store.usage()["nvme"]["pages"] >= 5 and store.stats[("demotions", "dram", "full")] >= 5
    for p in pages[:15]:
        assert store.read(p["pid"]) == p["obj"]
    check(store)


def test_open_without_o_direct_support(tmp_path: Path, monkeypatch) -> None:
    real = os.open

    def no_direct(path, flags, mode=0o777):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real(path, flags, mode)

    monkeypatch.setattr(os, "open", no_direct)
    tier = NvmeTier(tmp_path, 1 << 20)
    store = PageStore(DramTier(0), tier)
    p = chain(list(range(4)))[0]
    put(store, p)
    assert not tier.direct and store.read(p["pid"]) == p["obj"]


@pytest.mark.parametrize("nvme", [False, True])
def test_a_second_size_class_gets_room_from_the_first(tmp_path: Path, nvme: bool) -> None:
    """Full and SWA pages differ in size: once full pages took the whole tier, SWA pages still get
    slots (another class's last chunk is emptied and handed over)."""
    clock = Clock()
    full = chain(list(range(400)), payload=900)
    swa = chain(list(range(200)), kind=codec.SWA_KIND, payload=5000, seed=3)
    if nvme:
        store = PageStore(DramTier(0), NvmeTier(tmp_path, 64 * 4096), clock=clock)
    else:
        store = PageStore(DramTier(64 * 1024), clock=clock)
    for p in full:
        put(store, p)
        clock.t += 1
    check(store)
    tier = store.nvme if nvme else store.dram
    assert tier.capacity - tier.given < tier.slot_size(len(swa[0]["obj"]))
    for p in swa[-3:]:
        assert isinstance(put(store, p), int)
        check(store)
    for p in swa[-3:]:
        assert store.read(p["pid"]) == p["obj"]
    for e in store.index.values():
        if e.kind == codec.FULL_KIND:
            assert e.index == 0 or e.parent_pid in store.index
    assert store.read(full[0]["pid"]) == full[0]["obj"]


def test_one_tier_per_nvme_directory(tmp_path: Path) -> None:
    """Two nodes on one directory would overwrite each other's slots: the second is refused
    while the first holds it, and may open it once the first is closed."""
    from swaserve.gcache.tiers import DirectoryInUse

    first = PageStore(DramTier(0), NvmeTier(tmp_path, 1 << 20))
    with pytest.raises(DirectoryInUse, match="in use by another GCache node"):
        NvmeTier(tmp_path, 1 << 20)
    first.close()
    PageStore(DramTier(0), NvmeTier(tmp_path, 1 << 20)).close()


def test_dram_room_for_another_class_demotes_rather_than_evicts(tmp_path: Path) -> None:
    """A small DRAM tier full of full pages, an NVMe tier with room: SWA pages get DRAM slots by
    moving full pages down to NVMe (nothing evicted, every page still readable)."""
    clock = Clock()
    full = chain(list(range(400)), payload=900)
    swa = chain(list(range(200)), kind=codec.SWA_KIND, payload=5000, seed=3)
    store = PageStore(DramTier(64 * 1024), NvmeTier(tmp_path, 4 << 20), clock=clock)
    for p in full + swa[-3:]:
        put(store, p)
        clock.t += 1
        check(store)
    assert store.stats[("evictions", "dram", "full")] == 0
    assert store.stats[("demotions", "dram", "full")] > 0
    assert all(store.read(p["pid"]) == p["obj"] for p in full + swa[-3:])


def test_eviction_heaps_stay_bounded_without_evictions() -> None:
    """Every touch pushes a heap item per page it heats (ancestors too); with room to spare no
    eviction pops the stale ones, so the store compacts a heap past 2x its live pages + slack
    (a long-running node once grew to 10^5 stale tuples and 40 ms GC pauses)."""
    from swaserve.gcache.store import HEAP_SLACK

    pages = chain(list(range(400)))  # 100 pages of one chain
    clock = Clock()
    size = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(size * 200), clock=clock)
    for p in pages:
        put(store, p)
    rng = random.Random(1)
    for _ in range(3000):
        clock.t += 0.01
        store.touch([pages[rng.randrange(len(pages))]["pid"]])
        (heap,) = store.heat.heaps.values()
        assert len(heap) <= 2 * len(pages) + HEAP_SLACK + 1
    check(store)
    # the heap still yields the coldest current page: the same as a scan of the index
    (heap,) = store.heat.heaps.values()
    want = min(
        (e for e in store.index.values() if store._evictable(e)), key=lambda e: (level(e.score), -e.index)
    )
    assert store.heat.coldest(store.dram, size, store._evictable) is want


def test_reading_a_long_chain_page_by_page_lifts_no_ancestor_each_time() -> None:
    """Pages of a chain read one after another share a heat level: each read is O(1) heap work,
    not a walk up the chain (400 pages read in order: 80,000 lifts when every read walked to
    the root); a page read much later, or many times, lifts its ancestors once."""
    pages = chain(list(range(1600)))  # 400 pages of one chain
    clock = Clock()
    size = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(size * 400), clock=clock)
    lifts = 0
    orig = store.heat.set_score

    def counted(e, score):
        nonlocal lifts
        lifts += 1
        orig(e, score)

    store.heat.set_score = counted
    for p in pages:
        put(store, p)
        clock.t += 0.001
    for p in pages:
        assert store.read(p["pid"]) is not None
        clock.t += 0.001
    assert lifts <= 3 * len(pages)  # one score per put, per commit, per read
    check(store)
    lifts = 0
    clock.t += 600.0  # a half-life later the deepest page is read: its whole chain comes up
    assert store.read(pages[-1]["pid"]) is not None
    assert lifts == len(pages)
    check(store)
    # eviction still takes the deepest of the coldest level first
    assert store.heat.coldest(store.dram, size, store._evictable) is store.index[pages[-1]["pid"]]


def test_a_full_or_failing_nvme_disk_costs_pages_not_the_store(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The disk refuses writes (ENOSPC) and reads (EIO) from some point on, as a full or failing
    device does: demotions and puts onto it are dropped and counted, DRAM evicts instead of
    demoting for the backoff, reads of pages there are misses, and every call keeps working;
    once the disk works again and the backoff has passed, demotion resumes."""
    import errno

    from swaserve.gcache import store as store_mod
    from swaserve.gcache import tiers

    clock = Clock()
    # 10 sessions of 4 pages: leaves to evict while the disk is broken
    pages = [p for k in range(10) for p in chain(list(range(1000 * k, 1000 * k + 16)), payload=3000)]
    dsize = DramTier(0).slot_size(len(pages[0]["obj"]))
    store = PageStore(DramTier(dsize * 4), NvmeTier(tmp_path, 1 << 20, False), clock=clock, promote_reads=9)
    for p in pages[:12]:
        put(store, p)
        clock.t += 1
    on_disk = [pid for pid, e in store.index.items() if e.tier is store.nvme]
    assert on_disk and store.stats[("io_errors", "nvme", "full")] == 0
    real_pwrite, real_preadv = os.pwrite, os.preadv
    broken = {"on": True}

    def pwrite(fd: int, data, offset: int) -> int:  # type: ignore[no-untyped-def]
        if broken["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    def preadv(fd: int, bufs, offset: int) -> int:  # type: ignore[no-untyped-def]
        if broken["on"]:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(tiers.os, "pwrite", pwrite)
    monkeypatch.setattr(tiers.os, "preadv", preadv)
    for p in pages[12:20]:  # each put needs a DRAM slot: demotion fails once, then DRAM evicts
        assert isinstance(put(store, p), int)
        clock.t += 1
        check(store)
    assert store.stats[("io_errors", "nvme", "full")] == 1 and "No space left" in store.last_io_error
    assert store.stats[("evictions", "dram", "full")] > 0  # instead of demotions
    found, lease = store.lookup([p["pid"] for p in pages[16:20]])
    assert all(found) and all(store.read(p["pid"]) == p["obj"] for p in pages[16:20])
    store.release(lease)
    assert store.read(on_disk[0]) is None and on_disk[0] not in store.index  # EIO: a miss
    assert store.stats[("io_errors", "nvme", "full")] == 2
    check(store)
    broken["on"] = False
    clock.t += store_mod.NVME_BACKOFF_S + 1
    before = store.stats[("demotions", "dram", "full")]
    for p in pages[20:32]:
        put(store, p)
        clock.t += 1
    assert store.stats[("demotions", "dram", "full")] > before  # the disk is used again
    check(store)
    store.close()
