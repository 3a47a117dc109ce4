"""The precise-mode index's pure half: stream entries <-> ``kvcache.block_events.BlockEvent``
(``entry_fields`` / ``parse_entry``) and their application to a ``PrefixIndex`` (``apply_events``).

Stream entry fields (one per event): ``instance`` (the worker's address, as the router names it),
``op``, ``hashes`` (decimal keys, comma-separated: Lua and JSON would round 64-bit integers;
empty for ``cleared``), ``seq`` (the publisher's entry counter: 0, 1, 2, ...), and for linked
stored events ``parent`` and ``depth``. The Redis stream itself: ``routing.redis.events``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from swaserve.kvcache.block_events import OPS, BlockEvent
from swaserve.routing.index import PrefixIndex

log = logging.getLogger(__name__)


def apply_events(index: PrefixIndex, instance: str, events: Iterable[BlockEvent], now: float) -> int:
    """Apply ``instance``'s events to ``index`` in order: ``record(instance, hashes, now, depth,
    parent)`` for stored, ``evict(instance, hashes)`` for removed, ``remove_instance(instance)``
    for cleared. Stored and removed events without hashes are skipped.

    Args:
        now: the index clock (seconds) stored events are recorded at.

    Returns:
        Events applied.

    Raises:
        ValueError: an unknown ``op``, or a stored event's ``depth`` / ``parent`` do not fit
            (``index.check_chain``).
    """
    n = 0
    for e in events:
        if e.op not in OPS:
            raise ValueError(f"unknown block event op {e.op!r}")
        if e.op == "cleared":
            index.remove_instance(instance)
        elif not e.hashes:
            continue
        elif e.op == "stored":
            index.record(instance, e.hashes, now, e.depth, e.parent)
        else:
            index.evict(instance, e.hashes)
        n += 1
    return n


def entry_fields(instance: str, event: BlockEvent, seq: int) -> dict[str, str]:
    """The stream entry fields of ``instance``'s ``event``, its publisher's entry number ``seq``."""
    fields = {"instance": instance, "op": event.op, "hashes": ",".join(map(str, event.hashes))}
    fields["seq"] = str(seq)
    if event.parent is not None:
        fields |= {"parent": str(event.parent), "depth": str(event.depth)}
    return fields


def text(v: Any) -> str:
    """A Redis reply value as ``str`` (bytes decoded as UTF-8)."""
    return v.decode() if isinstance(v, bytes) else str(v)


class StreamEntry(NamedTuple):
    """One parsed stream entry: who, what, and its publisher's ``seq`` (None if absent)."""

    instance: str
    event: BlockEvent
    seq: int | None


def parse_entry(fields: Mapping[Any, Any]) -> StreamEntry | None:
    """The ``StreamEntry`` of one stream entry's fields; None (logged) if malformed."""
    f = {text(k): text(v) for k, v in fields.items()}
    inst, op, raw = f.get("instance", ""), f.get("op", ""), f.get("hashes", "")
    try:
        hashes = tuple(int(h) for h in raw.split(",") if h)
        seq = int(f["seq"]) if "seq" in f else None
        parent = int(f["parent"]) if "parent" in f else None
        depth = int(f.get("depth", "0"))
        ok = bool(hashes) == (op != "cleared") and (parent is None) == (depth == 0) and depth >= 0
    except ValueError:
        ok = False
    if not inst or op not in OPS or not ok:
        log.warning("skipping malformed index event %r", f)
        return None
    return StreamEntry(inst, BlockEvent(op, hashes, parent, depth), seq)  # type: ignore[arg-type]
