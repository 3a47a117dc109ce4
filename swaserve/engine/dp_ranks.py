"""The data-parallel ranks of one expert-parallel instance, seen as one engine (sans IO).

Under EP with data-parallel attention each rank runs its own requests, pools and prefix cache
(SGLang ``--enable-dp-attention``). The instance's front needs two things from that:

- ``RankBalancer``: which rank a new request goes to. A rank's cached prefix is worth the prompt
  tokens it saves; load is the tokens the rank still has to compute or emit. Prefixes are tracked
  approximately: the chained block keys of what each rank was sent, LRU-capped, as the router's
  approximate mode does across workers (``routing`` is a sibling layer: not reused here).
- ``EventMerger``: the ranks' prefix-cache block events as one instance's, for the router's
  index: a block is held while any rank holds it, so a rank's ``removed`` reaches the router only
  for blocks no other rank holds, and a rank's ``cleared`` becomes the ``removed`` of its blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from swaserve.kvcache.block_events import BlockEvent
from swaserve.kvcache.hashing import block_hashes


class RankBalancer:
    """Args:
    ranks: ranks of the instance. block_tokens: tokens per tracked prefix block (the page size
        is a good choice). clock: seconds. ttl_s: how long a sent prefix counts as cached.
        max_blocks: blocks remembered per rank (least recently sent dropped first).
    """

    def __init__(
        self,
        ranks: int,
        block_tokens: int,
        clock: Callable[[], float],
        ttl_s: float = 600.0,
        max_blocks: int = 200_000,
    ) -> None:
        self.ranks, self.block_tokens, self.clock = ranks, block_tokens, clock
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        self.sent: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(ranks)]
        self.load = [0] * ranks  # tokens to compute or emit, per rank

    def _hit(self, rank: int, hashes: Sequence[int], now: float) -> int:
        seen, n = self.sent[rank], 0
        for h in hashes:
            t = seen.get(h)
            if t is None or now - t > self.ttl_s:
                break
            n += 1
        return n

    def choose(self, prompt: Sequence[int], max_tokens: int) -> tuple[int, int]:
        """The rank for a request; returns ``(rank, cost)``: the rank minimizing uncached prompt
        tokens + its load (ties: the lower rank). Counts the request in the rank's load until
        ``done(rank, cost)``."""
        now = self.clock()
        hashes = block_hashes(prompt, self.block_tokens)
        hit = [self._hit(r, hashes, now) for r in range(self.ranks)]
        best = min(
            range(self.ranks), key=lambda r: (len(prompt) - hit[r] * self.block_tokens + self.load[r], r)
        )
        cost = len(prompt) - hit[best] * self.block_tokens + max_tokens
        self.load[best] += cost
        seen = self.sent[best]
        for h in hashes:
            seen[h] = now
            seen.move_to_end(h)
        while len(seen) > self.max_blocks:
            seen.popitem(last=False)
        return best, cost

    def done(self, rank: int, cost: int) -> None:
        """A request ``choose`` placed has ended."""
        self.load[rank] = max(0, self.load[rank] - cost)


class EventMerger:
    """Folds per-rank ``BlockEvent`` streams into the instance's stream (see the module doc)."""

    def __init__(self) -> None:
        self.holders: dict[int, set[int]] = {}

    def merge(self, rank: int, events: Sequence[BlockEvent]) -> list[BlockEvent]:
        """The instance's events for ``rank``'s, in order."""
        out: list[BlockEvent] = []
        for ev in events:
            if ev.op == "stored":
                for h in ev.hashes:
                    self.holders.setdefault(h, set()).add(rank)
                out.append(ev)  # re-storing a held block only refreshes its last use
            elif ev.op == "removed":
                gone = self._drop(rank, ev.hashes)
                if gone:
                    out.append(BlockEvent("removed", tuple(gone)))
            else:  # cleared: this rank holds nothing now
                mine = [h for h, rs in self.holders.items() if rank in rs]
                gone = self._drop(rank, mine)
                if gone:
                    out.append(BlockEvent("removed", tuple(gone)))
        return out

    def snapshot(self, per_rank: Sequence[Sequence[BlockEvent]]) -> list[BlockEvent]:
        """The instance's snapshot from every rank's (``cleared`` + stored chains each): one
        ``cleared``, then every rank's stored chains; the holders restart from them."""
        self.holders.clear()
        out = [BlockEvent("cleared", ())]
        for rank, events in enumerate(per_rank):
            out.extend(e for e in self.merge(rank, events) if e.op == "stored")
        return out

    def _drop(self, rank: int, hashes: Sequence[int]) -> list[int]:
        gone = []
        for h in hashes:
            rs = self.holders.get(h)
            if rs is None or rank not in rs:
                continue
            rs.discard(rank)
            if not rs:
                del self.holders[h]
                gone.append(h)
        return gone
