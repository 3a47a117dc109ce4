"""``AdaptiveSplit``: how much of one shared byte budget the prefix cache gives to SWA windows and how
much to full-attention pages, moved by the traffic with ghost entries.

Rule. The cache first trims nodes to their trailing window (SWA KV before it serves only hits
ending inside a node, which prefills avoid: they stop at divergence points and chunk ends), then
evicts from the side over its target: while the SWA pages in use take more than ``target`` bytes,
windows of inner nodes (tombstones, ``PrefixCache`` stages); otherwise whole least-recently-used
leaves (full pages and their window). Each side remembers what it lost recently, for ``horizon`` x the budget of its own
evictions (the ghosts):

* an SWA ghost is a window tombstoned with no copy in any tier (``RadixNode.ghost``: the SWA-loss
  clock, in bytes, when it was lost);
* a full ghost is a page deleted from the tree (a chain hash of its prefix, with the full-loss clock).

At every admission ``observe`` replays the lookup as if the ghosts were still cached: ``gain_swa``
pages the hit would grow by with the recently lost windows alive, ``gain_full`` pages it would grow
by past the tree's end with the recently deleted pages. Each gain is taken per unit of what keeping
it costs, in full pages' bytes: a window costs ``u = window_pages * swa_page_bytes /
full_page_bytes`` units (48 on MiMo-V2.5-Pro at W = 128, page 16), the full pages ``g`` plus the
window a hit needs at their end ``g + u``. The vote ``v = gain_swa / u - gain_full / (gain_full +
u)``, clamped to ``[-1, max_vote]``, moves the target by ``step * total * v``, within ``[0,
total]``. The full term is at most 1 (each page of hit costs a unit); the SWA term is not (one
window can serve hundreds of pages of hit), and keeping that magnitude is what holds the split
above the cliff below when the traffic needs windows. Capacity flows toward the
side whose recent losses cost more hits per byte: the marginal-utility rule of UCP (Qureshi & Patt,
MICRO 2006) with ARC's ghost lists and target adaptation (Megiddo & Modha, FAST 2003), in bytes
because a SWA page and a full page differ in size.

Parameters and defaults (measured with ``swaserve bench prefix-cache``, MiMo-V2.5-Pro shape):

* ``initial_swa_share`` 0.55: the SWA byte share of a fixed 0.2 SWA pages per full page, the best
  fixed ratio at mid budgets; also above the cliff of small budgets (conversation trace, first
  1,500 requests, budget 0.05 of the footprint, split held fixed: SWA share 0.3 -> 0.059 hit rate,
  0.6 -> 0.098, 1.0 -> 0.098), so the start is safe before any ghost is seen;
* ``horizon`` 1.0: ghosts cover as many bytes of losses as the budget holds (ARC's ghost lists
  are as large as the cache), so "would have hit with twice the room on this side" is measured
  at the same scale on both sides;
* ``step`` 0.01 and ``max_vote`` 1.5: a lookup whose lost pages would have hit moves the target
  by at most 1% of the budget toward full pages and 1.5% toward windows; a hundred full votes
  cross the range, so it follows a traffic shift within a few hundred requests
  (tests/kvcache/test_adaptive_split.py). The cap above 1 keeps some of the SWA term's weight (one
  window can serve hundreds of pages of hit); since superseded chunk-end windows are demoted
  (``RadixTree.demote_checkpoints``) windows are cheap to keep and a higher cap overshoots. Whole
  traces, with demotion: conversation at budget 0.05 of the footprint, cap 5 -> 0.342 hit rate
  (SWA byte share 0.50), 3 -> 0.343 (0.48), 1.5 -> 0.349 (0.45), best fixed ratio (1/9) 0.349;
  at 0.02 cap 1.5 -> 0.270; agent sessions at 0.1, cap 1.5 -> 0.895, 5 -> 0.894 (best fixed
  0.799). Before demotion, a [-1, 1] clamp with moves toward full 10x slower held the agent
  trace at 0.66 (best fixed 0.72) and a cap of 5 reached 0.88.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from swaserve.kvcache.radix import PathPage, RadixNode

NO_GHOST = -1


def chain_hashes(tokens: Sequence[int], page_size: int, n: int, seed: int = 0, first: int = 0) -> list[int]:
    """Chain hash of pages ``first .. n-1`` of ``tokens`` (page i's covers pages 0..i; ``seed``: the
    chain hash of page ``first - 1``, 0 before page 0)."""
    out, h = [], seed
    for i in range(first, n):
        h = hash((h, tuple(tokens[i * page_size : (i + 1) * page_size])))
        out.append(h)
    return out


def node_end_hash(x: RadixNode, page_size: int) -> int:
    """Chain hash at the end of ``x``'s path (memoized on the nodes: a node's end never moves)."""
    todo = []
    y: RadixNode | None = x
    while y is not None and y.h_end is None:
        if y.parent is None:  # the root
            y.h_end = 0
            break
        todo.append(y)
        y = y.parent
    h = y.h_end if y is not None and y.h_end is not None else 0
    for z in reversed(todo):
        n = len(z.key) // page_size
        h = chain_hashes(z.key, page_size, n, h)[-1]
        z.h_end = h
    return h


def node_page_hashes(x: RadixNode, page_size: int) -> list[int]:
    """Chain hash of each page of ``x``."""
    seed = node_end_hash(x.parent, page_size) if x.parent is not None else 0
    return chain_hashes(x.key, page_size, len(x.key) // page_size, seed)


class AdaptiveSplit:
    """Target bytes of SWA pages in one shared budget, moved by ghost hits (module doc).

    Args:
        total: the budget, bytes.
        full_page_bytes, swa_page_bytes: bytes of one page of each kind.
        page_size: tokens per page. window_pages: pages a window spans (``ceil(W / P)``).
        initial_swa_share, horizon, step, max_vote: see the module doc.
    """

    def __init__(
        self,
        total: int,
        full_page_bytes: int,
        swa_page_bytes: int,
        page_size: int,
        window_pages: int,
        initial_swa_share: float = 0.55,
        horizon: float = 1.0,
        step: float = 0.01,
        max_vote: float = 1.5,
    ) -> None:
        if not 0.0 <= initial_swa_share <= 1.0 or horizon <= 0 or step < 0 or max_vote < 0:
            raise ValueError("initial_swa_share in [0, 1], horizon > 0, step >= 0, max_vote >= 0 required")
        self.total = total
        self.full_page_bytes, self.swa_page_bytes = full_page_bytes, swa_page_bytes
        self.page_size, self.window_pages = page_size, window_pages
        self.target = initial_swa_share * total
        self.horizon = horizon * total
        self.step, self.max_vote = step, max_vote
        self.swa_clock = 0  # bytes of SWA KV lost so far (tombstoned with no copy anywhere)
        self.full_clock = 0  # bytes lost by deleting nodes from the tree
        self.ghosts: OrderedDict[int, int] = OrderedDict()  # page chain hash -> full_clock at loss
        self.gains = [0, 0]  # pages of ghost hits seen: [swa, full]

    def swa_first(self, swa_used_bytes: int) -> bool:
        """Whether SWA-only victims go first: the SWA pages in use exceed the target."""
        return swa_used_bytes > self.target

    # -- losses ----------------------------------------------------------------------------------
    def lost_window(self, x: RadixNode, pages: int) -> None:
        """``x``'s SWA KV (``pages`` pages) left the last tier that held it."""
        x.ghost = self.swa_clock
        self.swa_clock += pages * self.swa_page_bytes

    def lost_pages(self, hashes: Sequence[int], nbytes: int, end_hit: bool = True) -> None:
        """Pages with these chain hashes (a node's, in order) left the tree; ``nbytes`` freed with
        them; ``end_hit``: its window was live, so a hit could end at its last page."""
        self.full_clock += nbytes
        last = len(hashes) - 1 if end_hit else -1
        for i, h in enumerate(hashes):
            # a value < 0 marks a page a hit can end at (the node's end: its window was live)
            self.ghosts[h] = -self.full_clock if i == last else self.full_clock
            self.ghosts.move_to_end(h)
        oldest = self.full_clock - self.horizon
        while self.ghosts:
            h, t = next(iter(self.ghosts.items()))
            if abs(t) >= oldest:
                break
            del self.ghosts[h]

    # -- lookups ---------------------------------------------------------------------------------
    def _recent_window(self, x: RadixNode) -> bool:
        return x.ghost != NO_GHOST and self.swa_clock - x.ghost <= self.horizon

    def swa_gain(self, pages: Sequence[PathPage], hit: int, use_host: bool) -> int:
        """Pages past ``hit`` a lookup over ``pages`` would reach if recently lost windows were live."""
        wp = self.window_pages
        best = run = 0
        for i, pg in enumerate(pages):
            if pg.full is None and not (use_host and pg.host_full is not None):
                break
            live = pg.swa is not None or (use_host and pg.host_swa is not None)
            run = run + 1 if live or self._recent_window(pg.node) else 0
            if run >= min(i + 1, wp):
                best = i + 1
        return max(0, best - hit)

    def full_gain(self, tokens: Sequence[int], pages: Sequence[PathPage], max_pages: int) -> int:
        """Pages past the walked path ``pages`` (where the tree ends for ``tokens``) found among
        recent full ghosts, in a row."""
        start = len(pages)
        if not self.ghosts or start >= max_pages:
            return 0
        P = self.page_size
        h = 0
        if pages:
            pg = pages[-1]
            h = node_page_hashes(pg.node, P)[pg.index]
        oldest = self.full_clock - self.horizon
        g = 0
        for i in range(start, max_pages):
            h = hash((h, tuple(tokens[i * P : (i + 1) * P])))
            t = self.ghosts.get(h)
            if t is None or abs(t) < oldest:
                break
            if t < 0:
                g = i + 1 - start  # a hit could have ended here
        return g

    def update(self, gain_swa: int, gain_full: int) -> None:
        """Move the target by the ghost gains (pages) of one lookup: each gain per full-page-sized
        unit of what would have had to be kept for it (one window; the ghost pages and a window)."""
        self.gains[0] += gain_swa
        self.gains[1] += gain_full
        if not (gain_swa or gain_full):
            return
        window = self.window_pages * self.swa_page_bytes / self.full_page_bytes
        v = gain_swa / window - gain_full / (gain_full + window)
        v = max(-1.0, min(self.max_vote, v))
        t = self.target + self.step * self.total * v
        self.target = min(float(self.total), max(0.0, t))
