"""Precise mode of the prefix index: prefill workers publish the blocks their prefix cache stores
and removes, and the router's index follows them (instead of guessing at dispatch). ::

    worker: PrefixCache event log --drain--> RedisEventPublisher --XADD--> {ns}:events (a stream)
    router: IndexFollower --XREAD after its last id--> apply_events --> PrefixIndex.record / evict

Events (``BlockEvent``) are about *full-attention KV presence* on one instance, device or host
tier: ``stored`` carries a chain of block keys from the root block (``routing.hashing``) whose
deepest blocks just became cached (the leading ones are repeated, which refreshes their last use in
the index: a stored event is a ``record`` exactly as approximate mode's dispatch is); ``removed``
carries keys of blocks whose full KV left the instance's cache on every tier. SWA-only changes
(trimming or tombstoning a node's sliding-window KV) emit nothing: the index says where the
expensive full-layer KV is, and a prefix whose SWA window is gone still saves its full-layer work
once a window is recomputed. The event log itself lives in ``kvcache.block_events``.

Stream entries (one per event): ``instance`` (the worker's address, as the router names it),
``op`` (``stored`` | ``removed``), ``hashes`` (decimal keys, comma-separated: Lua and JSON would
round 64-bit integers). The stream is capped with ``XADD MAXLEN ~`` (``DEFAULT_STREAM_MAXLEN``); a
follower that falls further behind than the cap misses events (the index's TTL bounds the damage).
Redis errors propagate from both classes; callers decide (the worker drops and logs, a router
falls back to its local index).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from swaserve.routing.index import PrefixIndex

log = logging.getLogger(__name__)

EventOp = Literal["stored", "removed"]
OPS: tuple[EventOp, ...] = ("stored", "removed")

# 100k entries of a few hundred bytes each (a 32K-token prompt's chain of 64-token blocks is ~10 KB)
# hold minutes of events of a busy cluster in tens of MB; a router replica that is down longer
# re-reads what is left and the index's TTL ages out what it missed.
DEFAULT_STREAM_MAXLEN = 100_000


@dataclass(frozen=True)
class BlockEvent:
    """One change of an instance's cached blocks.

    Attributes:
        op: ``stored`` (``hashes`` is a chain from the root block; its deepest blocks became
            cached) or ``removed`` (these blocks' full KV left the cache on every tier; any order).
        hashes: block keys (``routing.hashing.block_hashes``), unsigned 64-bit ints.
    """

    op: EventOp
    hashes: tuple[int, ...]


def stream_key(namespace: str) -> str:
    """The Redis stream of a cluster's events: ``{namespace}:events`` (a hash tag, as the keys of
    ``routing.redis_store``, so a Redis Cluster keeps them in one slot)."""
    return "{" + namespace + "}:events"


def apply_events(index: PrefixIndex, instance: str, events: Iterable[BlockEvent], now: float) -> int:
    """Apply ``instance``'s events to ``index`` in order: ``record(instance, hashes, now)`` for
    stored, ``evict(instance, hashes)`` for removed. Events without hashes are skipped.

    Args:
        now: the index clock (seconds) stored events are recorded at.

    Returns:
        Events applied.

    Raises:
        ValueError: an event's ``op`` is neither ``stored`` nor ``removed``.
    """
    n = 0
    for e in events:
        if e.op not in OPS:
            raise ValueError(f"unknown block event op {e.op!r}")
        if not e.hashes:
            continue
        if e.op == "stored":
            index.record(instance, e.hashes, now)
        else:
            index.evict(instance, e.hashes)
        n += 1
    return n


class RedisEventPublisher:
    """A worker's side: XADD events to ``stream_key(namespace)``.

    Args:
        client: a ``redis.Redis`` (either ``decode_responses`` setting).
        namespace: the cluster's key prefix (the routers' ``RedisPrefixIndex`` namespace).
        instance: this worker's name in the index: the address the router dispatches to.
        maxlen: approximate cap on the stream's entries (``MAXLEN ~``), >= 1.
    """

    def __init__(
        self, client: Any, namespace: str, instance: str, maxlen: int = DEFAULT_STREAM_MAXLEN
    ) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, got {maxlen}")
        if not instance:
            raise ValueError("instance must not be empty")
        self.r, self.key, self.instance, self.maxlen = client, stream_key(namespace), instance, maxlen

    def publish(self, events: Sequence[BlockEvent]) -> int:
        """Append ``events`` in order, one entry each, in one round trip (a pipeline); events
        without hashes are left out. Returns the entries added. Raises Redis errors."""
        todo = [e for e in events if e.hashes]
        if not todo:
            return 0
        pipe = self.r.pipeline(transaction=False)
        for e in todo:
            fields = {"instance": self.instance, "op": e.op, "hashes": ",".join(map(str, e.hashes))}
            pipe.xadd(self.key, fields, maxlen=self.maxlen, approximate=True)
        pipe.execute()
        return len(todo)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_entry(fields: Mapping[Any, Any]) -> tuple[str, BlockEvent] | None:
    """``(instance, event)`` of one stream entry's fields; None (logged) if malformed."""
    f = {_text(k): _text(v) for k, v in fields.items()}
    inst, op, raw = f.get("instance", ""), f.get("op", ""), f.get("hashes", "")
    try:
        hashes = tuple(int(h) for h in raw.split(",") if h)
    except ValueError:
        hashes = ()
    if not inst or op not in OPS or not hashes:
        log.warning("skipping malformed index event %r", f)
        return None
    return inst, BlockEvent(op, hashes)  # type: ignore[arg-type]


