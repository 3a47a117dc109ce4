"""The prefix cache's event log (sans IO): which blocks of ``block_tokens`` tokens became cached or
left the cache, for the router's precise-mode index (``routing.redis.events``).

A block is cached while the tree holds the full-attention KV of it and of everything before it,
on device or host; splits, merges, tier moves and SWA-only changes emit nothing. ``BlockEventLog``:
stored chains (or new blocks linked to a chain sent whole less than ``refresh_s`` ago), removed
blocks, and ``snapshot`` (``cleared`` + every cached block). Rules: docs/DESIGN.md#kvcacheblock_eventspy"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from swaserve.kvcache.hashing import block_hashes
from swaserve.kvcache.radix import RadixNode

EventOp = Literal["stored", "removed", "cleared"]
OPS: tuple[EventOp, ...] = ("stored", "removed", "cleared")
REFRESH_S = 10.0  # seconds a whole-chain event stays the base of linked ones (index TTL: 1 h)
MEMO_CHAINS = 16  # chains remembered for linking and hashing (interleaved chunked prefills)


@dataclass(frozen=True)
class BlockEvent:
    """One change of an instance's cached blocks.

    Attributes:
        op: ``stored`` (``hashes``: blocks ``depth, depth + 1, ...`` of one chain that became
            cached), ``removed`` (these blocks' full KV left the cache on every tier; any order) or
            ``cleared`` (no hashes: forget every block of the instance; a snapshot follows).
        hashes: block keys (``kvcache.hashing.block_hashes``), unsigned 64-bit ints.
        parent: stored only: the key of block ``depth - 1`` when the blocks continue a chain stored
            before (None: ``hashes`` start at the root block, ``depth`` 0).
        depth: stored only: position of ``hashes[0]`` in its chain.
    """

    op: EventOp
    hashes: tuple[int, ...]
    parent: int | None = None
    depth: int = 0


def path_tokens(x: RadixNode | None) -> list[int]:
    """Token ids from the root to the end of ``x`` (empty for the root or None)."""
    parts: list[list[int]] = []
    while x is not None:
        parts.append(x.key)
        x = x.parent
    return [t for key in reversed(parts) for t in key]


@dataclass
class _Chain:
    tokens: list[int]  # the first len(hashes) * B tokens of the path
    hashes: list[int]
    whole_at: float | None  # log time of its last whole (root) stored event; None: the next drain's


class BlockEventLog:
    """Pending ``BlockEvent``s of one cache, in the order they happened.

    Args:
        block_tokens: tokens per block (``B``), a positive multiple of ``page_size``.
        page_size: the tree's tokens per page.
        salt: chain seed (``kvcache.hashing.root_hash``); the router must hash with the same.
        refresh_s: seconds (of the drain clock) a chain sent whole stays the base of linked events.

    Raises:
        ValueError: ``block_tokens`` is not a positive multiple of ``page_size``.
    """

    def __init__(
        self, block_tokens: int, page_size: int, salt: str = "", refresh_s: float = REFRESH_S
    ) -> None:
        if block_tokens < 1 or block_tokens % page_size:
            raise ValueError(
                f"index block_tokens must be a positive multiple of the page size {page_size}, "
                f"got {block_tokens}"
            )
        self.block_tokens, self.salt, self.refresh_s = block_tokens, salt, refresh_s
        self.pending: list[BlockEvent] = []
        self.now: float | None = None  # the caller's clock at the last drain (seconds; None: none yet)
        self._chains: list[_Chain] = []  # most recent first

    def _find(self, tokens: Sequence[int], j: int) -> _Chain | None:
        """A remembered chain holding the first ``j`` whole blocks of ``tokens`` (j >= 1)."""
        B, head = self.block_tokens, list(tokens[: j * self.block_tokens])
        for c in self._chains:  # the block before the new part first: cheap, and rarely equal by chance
            if (
                len(c.hashes) >= j
                and c.tokens[(j - 1) * B : j * B] == head[-B:]
                and c.tokens[: j * B] == head
            ):
                return c
        return None

    def stored(self, tokens: Sequence[int], new_from: int) -> None:
        """The tree now holds ``tokens`` (a whole path from the root) and did not hold its part
        from ``new_from`` on. Emits the blocks ending after ``new_from``, if any: linked to the
        block before them when the path continues a chain sent whole less than ``refresh_s`` ago,
        else the chain from the root (module docstring)."""
        B = self.block_tokens
        n = len(tokens) // B
        if n * B <= new_from:
            return  # no block became whole
        j = new_from // B  # blocks [0, j) were cached before: whole inside [0, new_from)
        c = self._find(tokens, j) if j else None
        if c is None:
            hashes = block_hashes(tokens[: n * B], B, self.salt)
        else:
            hashes = c.hashes[:j] + block_hashes(tokens[j * B : n * B], B, self.salt, c.hashes[j - 1])
        if c is not None and (
            c.whole_at is None or self.now is None or self.now - c.whole_at <= self.refresh_s
        ):
            ev, whole_at = BlockEvent("stored", tuple(hashes[j:]), hashes[j - 1], j), c.whole_at
        else:
            ev, whole_at = BlockEvent("stored", tuple(hashes)), self.now
        last = self.pending[-1] if self.pending else None
        if last is not None and last.op == "stored":
            end = last.depth + len(last.hashes)  # ``last`` covers blocks [last.depth, end)
            if end <= n and hashes[end - 1] == last.hashes[-1]:  # same chain key = same prefix
                if ev.depth == 0:
                    self.pending.pop()  # the whole chain covers ``last``
                elif last.depth <= ev.depth <= end:
                    self.pending.pop()
                    ev = BlockEvent("stored", last.hashes + tuple(hashes[end:]), last.parent, last.depth)
        self.pending.append(ev)
        if c is not None and len(c.hashes) <= n and hashes[len(c.hashes) - 1] == c.hashes[-1]:
            self._chains.remove(c)  # a prefix of the new chain: superseded
        del self._chains[MEMO_CHAINS - 1 :]
        self._chains.insert(0, _Chain(list(tokens[: n * B]), hashes, whole_at))

    def removed(self, x: RadixNode) -> None:
        """``x`` and its subtree are about to leave the tree (``x.parent`` still set): emit the keys
        of the blocks ending inside them."""
        B, out = self.block_tokens, []
        stack = [(x, path_tokens(x.parent))]
        while stack:
            y, before = stack.pop()
            path = before + y.key
            lo, hi = len(before) // B, len(path) // B
            if hi > lo:
                out.extend(block_hashes(path[: hi * B], B, self.salt)[lo:])
            stack.extend((c, path) for c in y.children.values())
        if out:
            self.pending.append(BlockEvent("removed", tuple(out)))

    def drain(self, now: float | None = None) -> list[BlockEvent]:
        """Return the pending events, oldest first, and clear them.

        Args:
            now: the caller's clock (seconds, monotonic); the log's time until the next drain
                (None: unchanged).
        """
        if now is not None:
            self.now = now
            for c in self._chains:
                if c.whole_at is None:
                    c.whole_at = now  # sent in the interval this drain ends
        out, self.pending = self.pending, []
        return out

    def snapshot(self, root: RadixNode, now: float | None = None) -> list[BlockEvent]:
        """The whole state under ``root`` (the tree's root): ``cleared``, then stored chains
        covering every cached block once, each chain before the chains linked to it. Pending
        events are dropped: the snapshot supersedes them, and later events follow it.

        Args:
            now: as for ``drain``.

        Returns:
            ``[cleared, stored...]``: one stored chain per leaf path with a block of its own
            (parent: its branch point's last block; the first child of a node continues the
            node's chain).
        """
        self.drain(now)
        B = self.block_tokens
        segs: list[tuple[int | None, int, list[int]]] = []  # (parent, depth, hashes), in order
        # (node, tokens after the last whole block before it, that block's key, blocks before it,
        #  the chain it extends: an index into segs, or None to start one)
        stack: list[tuple[RadixNode, list[int], int | None, int, int | None]] = [(root, [], None, 0, None)]
        while stack:
            x, rest, last, nb, seg = stack.pop()
            toks = rest + x.key
            k = len(toks) // B
            if k:
                new = block_hashes(toks[: k * B], B, self.salt, last)
                if seg is None:
                    segs.append((last, nb, new))
                    seg = len(segs) - 1
                else:
                    segs[seg][2].extend(new)
                last, nb, rest = new[-1], nb + k, toks[k * B :]
            else:
                rest = toks
            for i, child in enumerate(x.children.values()):
                stack.append((child, rest, last, nb, seg if i == 0 else None))
        out = [BlockEvent("cleared", ())]
        out += [BlockEvent("stored", tuple(hs), parent, depth) for parent, depth, hs in segs]
        return out
