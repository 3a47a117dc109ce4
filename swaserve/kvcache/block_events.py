"""The prefix cache's event log (sans IO): which blocks of ``block_tokens`` tokens became cached or
left the cache, for the router's precise-mode index (``routing.events``).

A block ``b`` of a token sequence (tokens ``[b*B, (b+1)*B)``) is *cached* while the radix tree
holds a path for all of ``[0, (b+1)*B)``, i.e. while the full-attention KV of the block and of
everything before it is on device or host. The rule is about full-attention KV only:

* a node created by an insert stores the blocks ending inside it: ``stored`` event with the chain
  from the root block to the deepest whole block of the inserted path;
* a node unlinked from the tree (device eviction without a host copy, host-tier drop, subtree
  deletion, flush) removes the blocks ending inside it and inside its descendants: ``removed``;
* splits and merges only reshape nodes, host <-> device moves and SWA trimming / tombstoning /
  revival leave the full KV where it is: nothing is emitted for them. A prefix whose SWA window
  is gone still saves the full-layer work when its window is recomputed.

A block ending inside a node is owned by that node alone (its end position lies in exactly one
node's span ``(start, end]`` on the path), so each block is stored and removed exactly once per
stay in the tree, and applying the events in order to an index yields the tree's block set.
Blocks only partly covered by the tree are not cached. Chain keys are
``routing.hashing.block_hashes`` over the node's path tokens from the root (a node's ``key`` holds
only its own tokens): O(path) per event; nothing at all is done while the log is disabled.
"""

from __future__ import annotations

from collections.abc import Sequence

from swaserve.kvcache.radix import RadixNode
from swaserve.routing.events import BlockEvent
from swaserve.routing.hashing import block_hashes


def path_tokens(x: RadixNode | None) -> list[int]:
    """Token ids from the root to the end of ``x`` (empty for the root or None)."""
    parts: list[list[int]] = []
    while x is not None:
        parts.append(x.key)
        x = x.parent
    return [t for key in reversed(parts) for t in key]


class BlockEventLog:
    """Pending ``BlockEvent``s of one cache, in the order they happened.

    Args:
        block_tokens: tokens per block (``B``), a positive multiple of ``page_size``.
        page_size: the tree's tokens per page.
        salt: chain seed (``routing.hashing.root_hash``); the router must hash with the same.

    Raises:
        ValueError: ``block_tokens`` is not a positive multiple of ``page_size``.
    """

    def __init__(self, block_tokens: int, page_size: int, salt: str = "") -> None:
        if block_tokens < 1 or block_tokens % page_size:
            raise ValueError(
                f"index block_tokens must be a positive multiple of the page size {page_size}, "
                f"got {block_tokens}"
            )
        self.block_tokens, self.salt = block_tokens, salt
        self.pending: list[BlockEvent] = []
        # the last chain hashed and its tokens: consecutive chunks of one prefill extend it, so
        # only their new blocks are hashed (a token compare, in C, replaces re-hashing the path)
        self._memo_tokens: list[int] = []
        self._memo_hashes: list[int] = []

    def _chain(self, tokens: Sequence[int], n: int) -> list[int]:
        """Keys of the first ``n`` whole blocks of ``tokens``."""
        B = self.block_tokens
        m = min(len(self._memo_hashes), n)
        if m and list(tokens[: m * B]) != self._memo_tokens[: m * B]:
            m = 0
        new = block_hashes(tokens[m * B : n * B], B, self.salt, self._memo_hashes[m - 1] if m else None)
        hashes = self._memo_hashes[:m] + new
        self._memo_tokens, self._memo_hashes = list(tokens[: n * B]), hashes
        return hashes

    def stored(self, tokens: Sequence[int], new_from: int) -> None:
        """The tree now holds ``tokens`` (a whole path from the root) and did not hold its part
        from ``new_from`` on. Emits the root chain to the last whole block if a block ends after
        ``new_from``. A pending stored event this one extends (same chain, shorter: consecutive
        chunks of one prefill) is replaced by it."""
        B = self.block_tokens
        n = len(tokens) // B
        if n * B <= new_from:
            return  # no block became whole
        hashes = tuple(self._chain(tokens, n))
        last = self.pending[-1] if self.pending else None
        k = len(last.hashes) if last is not None else 0
        if last is not None and last.op == "stored" and k <= n and hashes[k - 1] == last.hashes[-1]:
            self.pending[-1] = BlockEvent("stored", hashes)  # same chain key = same prefix
        else:
            self.pending.append(BlockEvent("stored", hashes))

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

    def drain(self) -> list[BlockEvent]:
        """Return the pending events, oldest first, and clear them."""
        out, self.pending = self.pending, []
        return out
