"""Precise mode of the prefix index over Redis: ``RedisEventPublisher`` (a prefill worker XADDs its
cache's block events, with a per-instance ``seq``, to the ``{ns}:events`` stream) and
``IndexFollower`` (a router XREADs after its last id and applies them to its ``PrefixIndex``).
A lost event is never repaired one by one: the instance re-publishes a snapshot, asked for by a
``seq`` gap or a lost marker key. Redis errors propagate to the callers.

Events, loss and recovery: docs/DESIGN.md#routingrediseventspy"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swaserve.kvcache.block_events import BlockEvent
from swaserve.routing.events import StreamEntry, apply_events, entry_fields, parse_entry, text
from swaserve.routing.index import PrefixIndex

log = logging.getLogger(__name__)

# 100k entries of a few hundred bytes each (a stored entry carries the blocks new since its
# chain's last entry; a 32K-token chain of 64-token blocks is ~10 KB when sent whole) hold minutes
# of events of a busy cluster in tens of MB; a router replica that is down longer re-reads what is
# left and asks the instances whose entries it missed for a snapshot.
DEFAULT_STREAM_MAXLEN = 100_000


# KEYS: stream, marker. ARGV: epoch, set marker (1/0), maxlen, check marker (1/0), then per entry
# its field count and fields. Returns the entries added, -1 when the marker check failed.
_APPEND = """
if ARGV[4] == '1' and redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local i, n = 5, 0
while i <= #ARGV do
  local k = tonumber(ARGV[i])
  local cmd = {'XADD', KEYS[1], 'MAXLEN', '~', ARGV[3], '*'}
  for j = i + 1, i + k do cmd[#cmd + 1] = ARGV[j] end
  redis.call(unpack(cmd))
  i, n = i + k + 1, n + 1
end
if ARGV[2] == '1' then redis.call('SET', KEYS[2], ARGV[1]) end
return n
"""


class MarkerLost(RuntimeError):
    """A publisher's marker is gone (Redis restarted empty) or another's: re-publish a snapshot."""


def stream_key(namespace: str) -> str:
    """The Redis stream of a cluster's events: ``{namespace}:events`` (a hash tag, as the keys of
    ``routing.redis.store``, so a Redis Cluster keeps them in one slot)."""
    return "{" + namespace + "}:events"


def resync_key(namespace: str) -> str:
    """The set of instances a follower asked for a snapshot: ``{namespace}:resync``."""
    return "{" + namespace + "}:resync"


def marker_key(namespace: str, instance: str) -> str:
    """An instance publisher's marker: ``{namespace}:pub:<instance>`` (its epoch)."""
    return "{" + namespace + "}:pub:" + instance