class IndexFollower:
    """A router's side: read the event stream after the last entry seen and apply it to ``index``.

    Args:
        index: the index to keep up to date (in memory, or Redis shared by router replicas: then
            one follower per cluster is enough, more do the same work twice but no harm).
        client: a ``redis.Redis`` holding the stream.
        namespace: the cluster's key prefix.
        clock: seconds, the index's clock (stored events are recorded at ``clock()``).
        from_start: read the stream's backlog (True: a fresh router replica rebuilding its index),
            or only entries added after construction (False).
        last_id: resume after this stream id instead (e.g. a previous follower's ``last_id``).
    """

    def __init__(
        self,
        index: PrefixIndex,
        client: Any,
        namespace: str,
        clock: Callable[[], float],
        from_start: bool = True,
        last_id: str | None = None,
    ) -> None:
        self.index, self.r, self.key, self.clock = index, client, stream_key(namespace), clock
        if last_id is not None:
            self.last_id = last_id
        elif from_start:
            self.last_id = "0-0"
        else:  # "$" resolved now, so nothing added between construction and the first poll is lost
            top = client.xrevrange(self.key, count=1)
            self.last_id = _text(top[0][0]) if top else "0-0"

    def poll(self, block_ms: int = 0, count: int = 1000) -> int:
        """Read up to ``count`` entries after ``last_id`` and apply them; ``last_id`` advances past
        each entry once it is applied (or skipped as malformed), so after a Redis error the next
        call resumes where this one stopped.

        Args:
            block_ms: wait up to this many ms for a first entry when none is there (0: do not wait;
                unlike Redis' ``BLOCK 0``, never forever).
            count: most entries read by this call, >= 1.

        Returns:
            Events applied to the index.
        """
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        resp = self.r.xread({self.key: self.last_id}, count=count, block=block_ms if block_ms > 0 else None)
        if not resp:
            return 0
        if isinstance(resp, Mapping):  # RESP3: {key: [[entries]]}
            resp = [(k, v[0] if v and isinstance(v[0], list) else v) for k, v in resp.items()]
        now = self.clock()
        n = 0
        for _key, entries in resp:
            for eid, fields in entries:
                got = parse_entry(fields)
                if got is not None:
                    n += apply_events(self.index, got[0], [got[1]], now)
                self.last_id = _text(eid)
        return n
