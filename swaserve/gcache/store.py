"""``PageStore``: one GCache node's index over its DRAM and NVMe tiers (sans IO apart from the
NVMe tier's file reads and writes; injected clock).

- Pages are immutable and write-once: ``reserve`` (a slot; an existing key is a touch, a key being
  written is ``busy``), ``commit`` (the object checked against its reservation, written, then
  visible), ``abort``; reservations not committed within ``put_timeout_s`` are reclaimed.
- ``lookup`` grants a read lease: a leased page is neither evicted nor moved until the lease ends
  (``lease_s``) or is released. ``read`` checks the payload CRC of an NVMe copy; a bad page is
  deleted (with its descendants) and counted, never returned.
- Heat = exponentially decayed access count (``half_life_s``; ``heat.HeatHeaps``: the eviction
  order per tier and slot class); a touch raises the ancestors' heat level to at least the page's
  (a hot prefix outlives its sessions).
- Placement: new pages go to DRAM; above the high watermark (and when a DRAM slot is needed) the
  coldest DRAM pages move to NVMe; an NVMe page read ``promote_reads`` times moves back when DRAM
  has room or holds a colder page. Eviction takes the coldest page with no resident child of its
  kind (prefix-closed: never a parent before its children).
- ``recover``: a restarted node rebuilds its index from the NVMe slots (header and payload CRC);
  torn or bad slots are dropped.
- NVMe I/O errors (a full or failing disk) cost that page only: a failed write drops the move or
  the put, a failed read is a miss; the tier then takes no new pages for ``NVME_BACKOFF_S`` (DRAM
  evicts instead of demoting) and ``io_errors`` counts them (``last_io_error`` says the last).

Design and sources (Mooncake Store leases / two-phase put, SGLang HiCache): docs/DESIGN.md#gcache"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from swaserve.gcache import codec
from swaserve.gcache.codec import KIND_NAMES, CorruptPage
from swaserve.gcache.heat import HEAP_SLACK, Block, Entry, HeatHeaps, PageId, level
from swaserve.gcache.recovery import stored_pages
from swaserve.gcache.tiers import NvmeTier, Slot, Tier

__all__ = ["BUSY", "EXISTS", "FULL", "HEAP_SLACK", "NO_PARENT", "Block", "Entry", "PageId", "PageStore"]

EXISTS, BUSY, FULL, NO_PARENT = "exists", "busy", "full", "no_parent"
NVME_BACKOFF_S = 30.0  # after an NVMe I/O error the tier takes no new pages for this long


@dataclass
class _Lease:
    until: float
    pids: list[PageId] = field(default_factory=list)


class PageStore:
    """Args:
    dram: the DRAM tier. nvme: the NVMe tier (None: DRAM only).
    clock: seconds, monotonic. half_life_s: heat half-life. lease_s: default read lease.
    put_timeout_s: an uncommitted reservation is reclaimed after it.
    promote_reads: NVMe reads that move a page to DRAM. high, low: DRAM watermarks (fractions of
    capacity) between which ``maintain`` demotes."""

    def __init__(
        self,
        dram: Tier,
        nvme: NvmeTier | None = None,
        clock: Callable[[], float] = time.monotonic,
        half_life_s: float = 600.0,
        lease_s: float = 5.0,
        put_timeout_s: float = 30.0,
        promote_reads: int = 2,
        high: float = 0.95,
        low: float = 0.90,
    ) -> None:
        if not 0 < low <= high <= 1:
            raise ValueError(f"watermarks need 0 < low <= high <= 1, got {low}, {high}")
        self.dram, self.nvme, self.clock = dram, nvme, clock
        self.lease_s, self.put_timeout = lease_s, put_timeout_s
        self.promote_reads, self.high, self.low = promote_reads, high, low
        self.index: dict[PageId, Entry] = {}
        self.children: dict[PageId, set[PageId]] = {}  # resident pages by their parent's id
        self.pending: dict[int, Entry] = {}  # reservation id -> uncommitted entry
        self._pending_ids: dict[PageId, int] = {}
        self._pinned: Counter[PageId] = Counter()  # parents of pending reservations
        self.leases: dict[int, _Lease] = {}
        self._lease_heap: list[tuple[float, int]] = []
        self.heat = HeatHeaps(half_life_s)
        self._ids = itertools.count(1)
        self.stats: Counter[tuple[str, str, str]] = Counter()  # (what, tier, kind) -> count
        self.recovered = {"pages": 0, "dropped": 0}
        self.nvme_off_until = -1.0  # clock time before which the NVMe tier takes no new pages
        self.last_io_error = ""
        # index blocks stored / removed since the last drain (the node publishes them)
        self.events: list[tuple[str, Block]] = []
        if nvme is not None:
            self.recover()

    # -- heat (swaserve/gcache/heat.py) -------------------------------------------------------------
    def _heat_up(self, e: Entry, now: float, propagate: bool = True) -> None:
        self.heat.heat_up(e, now)
        if propagate:
            self._propagate(e)

    def _propagate(self, e: Entry) -> None:
        """Lift ``e``'s ancestors to its level where they are below it: level(parent) >=
        level(child) holds for every resident pair, so the walk stops at the first that is not."""
        lv = level(e.score)
        p = self.index.get(e.parent_pid)
        while p is not None and level(p.score) < lv:
            self.heat.set_score(p, e.score)
            p = self.index.get(p.parent_pid)

    def _evictable(self, e: Entry) -> bool:
        return e.leased == 0 and not self.children.get(e.pid) and e.pid not in self._pinned

    # -- maintenance -----------------------------------------------------------------------------
    def maintain(self) -> None:
        """Expire leases, reclaim uncommitted reservations past their deadline, demote DRAM pages
        above the high watermark down to the low one."""
        now = self.clock()
        while self._lease_heap and self._lease_heap[0][0] <= now:
            _, lid = heapq.heappop(self._lease_heap)
            if lid in self.leases:
                self._count("lease_expired", self.dram, -1)
                self.release(lid)
        # Deadlines are reserve time + a constant, so insertion order is deadline order.
        while self.pending:
            rid, e = next(iter(self.pending.items()))
            if e.deadline > now:
                break
            self._count("put_zombies", e.tier, e.kind)
            self.abort(rid)
        cap = self.dram.capacity
        if self._nvme_ok() and cap and self.dram.used > self.high * cap:
            while self.dram.used > self.low * cap and self._demote_any():
                pass

    def _nvme_ok(self) -> bool:
        """Whether the NVMe tier exists and takes new pages (no I/O error in the backoff)."""
        return self.nvme is not None and self.clock() >= self.nvme_off_until

    def _io_error(self, tier: Tier, kind: int, err: OSError) -> None:
        self._count("io_errors", tier, kind)
        self.last_io_error = f"{tier.name}: {err}"
        if tier is self.nvme:
            self.nvme_off_until = self.clock() + NVME_BACKOFF_S

    def _demote_any(self) -> bool:
        best = None
        for size in list(self.dram.classes):
            e = self.heat.coldest(self.dram, size, lambda x: x.leased == 0)
            if e is not None and (best is None or e.score < best.score):
                best = e
        return best is not None and self._move(best, self.nvme)  # type: ignore[arg-type]

    # -- puts -------------------------------------------------------------------------------------
    def reserve(
        self,
        pid: PageId,
        parent: bytes,
        index: int,
        size: int,
        parent_elsewhere: bool = False,
        block: Block | None = None,
    ) -> str | int:
        """Room for a new page object of ``size`` bytes: a reservation id, or ``EXISTS`` (the page
        is there: touched), ``BUSY`` (another put of it is in progress), ``NO_PARENT`` (a full
        page after the first whose parent is neither stored nor being put: unreachable, and
        storing it would break prefix closure; ``parent_elsewhere``: the parent lives on another
        node, as at a placement segment's start) or ``FULL`` (no slot without evicting leased or
        parent pages). The parent is kept until the reservation ends. Raises ValueError on a bad
        kind, key or size."""
        key, kind = pid
        if kind not in KIND_NAMES or len(key) != 16 or len(parent) != 16 or size <= 0 or index < 0:
            raise ValueError("bad page id, parent, index or size")
        self.maintain()
        now = self.clock()
        e = self.index.get(pid)
        if e is not None:
            self._heat_up(e, now)
            return EXISTS
        if pid in self._pending_ids:
            return BUSY
        ppid = (parent, kind)
        local = kind == codec.FULL_KIND and index > 0 and not parent_elsewhere
        if local and ppid not in self.index and ppid not in self._pending_ids:
            self._count("put_no_parent", self.dram, kind)
            return NO_PARENT
        self._pinned[ppid] += 1
        placed = self._place(size)
        if placed is None:
            self._unpin(ppid)
            self._count("put_refused", self.dram, kind)
            return FULL
        tier, slot = placed
        rid = next(self._ids)
        self.pending[rid] = Entry(
            key, kind, parent, index, size, tier, slot, deadline=now + self.put_timeout, needs_parent=local,
            block=block if kind == codec.FULL_KIND else None,
        )  # fmt: skip
        self._pending_ids[pid] = rid
        return rid

    def commit(self, rid: int, obj: bytes | memoryview) -> None:
        """Write a reserved page's object and make it visible. Raises KeyError (unknown or
        reclaimed reservation) or ``CorruptPage`` (the object does not match its reservation:
        the reservation is aborted)."""
        e = self.pending.get(rid)
        if e is None:
            raise KeyError(f"no reservation {rid} (unknown, committed, aborted or expired)")
        try:
            if e.needs_parent and e.parent_pid not in self.index:
                raise CorruptPage("its parent page was not stored")
            h = codec.decode_header(obj)
            if (h.key, h.kind, h.parent, h.index) != (e.key, e.kind, e.parent, e.index):
                raise CorruptPage("object header does not match its reservation")
            if len(obj) != e.size or h.object_size != e.size:
                raise CorruptPage(f"object of {len(obj)} bytes, reserved {e.size}")
            codec.verify(obj, kind=e.kind, salt=h.salt, key=e.key, header=h)
        except CorruptPage:
            self.abort(rid)
            raise
        try:
            e.tier.write(e.slot, obj)
        except OSError as err:
            self.abort(rid)
            self._io_error(e.tier, e.kind, err)
            raise
        del self.pending[rid], self._pending_ids[e.pid]
        self._unpin(e.parent_pid)
        e.committed = True
        self.index[e.pid] = e
        self.children.setdefault(e.parent_pid, set()).add(e.pid)
        if e.block is not None:
            self.events.append(("stored", e.block))
        self._heat_up(e, self.clock())
        self._count("bytes_written", e.tier, e.kind, e.size)
        self._count("puts", e.tier, e.kind)

    def abort(self, rid: int) -> None:
        e = self.pending.pop(rid, None)
        if e is not None:
            del self._pending_ids[e.pid]
            self._unpin(e.parent_pid)
            e.tier.release(e.slot)

    def _unpin(self, pid: PageId) -> None:
        self._pinned[pid] -= 1
        if self._pinned[pid] <= 0:
            del self._pinned[pid]

    def _place(self, size: int) -> tuple[Tier, Slot] | None:
        """A slot for a new object: DRAM, making room by demotion, then by evicting a DRAM leaf;
        NVMe directly when DRAM cannot hold the class at all."""
        dram, nvme = self.dram, self.nvme
        dsize = dram.slot_size(size)
        if dram.capacity >= dsize:
            slot = dram.alloc(size)
            while slot is None and self._nvme_ok() and self._demote(dsize):
                slot = dram.alloc(size)
            while slot is None and (self._evict(dram, dsize) or self._reassign(dram, dsize)):
                slot = dram.alloc(size)
            if slot is not None:
                return dram, slot
        if nvme is not None and self._nvme_ok():
            slot = self._nvme_slot(size)
            if slot is not None:
                return nvme, slot
        return None

    def _nvme_slot(self, size: int) -> Slot | None:
        assert self.nvme is not None
        nvme, nsize = self.nvme, self.nvme.slot_size(size)
        slot = nvme.alloc(size)
        while slot is None and (self._evict(nvme, nsize) or self._reassign(nvme, nsize)):
            slot = nvme.alloc(size)
        return slot

    def _reassign(self, tier: Tier, size: int) -> bool:
        """Class ``size`` has nothing to evict and the tier no capacity left: give it room by
        emptying another class's last chunk (that class's coldest leaves evicted until its pages
        in the chunk can move to its other slots) and handing the bytes back (memcached's slab
        reassignment). False if no class can give."""
        if tier.capacity - tier.given >= size:
            return False
        for other in sorted(tier.classes):
            span = tier.last_chunk(other)
            if other == size or not span:
                continue
            if any(
                e.tier is tier and e.slot[0] == other and e.slot[1] in span for e in self.pending.values()
            ):
                continue
            while True:
                inside = [
                    e
                    for e in self.index.values()
                    if e.tier is tier and e.slot[0] == other and e.slot[1] in span
                ]
                spare = [i for i in tier.classes[other].free if i < span.start]
                # DRAM with an NVMe tier behind it: the class's coldest pages move down, not out
                down = self._demote if tier is self.dram and self._nvme_ok() else None
                made = down(other) if down is not None else self._evict(tier, other)
                if len(spare) >= len(inside) or any(e.leased for e in inside) or not made:
                    break
            if len(spare) < len(inside) or any(e.leased for e in inside):
                continue
            for e in inside:
                dst = (other, spare.pop())
                tier.classes[other].free.remove(dst[1])
                tier.used += other
                tier.write(dst, tier.read(e.slot, e.size))
                tier.release(e.slot)
                e.slot = dst
                self.heat.set_score(e, e.score)
            tier.shrink(other)
            return True
        return False

    def _demote(self, dsize: int) -> bool:
        e = self.heat.coldest(self.dram, dsize, lambda x: x.leased == 0)
        return e is not None and self._move(e, self.nvme)  # type: ignore[arg-type]

    def _move(self, e: Entry, to: Tier) -> bool:
        """Move a committed page to another tier; False when that tier has no room for it."""
        slot = self._nvme_slot(e.size) if to is self.nvme else to.alloc(e.size)
        if slot is None:
            return False
        try:
            to.write(slot, e.tier.read(e.slot, e.size))
        except OSError as err:  # the page stays where it is
            to.release(slot)
            self._io_error(to if to is self.nvme else e.tier, e.kind, err)
            return False
        self._count("demotions" if to is self.nvme else "promotions", e.tier, e.kind)
        e.tier.release(e.slot)
        e.tier, e.slot, e.nvme_reads = to, slot, 0
        self.heat.set_score(e, e.score)  # into the new tier's heap
        return True

    def _evict(self, tier: Tier, size: int) -> bool:
        e = self.heat.coldest(tier, size, self._evictable)
        if e is None:
            return False
        self._count("evictions", tier, e.kind)
        self._drop(e)
        return True

    def _drop(self, e: Entry) -> None:
        del self.index[e.pid]
        self.heat.forget(e)
        if e.block is not None:
            self.events.append(("removed", e.block))
        sib = self.children.get(e.parent_pid)
        if sib is not None:
            sib.discard(e.pid)
            if not sib:
                del self.children[e.parent_pid]
        e.tier.release(e.slot)

    # -- reads ------------------------------------------------------------------------------------
    def lookup(self, pids: Sequence[PageId], lease_s: float | None = None) -> tuple[list[bool], int]:
        """Which pages are present, and a lease on those that are (0 = none granted)."""
        self.maintain()
        present = [p in self.index for p in pids]
        for p, ok in zip(pids, present, strict=True):
            kind = KIND_NAMES.get(p[1], "?")
            self.stats[("hits" if ok else "misses", "any", kind)] += 1
        return present, self.pin([p for p, ok in zip(pids, present, strict=True) if ok], lease_s)

    def pin(self, pids: Sequence[PageId], lease_s: float | None = None) -> int:
        """A lease on the resident pages of ``pids`` (not counted as a lookup); 0 when none is."""
        got = [p for p in pids if p in self.index]
        if not got:
            return 0
        lid = next(self._ids)
        until = self.clock() + (self.lease_s if lease_s is None else lease_s)
        self.leases[lid] = _Lease(until, got)
        heapq.heappush(self._lease_heap, (until, lid))
        for p in got:
            self.index[p].leased += 1
        return lid

    def release(self, lease: int) -> None:
        """End a lease early (unknown or expired ids are ignored)."""
        ls = self.leases.pop(lease, None)
        for p in ls.pids if ls else ():
            e = self.index.get(p)
            if e is not None and e.leased > 0:
                e.leased -= 1

    def read(self, pid: PageId) -> bytes | None:
        """A committed page's object, or None (absent, or corrupt: then deleted and counted)."""
        obj = self._read(pid, True)
        assert obj is None or isinstance(obj, bytes)
        return obj

    def read_view(self, pid: PageId) -> bytes | memoryview | None:
        """``read``, but a DRAM page comes as a view into the tier, valid only while the page is
        leased: the caller holds a lease on it (``pin``) until it is done with the view."""
        return self._read(pid, False)

    def _read(self, pid: PageId, copy: bool) -> bytes | memoryview | None:
        e = self.index.get(pid)
        if e is None:
            return None
        tier = e.tier
        try:
            obj = tier.read(e.slot, e.size) if copy or tier is self.nvme else tier.view(e.slot, e.size)
            if tier is self.nvme:
                codec.verify(obj, kind=e.kind, salt=codec.decode_header(obj).salt, key=e.key)
        except (CorruptPage, OSError) as err:
            if isinstance(err, OSError):
                self._io_error(tier, e.kind, err)
            else:
                self._count("corrupt_pages", tier, e.kind)
            self.remove([pid])
            return None
        self._heat_up(e, self.clock())
        self._count("reads", tier, e.kind)
        self._count("bytes_read", tier, e.kind, e.size)
        if tier is self.nvme:
            e.nvme_reads += 1
            if e.nvme_reads >= self.promote_reads:
                self._promote(e)
        return obj

    def _promote(self, e: Entry) -> None:
        dram = self.dram
        # a leased page may move up: readers find its slot when they read, and only DRAM pages
        # are ever handed out as views (``read(copy=False)``)
        if dram.capacity < dram.slot_size(e.size):
            return
        if dram.free_slots(dram.slot_size(e.size)) == 0:
            cold = self.heat.coldest(dram, dram.slot_size(e.size), lambda x: x.leased == 0)
            nvme = self.nvme if self._nvme_ok() else None
            if cold is None or cold.score >= e.score or nvme is None or not self._move(cold, nvme):
                return
        self._move(e, dram)

    def touch(self, pids: Iterable[PageId]) -> None:
        """Count an access to each resident page of ``pids``; ancestors are lifted once, deepest
        first, so touching a whole chain is linear in its length."""
        now = self.clock()
        hit = [e for p in pids if (e := self.index.get(p)) is not None]
        for e in hit:
            self._heat_up(e, now, propagate=False)
        for e in sorted(hit, key=lambda x: -x.index):
            self._propagate(e)

    def remove(self, pids: Iterable[PageId]) -> int:
        """Delete pages with their resident descendants, leases or not (admin, corrupt pages).
        Returns how many were deleted."""
        n = 0
        stack = [p for p in pids if p in self.index]
        while stack:
            p = stack.pop()
            e = self.index.get(p)
            if e is None:
                continue
            stack.extend(self.children.get(p, ()))
            self._drop(e)
            n += 1
        return n

    # -- recovery and accounting ------------------------------------------------------------------
    def recover(self) -> None:
        """Rebuild the index from the NVMe slots (``recovery.stored_pages``); the dropped slots
        are counted in ``recovered``."""
        assert self.nvme is not None
        pages, self.recovered["dropped"] = stored_pages(self.nvme)
        for e in pages:
            self.index[e.pid] = e
            self.children.setdefault(e.parent_pid, set()).add(e.pid)
        self.recovered["pages"] = len(pages)
        now = self.clock()
        for e in sorted(pages, key=lambda x: -x.index):  # children first: parents end hotter
            self._heat_up(e, now)

    def blocks(self) -> list[Block]:
        """The index blocks of every stored page (a snapshot for the routers)."""
        return [e.block for e in self.index.values() if e.block is not None]

    def _count(self, what: str, tier: Tier, kind: int, n: int = 1) -> None:
        self.stats[(what, tier.name, KIND_NAMES.get(kind, "any"))] += n

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity, bytes given to slot classes, bytes used, pages, pages leased."""
        out: dict[str, dict[str, int]] = {}
        for t in (self.dram, self.nvme):
            if t is None:
                continue
            pages = [e for e in self.index.values() if e.tier is t]
            out[t.name] = {
                "capacity": t.capacity,
                "given": t.given,
                "used": t.used,
                "pages": len(pages),
                "leased": sum(e.leased > 0 for e in pages),
                "writing": sum(e.tier is t for e in self.pending.values()),
            }
        return out

    def close(self) -> None:
        self.dram.close()
        if self.nvme is not None:
            self.nvme.close()