class RedisEventPublisher:
    """A worker's side: XADD events to ``stream_key(namespace)``, numbered by ``seq``.

    Args:
        client: a ``redis.Redis`` (either ``decode_responses`` setting).
        namespace: the cluster's key prefix (the routers' ``RedisPrefixIndex`` namespace).
        instance: this worker's name in the index: the address the router dispatches to.
        maxlen: approximate cap on the stream's entries (``MAXLEN ~``), >= 1.

    Raises:
        ValueError: ``maxlen < 1`` or an empty ``instance``.
    """

    def __init__(
        self, client: Any, namespace: str, instance: str, maxlen: int = DEFAULT_STREAM_MAXLEN
    ) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be at least 1, got {maxlen}")
        if not instance:
            raise ValueError("instance must not be empty")
        self.r, self.key, self.instance, self.maxlen = client, stream_key(namespace), instance, maxlen
        self.resync_key, self.marker_key = resync_key(namespace), marker_key(namespace, instance)
        self.epoch = uuid.uuid4().hex  # this publisher's marker value
        self.seq = 0  # the next entry's number
        self._claimed = False  # a snapshot of ours was published: appends check the marker
        self._append = client.register_script(_APPEND)

    def publish(self, events: Sequence[BlockEvent]) -> int:
        """Append ``events`` in order, one entry each, in one atomic round trip (a Lua script);
        stored and removed events without hashes are left out. A batch holding a ``cleared`` event
        (a snapshot) also sets this publisher's marker. Once a snapshot was published, a batch
        without one is appended only while the marker is still this publisher's: on a stream that
        Redis lost (restarted empty) its chains would hang off blocks no follower saw.

        Returns:
            The entries added.

        Raises:
            MarkerLost: the marker is gone or another's; nothing was added, ``seq`` did not move,
                and only a snapshot can be appended now.
            Redis errors (then nothing or everything was added; ``seq`` moved past all).
        """
        todo = [e for e in events if e.hashes or e.op == "cleared"]
        if not todo:
            return 0
        snapshot = any(e.op == "cleared" for e in todo)
        args: list[str | int] = [self.epoch, "1" if snapshot else "0", self.maxlen]
        args.append("1" if self._claimed and not snapshot else "0")
        for i, e in enumerate(todo):
            fields = entry_fields(self.instance, e, self.seq + i)
            args.append(2 * len(fields))
            for k, v in fields.items():
                args += [k, v]
        seq, self.seq = self.seq, self.seq + len(todo)
        added = int(self._append(keys=[self.key, self.marker_key], args=args))
        if added < 0:
            self.seq = seq
            raise MarkerLost(f"{self.marker_key} is not this publisher's: the stream was lost")
        self._claimed = self._claimed or snapshot
        return added

    def check(self) -> bool:
        """Whether this instance must re-publish its whole state: a follower asked (the request is
        taken), or the marker is not this publisher's (Redis restarted empty, no snapshot was
        published yet, or another publisher uses this instance name). One round trip.

        Raises:
            Redis errors.
        """
        pipe = self.r.pipeline(transaction=False)
        pipe.srem(self.resync_key, self.instance)
        pipe.get(self.marker_key)
        asked, mark = pipe.execute()
        return bool(asked) or mark is None or text(mark) != self.epoch


class IndexFollower:
    """A router's side: read the event stream after the last entry seen and apply it to ``index``;
    ask an instance for a snapshot when its ``seq`` skips (module docstring).

    Args:
        index: the index to keep up to date (in memory, or Redis shared by router replicas: then
            one follower per cluster is enough, more do the same work twice but no harm).
        client: a ``redis.Redis`` holding the stream.
        namespace: the cluster's key prefix.
        clock: seconds, the index's clock (stored events are recorded at ``clock()``).
        from_start: read the stream's backlog (True: a fresh router replica rebuilding its index),
            or only entries added after construction (False).
        last_id: resume after this stream id instead (e.g. a previous follower's ``last_id``).

    Attributes:
        expect: instance -> the ``seq`` its next entry should have.
        gaps: skips seen (each asked the instance for a snapshot).
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
        self.resync_key = resync_key(namespace)
        self.expect: dict[str, int] = {}
        self.gaps = 0
        if last_id is not None:
            self.last_id = last_id
        elif from_start:
            self.last_id = "0-0"
        else:  # "$" resolved now, so nothing added between construction and the first poll is lost
            top = client.xrevrange(self.key, count=1)
            self.last_id = text(top[0][0]) if top else "0-0"

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

        Raises:
            ValueError: ``count < 1``. Redis errors.
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
                    self._sequence(got)
                    n += apply_events(self.index, got.instance, [got.event], now)
                self.last_id = text(eid)
        return n

    def ask(self, instance: str) -> None:
        """Ask ``instance`` to re-publish its whole cache (its pump checks every second), e.g. a
        worker seen back after its entries were dropped. Raises Redis errors."""
        self.r.sadd(self.resync_key, instance)

    def _sequence(self, e: StreamEntry) -> None:
        """Track ``e.instance``'s ``seq``; on a skip, ask it for a snapshot (Redis errors raise
        before ``expect`` moves, so the retry asks again)."""
        if e.seq is None:
            return
        if e.event.op != "cleared" and self.expect.get(e.instance) != e.seq:
            self.ask(e.instance)
            self.gaps += 1
            log.info(
                "index events of %s skip to seq %d (expected %s): asked it for a snapshot",
                e.instance, e.seq, self.expect.get(e.instance, "its first entry, a snapshot"),
            )  # fmt: skip
        self.expect[e.instance] = e.seq + 1
