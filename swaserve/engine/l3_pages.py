"""The L3 tier's page logic without I/O, shared by the engine's tier (``engine.l3_tier``) and the
simulator (``sim.l3``): radix nodes' page chain keys (``ChainKeys``), the best stop point of a
lookup (``best_stop``), what a host-tier eviction writes back (``writeback``), and the routers'
index blocks of a prompt and of a store's log. Design: docs/DESIGN.md#gcache"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Collection

from swaserve.config import FULL, SWA
from swaserve.gcache.keys import page_keys
from swaserve.gcache.store import Block
from swaserve.kvcache.block_events import BlockEvent, BlockEventLog
from swaserve.kvcache.hashing import block_hashes
from swaserve.kvcache.radix import RadixNode

KNOWN_KEYS = 1 << 16  # keys remembered as stored in L3 (ancestors not re-sent)


def best_stop(present: list[bool], d: int, wp: int, min_pages: int) -> int:
    """The best stop point of a lookup of full pages ``d .. d + n`` then their SWA pages
    (``present``: 2n flags): the largest ``p`` with every full page ``d .. p`` and the SWA window
    ``p - wp .. p`` present, ``p - wp >= d`` and ``p - d >= min_pages``; 0 when none."""
    n = len(present) // 2
    full, swa = present[:n], present[n:]
    run, best = 0, 0
    for j in range(n):
        if not full[j]:
            break
        run = run + 1 if swa[j] else 0
        p = d + j + 1
        if run >= wp and p - d >= min_pages:
            best = p
    return best


class ChainKeys:
    """Page chain keys (``gcache.keys.page_keys``) of radix nodes' own pages, kept per node and
    checked by the identity of its key and parent (a split node is hashed again); at most ``cap``
    nodes, least recently used dropped. Args: page_size: tokens per page; seed: the salt's
    ``K_{-1}`` (16 bytes)."""

    def __init__(self, page_size: int, seed: bytes, cap: int = 1 << 15) -> None:
        self.P, self.seed, self.cap = page_size, seed, cap
        self.memo: OrderedDict[int, tuple[object, object, list[bytes]]] = OrderedDict()

    def _cached(self, x: RadixNode) -> list[bytes] | None:
        m = self.memo.get(x.id)
        if m is None or m[0] is not x.key or m[1] is not x.parent:
            return None
        self.memo.move_to_end(x.id)
        return m[2]

    def of(self, node: RadixNode) -> list[bytes]:
        """Keys of ``node``'s own pages (``len(node.key) // page_size``); the root has none."""
        todo: list[RadixNode] = []
        x: RadixNode | None = node
        prev = self.seed
        while x is not None and x.parent is not None:
            ks = self._cached(x)
            if ks is not None:
                prev = ks[-1] if ks else prev
                break
            todo.append(x)
            x = x.parent
        out: list[bytes] = self._cached(node) or []
        for x in reversed(todo):
            out = page_keys(x.key, self.P, prev)
            self.memo[x.id] = (x.key, x.parent, out)
            prev = out[-1] if out else prev
        while len(self.memo) > self.cap:
            self.memo.popitem(last=False)
        return out


def writeback(
    y: RadixNode, swa_only: bool, wp: int, chain: ChainKeys, known: Collection[bytes]
) -> tuple[list[int], list[bytes], list[tuple[str, int, str, int]]]:
    """What to put when ``y``'s host copies go: ``(path tokens, page keys, items)``, items
    ``(kind, page index, "host" | "device", page id)``: ``y``'s full pages and its ancestors' not
    in ``known`` (parents first; nothing when a page of the path has no copy), then the SWA window
    at ``y``'s end when every page of it has a copy (``swa_only``: that window alone)."""
    path: list[RadixNode] = []
    x: RadixNode | None = y
    while x is not None and x.parent is not None:
        path.append(x)
        x = x.parent
    path.reverse()
    chain.of(y)
    node_keys = [chain.of(n) for n in path]
    tokens = list(itertools.chain.from_iterable(n.key for n in path))
    keys = list(itertools.chain.from_iterable(node_keys))
    end = len(keys)
    items: list[tuple[str, int, str, int]] = []
    if not swa_only:
        off = 0
        for n, ks in zip(path, node_keys, strict=True):
            mine = n is y
            for j, k in enumerate(ks):
                if not mine and k in known:
                    continue
                if n.host_full is not None:
                    items.append((FULL, off + j, "host", n.host_full[j]))
                elif n.full is not None:
                    items.append((FULL, off + j, "device", n.full[j]))
                else:  # a page with no copy: nothing after it can be stored
                    return tokens, keys, []
            off += len(ks)
    window: list[tuple[str, int, str, int]] = []
    i = end
    for n, ks in zip(reversed(path), reversed(node_keys), strict=True):
        for j in range(len(ks) - 1, -1, -1):
            if end - i >= wp:
                break
            i -= 1
            hp = n.host_swa[j] if n.host_swa is not None else None
            if hp is not None:
                window.append((SWA, i, "host", hp))
            elif n.swa is not None:
                window.append((SWA, i, "device", n.swa[j]))
        if end - i >= wp:
            break
    if len(window) == min(wp, end):
        items += reversed(window)
    return tokens, keys, items


def router_blocks(tokens: list[int], page_size: int, events: BlockEventLog | None) -> dict[int, Block]:
    """Page index -> the routers' index block that page completes (``events``: the cache's event
    log, whose block size and salt the routers use; None: no blocks)."""
    if events is None:
        return {}
    B = events.block_tokens
    hs = block_hashes(tokens, B, events.salt)
    return {(b + 1) * B // page_size - 1: Block(h, b, hs[b - 1] if b else None) for b, h in enumerate(hs)}


def as_block_events(events: list[tuple[str, Block]]) -> list[BlockEvent]:
    """A store's index-block log (``PageStore.events``) as the routers' ``BlockEvent``s."""
    out = []
    for op, b in events:
        if op == "stored":
            out.append(BlockEvent("stored", (b.key,), b.parent, b.depth))
        else:
            out.append(BlockEvent("removed", (b.key,)))
    return out
