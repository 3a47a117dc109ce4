"""Restart recovery of a GCache node's NVMe tier (``PageStore.recover``): the page objects its
slot files still hold, checked as a read checks them (header and payload CRC)."""

from __future__ import annotations

from swaserve.gcache import codec
from swaserve.gcache.codec import CorruptPage
from swaserve.gcache.heat import Entry, PageId
from swaserve.gcache.tiers import NvmeTier


def stored_pages(nvme: NvmeTier) -> tuple[list[Entry], int]:
    """The committed pages in ``nvme``'s slots as index entries (a key seen twice keeps its first
    slot), and how many written slots were dropped (torn, bad or duplicate; a slot never written
    is not counted). The kept slots are claimed in the tier; the others stay free."""
    used: dict[int, set[int]] = {s: set() for s in nvme.classes}
    seen: set[PageId] = set()
    pages: list[Entry] = []
    dropped = 0
    for slot, size in nvme.scan():
        raw = nvme.read(slot, size)
        try:
            h = codec.check_stored(raw)
        except CorruptPage:
            dropped += any(raw[:4])
            continue
        if (h.key, h.kind) in seen:
            dropped += 1
            continue
        seen.add((h.key, h.kind))
        pages.append(Entry(h.key, h.kind, h.parent, h.index, h.object_size, nvme, slot, committed=True))
        used[slot[0]].add(slot[1])
    for size, ids in used.items():
        nvme.claim(size, ids)
    return pages, dropped
