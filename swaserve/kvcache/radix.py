"""SWA-aware radix tree over page-aligned token ids: the prefix cache's structure, match and insert.

Nodes hold device and host full and SWA pages (a node without SWA pages is a tombstone). A hit of
length ``L`` is returned only if the full KV of ``[0, L)`` and the SWA KV of ``[L - W, L)`` are held
("window-safe"); requests lock their path (full) and last window (SWA). After SGLang's SWA radix
cache and vLLM v1's hybrid KV cache manager; eviction is in ``kvcache.prefix_cache``.

Page fields, match rule and locks: docs/DESIGN.md#kvcacheradixpy"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swaserve.kvcache.lru import CategoryLRU
from swaserve.kvcache.pool import PagePool

# SWA eviction categories of a node with live device SWA KV (SWA-aware trees only): more than a
# window of it ("trim"), on an inner node (a device child) or a leaf; an inner node all of whose
# SWA KV its live children shorter than the window need is "held"
TRIM_INNER, TRIM_LEAF, INNER, HELD, LEAF = "trim_inner", "trim_leaf", "inner", "held", "leaf"


class StoredSink(Protocol):
    """Told when tokens enter the tree (``kvcache.block_events.BlockEventLog`` is one)."""

    def stored(self, tokens: Sequence[int], new_from: int) -> None:
        """``tokens`` (from the root) are now a path of the tree; those from ``new_from`` are new."""


class RadixNode:
    """One edge of the radix tree (page fields: docs/DESIGN.md#kvcacheradixpy)."""

    __slots__ = (
        "children",
        "full",
        "ghost",
        "h_end",
        "hits",
        "host_full",
        "host_swa",
        "id",
        "key",
        "lock",
        "parent",
        "stamp",
        "swa",
        "swa_holders",
        "swa_lock",
        "swa_q",
    )  # fmt: skip

    _ids = itertools.count()

    def __init__(self, key: list[int], parent: RadixNode | None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.full: list[int] | None = None
        self.swa: list[int] | None = None
        self.host_full: list[int] | None = None
        self.host_swa: list[int | None] | None = None
        self.lock = 0
        self.swa_lock = 0
        self.swa_holders: set[int] = set()
        self.hits = 0
        self.id = next(RadixNode._ids)
        self.stamp = 0  # last use of its SWA KV (tree clock; SWA eviction order)
        self.swa_q: str | None = None  # SWA eviction category (``RadixTree.swa_category``)
        self.ghost = -1  # SWA-loss clock when its window was lost (``kvcache.adaptive``); -1: never
        self.h_end: int | None = None  # page chain hash at its end (``kvcache.adaptive``), lazy

    def __repr__(self) -> str:
        state = "dev" if self.full is not None else "host"
        swa = "live" if self.swa is not None else "tomb"
        return f"Node#{self.id}({len(self.key)} tok, {state}, swa {swa}, lock {self.lock}/{self.swa_lock})"

    @property
    def on_device(self) -> bool:
        return self.full is not None

    def has_device_child(self) -> bool:
        return any(c.full is not None for c in self.children.values())


@dataclass
class CacheLock:
    """A running request's hold on the tree: full lock on ``node``'s path, SWA lock on ``swa_nodes``."""

    id: int
    node: RadixNode
    swa_nodes: list[RadixNode] = field(default_factory=list)


@dataclass
class PathPage:
    """Where the KV of one logical page of a matched path lives (None = not in that tier)."""

    node: RadixNode
    index: int  # page index inside node
    full: int | None
    swa: int | None
    host_full: int | None
    host_swa: int | None


class RadixTree:
    """The tree, its pools' page ownership, locks and LRU order. Eviction: ``kvcache.prefix_cache``.

    Args:
        page_size: tokens per page.
        window: SWA window in tokens (``W``: previous tokens a query sees); None = SWA-unaware
            (SWA KV kept and needed for the whole prefix, as in ``--kv-layout full``).
        full_pool, swa_pool: the device pools the node pages come from (``swa_pool`` None when the
            model has no SWA layers).
    """

    def __init__(self, page_size: int, window: int | None, full_pool: PagePool, swa_pool: PagePool | None):
        self.page_size = page_size
        self.window = window
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.root = RadixNode([], None)
        self.root.full, self.root.swa = [], []
        self.lock_root()
        # least recently used first; values unused
        self.dev_lru: OrderedDict[RadixNode, None] = OrderedDict()
        self.host_lru: OrderedDict[RadixNode, None] = OrderedDict()
        # device SWA KV by eviction stage, LRU within each (``swa_category``)
        self.swa_order = CategoryLRU((TRIM_INNER, TRIM_LEAF, INNER), (HELD, LEAF))
        self._clock = itertools.count(1)
        self._handles: dict[int, CacheLock] = {}
        self._handle_ids = itertools.count()
        self.events: StoredSink | None = None  # set by PrefixCache.enable_events

    def lock_root(self) -> None:
        self.root.lock = 1 << 30  # never evicted

    @property
    def has_swa(self) -> bool:
        return self.swa_pool is not None

    def window_pages(self) -> int | None:
        """Trailing pages whose SWA KV a hit at a page boundary needs (None = all)."""
        if self.window is None:
            return None
        return -(-self.window // self.page_size)

    def swa_category(self, x: RadixNode) -> str | None:
        """Which SWA eviction stage ``x`` belongs to (None: no device SWA KV, or SWA-unaware)."""
        wp = self.window_pages()
        if x.swa is None or x.parent is None or wp is None or not self.has_swa:
            return None
        inner = x.has_device_child()
        if len(x.swa) > wp:
            return TRIM_INNER if inner else TRIM_LEAF
        if not inner:
            return LEAF
        return INNER if self.window_keep(x) < len(x.swa) else HELD

    def window_keep(self, x: RadixNode) -> int:
        """Trailing SWA pages of ``x`` that its live children shorter than the window need for a
        window-safe hit at their own end."""
        wp = self.window_pages()
        assert wp is not None
        return max([wp - len(c.swa) for c in x.children.values() if c.swa is not None] + [0])

    def requeue(self, *xs: RadixNode | None) -> None:
        """Re-place nodes whose SWA KV, size or device children changed in their SWA category."""
        for x in xs:
            if x is not None and x is not self.root:
                self.swa_order.put(x, self.swa_category(x))

    # -- walking ----------------------------------------------------------------------------------
    def _child_key(self, tokens: list[int], pos: int) -> tuple[int, ...]:
        return tuple(tokens[pos * self.page_size : (pos + 1) * self.page_size])

    def _common_pages(self, node: RadixNode, tokens: list[int], pos: int) -> int:
        P = self.page_size
        key, start = node.key, pos * P
        n = len(key) // P
        avail = (len(tokens) - start) // P
        if avail >= n and tokens[start : start + len(key)] == key:
            return n
        m = 0
        while m < min(n, avail) and tokens[start + m * P : start + (m + 1) * P] == key[m * P : (m + 1) * P]:
            m += 1
        return m

    def walk(self, tokens: list[int], max_pages: int) -> list[PathPage]:
        """Per-page location of the longest cached page-aligned prefix of ``tokens`` (up to
        ``max_pages`` pages), without changing the tree."""
        out: list[PathPage] = []
        node, pos = self.root, 0
        while pos < max_pages:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            m = min(self._common_pages(child, tokens, pos), max_pages - pos)
            for i in range(m):
                out.append(
                    PathPage(
                        child,
                        i,
                        child.full[i] if child.full is not None else None,
                        child.swa[i] if child.swa is not None else None,
                        child.host_full[i] if child.host_full is not None else None,
                        child.host_swa[i] if child.host_swa is not None else None,
                    )
                )
            if m < len(child.key) // self.page_size:
                break
            node, pos = child, pos + m
        return out

    def best_length(self, pages: list[PathPage], use_host: bool) -> tuple[int, int]:
        """(window-safe hit length in pages, leading pages whose full KV is on device) over a
        walked path."""
        wp = self.window_pages()
        best = 0
        run = 0  # consecutive SWA-available pages ending here (restarts at every tombstone)
        for i, pg in enumerate(pages):
            full_ok = pg.full is not None or (use_host and pg.host_full is not None)
            if not full_ok:
                break
            if self.has_swa:
                swa_ok = pg.swa is not None or (use_host and pg.host_swa is not None)
                run = run + 1 if swa_ok else 0
                need = i + 1 if wp is None else min(i + 1, wp)
                if run < need:
                    continue
            best = i + 1
        dev = 0
        while dev < best and pages[dev].full is not None:
            dev += 1
        return best, dev

    # -- structure --------------------------------------------------------------------------------
    def split(self, node: RadixNode, m: int) -> RadixNode:
        """Split ``node`` after its first ``m`` pages; returns the new upper node (``node`` keeps the
        tail, so references to it, e.g. a lock's deepest node, stay valid)."""
        P = self.page_size
        n = len(node.key) // P
        if not 0 < m < n:
            raise ValueError(f"split at {m} of {n} pages")
        parent = node.parent
        assert parent is not None
        head = RadixNode(node.key[: m * P], parent)
        parent.children[tuple(node.key[:P])] = head
        node.key = node.key[m * P :]
        node.parent = head
        head.children[tuple(node.key[:P])] = node
        for attr in ("full", "swa", "host_full", "host_swa"):
            v = getattr(node, attr)
            if v is not None:
                setattr(head, attr, v[:m])
                setattr(node, attr, v[m:])
        head.lock, head.swa_lock, head.hits = node.lock, node.swa_lock, node.hits
        head.stamp, head.ghost = node.stamp, node.ghost
        head.swa_holders = set(node.swa_holders)
        for h in node.swa_holders:
            self._handles[h].swa_nodes.append(head)
        if head.host_swa is not None and all(p is None for p in head.host_swa):
            head.host_swa = None
        if node.host_swa is not None and all(p is None for p in node.host_swa):
            node.host_swa = None
        # LRU: the head goes last, after its descendants (eviction scans oldest first and must
        # meet a child before its parent)
        for lru, has in ((self.dev_lru, head.full is not None), (self.host_lru, head.host_full is not None)):
            if has:
                lru[head] = None
        self.requeue(head, node, parent)
        return head

    def touch(self, node: RadixNode) -> None:
        """Mark ``node`` and its ancestors most recently used (ancestors after descendants); for
        SWA eviction only the nodes covering the path's last ``W`` tokens: the window a hit there
        uses. A window higher up the path (a chunk end, a branch point) ages from its own last
        use, so while the hit end's window lives those checkpoints go first."""
        covered = 0
        while node is not self.root:
            for lru in (self.dev_lru, self.host_lru):
                if node in lru:
                    lru.move_to_end(node)
            if self.window is None or covered < self.window:
                self.swa_order.restamp(node, next(self._clock))
            covered += len(node.key)
            assert node.parent is not None
            node = node.parent

    def demote_checkpoints(self, node: RadixNode, end: int, stop: int) -> int:
        """A finished prompt's chunk-end windows on the path of ``node`` (ending at token depth
        ``end``), above its two deepest node ends (the prompt's end and the last chunk end, where
        its next turn diverges) and below token depth ``stop`` (its hit), become the least
        recently used windows: once a deeper window of the same chain is cached they serve only
        a prompt diverging exactly there. Branch points keep their stamp (traffic diverged there:
        the next session will too). A hit ending at one restamps it (``touch``). Returns the
        windows demoted."""
        if self.window is None or not self.has_swa:
            return 0
        # the windows of the prompt's end and of the last chunk end (the node above ``node``)
        keep_from = end - len(node.key) - self.window
        demoted, x, top = 0, node, end
        while x is not self.root and top > stop:
            if top <= keep_from and x.swa is not None and len(x.children) == 1:  # not a branch point
                self.swa_order.demote(x)
                demoted += 1
            top -= len(x.key)
            assert x.parent is not None
            x = x.parent
        return demoted

    def node_at(self, pages: list[PathPage], n: int) -> RadixNode:
        """The node ending exactly at page ``n`` of a walked path, splitting if needed."""
        if n == 0:
            return self.root
        pg = pages[n - 1]
        node_pages = len(pg.node.key) // self.page_size
        if pg.index + 1 < node_pages:
            return self.split(pg.node, pg.index + 1)
        return pg.node

    # -- locks ------------------------------------------------------------------------------------
    def lock(self, node: RadixNode, swa: bool = True) -> CacheLock:
        """Full-lock ``node``'s path and (``swa``) SWA-lock the nodes covering its last ``W`` tokens."""
        h = CacheLock(next(self._handle_ids), node)
        self._handles[h.id] = h
        x: RadixNode | None = node
        while x is not None and x is not self.root:
            x.lock += 1
            x = x.parent
        if swa:
            self.lock_swa(h)
        return h

    def lock_swa(self, h: CacheLock) -> None:
        """SWA-lock the nodes covering the last ``W`` tokens of ``h``'s path (all live)."""
        if h.swa_nodes:
            raise RuntimeError("SWA lock taken twice (internal error)")
        covered, x = 0, h.node
        while x is not self.root and (self.window is None or covered < self.window):
            assert x is not None
            if self.has_swa:
                if x.swa is None:
                    raise RuntimeError(f"SWA lock on a tombstone {x} (internal error)")
                x.swa_lock += 1
                x.swa_holders.add(h.id)
                h.swa_nodes.append(x)
            covered += len(x.key)
            x = x.parent  # type: ignore[assignment]

    def unlock_swa(self, h: CacheLock) -> None:
        """Release only the SWA lock (the request's window has moved past the cached prefix)."""
        for x in h.swa_nodes:
            if x.swa_lock <= 0:
                raise RuntimeError(f"SWA lock count below zero on {x}")
            x.swa_lock -= 1
            x.swa_holders.discard(h.id)
        h.swa_nodes = []

    def unlock(self, h: CacheLock) -> None:
        self.unlock_swa(h)
        x: RadixNode | None = h.node
        while x is not None and x is not self.root:
            if x.lock <= 0:
                raise RuntimeError(f"lock count below zero on {x}")
            x.lock -= 1
            x = x.parent
        del self._handles[h.id]

    def handles(self) -> list[CacheLock]:
        return list(self._handles.values())

    # -- insert -----------------------------------------------------------------------------------
    def insert(
        self,
        tokens: list[int],
        full: list[int],
        swa: list[int | None],
        after: tuple[RadixNode, int] | None = None,
    ) -> tuple[RadixNode, list[int], list[int | None]]:
        """Add a request's KV for ``tokens`` (page-aligned) to the tree.

        Args:
            tokens: ``n * page_size`` token ids.
            full: [n] device full pages holding them (tree pages for a shared prefix, else the
                request's own).
            swa: [n] device SWA pages; None for pages whose SWA KV the request already freed (a
                None prefix, then live pages: ``swa_evicted`` in SGLang's terms).
            after: (node, k): ``node`` ends exactly at page ``k`` of ``tokens`` and is locked by
                the caller (it cannot have moved: splits keep a node's end); the walk starts there
                and ``full[:k]`` / ``swa[:k]`` are not looked at (chunked prefill inserting its
                next chunk costs O(chunk), not O(prefix)).

        Returns:
            (deepest node, the tree's full pages [k:n], the tree's SWA pages [k:n] (None =
            tombstone)), ``k = 0`` without ``after``. Request pages the tree adopts become
            tree-owned; request pages duplicating tree pages are freed here. Callers point the
            request at the returned pages.
        """
        P = self.page_size
        n = len(tokens) // P
        if len(tokens) != n * P or len(full) != n or len(swa) != n:
            raise ValueError("insert needs page-aligned tokens and one page id per page")
        node, pos = after if after is not None else (self.root, 0)
        if not 0 <= pos <= n or (node is self.root) != (pos == 0):
            raise ValueError(f"insert after page {pos} of {n} at {node}")
        live_from = next((i for i in range(pos, n) if swa[i] is not None), n)
        if any(p is None for p in swa[live_from:]):
            raise ValueError("SWA pages must be a None prefix then live pages")
        start_pos = pos
        while pos < n:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                node = self._new_leaves(node, tokens, pos, n, full, swa, live_from)
                if self.events is not None:  # tokens enter the tree here (and in insert_host)
                    self.events.stored(tokens[: n * P], pos * P)
                pos = n
                break
            m = self._common_pages(child, tokens, pos)
            if m < len(child.key) // P:
                child = self.split(child, m)
            if self.has_swa and child.swa is None and pos < live_from < pos + m:
                child = self.split(child, live_from - pos)
                m = live_from - pos
            self._merge(child, full[pos : pos + m], swa[pos : pos + m])
            node, pos = child, pos + m
        out_full: list[int] = []
        out_swa: list[int | None] = []
        path = []
        x: RadixNode | None = node
        depth = n
        while x is not None and depth > start_pos:
            path.append(x)
            depth -= len(x.key) // P
            x = x.parent
        for x in reversed(path):
            assert x.full is not None
            out_full.extend(x.full)
            out_swa.extend(x.swa if x.swa is not None else [None] * len(x.full))
        skip = start_pos - depth  # pages of the first path node before start_pos
        self.touch(node)
        return node, out_full[skip:], out_swa[skip:]

    def _new_leaves(
        self,
        parent: RadixNode,
        tokens: list[int],
        pos: int,
        n: int,
        full: list[int],
        swa: list[int | None],
        live_from: int,
    ) -> RadixNode:
        P = self.page_size
        cuts = [pos, n]
        if self.has_swa and pos < live_from < n:
            cuts = [pos, live_from, n]
        node = parent
        made = []
        for a, b in itertools.pairwise(cuts):
            leaf = RadixNode(tokens[a * P : b * P], node)
            leaf.stamp = next(self._clock)
            node.children[tuple(leaf.key[:P])] = leaf
            leaf.full = full[a:b]
            self.dev_lru[leaf] = None
            if self.has_swa and a >= live_from:
                leaf.swa = [p for p in swa[a:b] if p is not None]
            node = leaf
            made.append(leaf)
        self.requeue(parent, *made)
        return node

    def _merge(self, node: RadixNode, full: list[int], swa: list[int | None]) -> None:
        """Reconcile a request's pages with an existing node covering the same tokens."""
        if node.full is None:  # host-only node: the request's device pages become its device copy
            node.full = list(full)
            self.dev_lru[node] = None
            self.requeue(node.parent)
        else:
            dups = [r for r, t in zip(full, node.full, strict=True) if r != t]
            self.full_pool.free(dups)
        if not self.has_swa:
            return
        assert self.swa_pool is not None
        if node.swa is None:
            if swa and all(p is not None for p in swa):  # revive the tombstone with the request's pages
                node.swa = [p for p in swa if p is not None]
                self.requeue(node, node.parent)
            # else: the request freed this SWA KV too; the node stays a tombstone
        else:
            dups2 = [r for r, t in zip(swa, node.swa, strict=True) if r is not None and r != t]
            self.swa_pool.free(dups2)

    # -- introspection ----------------------------------------------------------------------------
    def nodes(self) -> list[RadixNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out
