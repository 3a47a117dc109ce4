"""The engine's L3 tier (GCache): prefix hits extended from L3 into host pages, and host-tier
evictions written back.

Read path, per admitted-to-be request (``begin`` -> ``poll`` between steps; the request waits
outside the scheduler while other requests run):
1. the prompt's page keys (``gcache.keys``); the tree's cached path ends at page ``d``;
2. ``lookup`` of full pages ``d ..`` and their SWA pages; the best stop point ``p`` has every full
   page ``d .. p`` and the SWA window ``p - W/P .. p`` (``p - W/P >= d``, so the new node holds
   its own window), and extends the hit by at least ``min_tokens``;
3. host pages for them are reserved first (``PrefixCache.reserve_host``: a hit is never clipped
   by staging room after the fetch; no room: no fetch, counted);
4. ``get``; every object is verified against the reader's own chain (``codec.verify``); all
   pages good: scattered into the host pages and inserted as one host-resident node
   (``insert_host``); the scheduler's usual host hit then loads it to device. Anything else
   (missing, corrupt, error, deadline, the tree changed) frees the pages and the prompt is
   computed: the hit is what arrived and verified, never what the lookup promised.
Write path: the prefix cache calls ``sink`` before it frees a node's host copies; the node's full
pages, with its ancestors' not yet known to be stored (parents first), and the SWA window at its
end are copied out and put asynchronously (a full backlog drops puts: it is a cache).

Design, sources and the bugs this avoids (SGLang HiCache #31108, #40193): docs/DESIGN.md#gcache"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from swaserve.config import FULL, SWA, EngineConfig, ModelConfig
from swaserve.engine.l3_io import L3IO
from swaserve.engine.l3_pages import KNOWN_KEYS, ChainKeys, best_stop, router_blocks, writeback
from swaserve.engine.request import Request
from swaserve.gcache import codec
from swaserve.gcache.codec import FULL_KIND, SWA_KIND
from swaserve.gcache.keys import Salt, page_keys
from swaserve.gcache.l3 import Found, PutPage, Throttle, placements
from swaserve.kvcache.prefix_cache import PrefixCache
from swaserve.kvcache.radix import RadixNode
from swaserve.kvcache.storage import PagedKV
from swaserve.kvformat import format_label
from swaserve.model.identity import config_digest, weights_digest

log = logging.getLogger("swaserve.l3")
KINDS = {FULL: FULL_KIND, SWA: SWA_KIND}


class PageBytes:
    """Page payloads <-> paged KV tensors: per layer of a kind, K ``[page, H, Dk]`` then V, as
    stored (a quantized kind's packed rows byte for byte)."""

    def __init__(self, store: PagedKV) -> None:
        P = store.page_size
        self.layout = {
            kind: [(k.shape[2:], k.dtype, v.shape[2:], v.dtype) for k, v in zip(ks, vs, strict=True)]
            for kind, (ks, vs) in store.kv.items()
        }
        self.nbytes = {
            kind: sum(P * (ks.numel() * kd.itemsize + vs.numel() * vd.itemsize) for ks, kd, vs, vd in shapes)
            for kind, shapes in self.layout.items()
        }
        self.formats = {kind: f.describe() for kind, f in store.formats.items()}

    def describe(self) -> dict[str, list[list[int]]]:
        """The payload geometry (part of the salt)."""
        return {kind: [[*k, *v] for k, _, v, _ in shapes] for kind, shapes in self.layout.items()}

    def gather(self, store: PagedKV, kind: str, pages: list[int]) -> list[bytes]:
        if not pages:
            return []
        ks, vs = store.kv[kind]
        rows = {g: store.page_rows(kind, g, pages) for g in set(store.groups[kind])}
        cols = []
        for j in range(len(ks)):
            r = rows[store.groups[kind][j]]
            for t in (ks[j], vs[j]):
                cols.append(t[r].to("cpu").reshape(len(pages), -1).contiguous().view(torch.uint8))
        mat = torch.cat(cols, dim=1)
        return [mat[i].numpy().tobytes() for i in range(len(pages))]

    def scatter(self, store: PagedKV, kind: str, pages: list[int], payloads: list[memoryview]) -> None:
        n = len(pages)
        if not n:
            return
        buf = bytearray(b"".join(payloads))
        mat = torch.frombuffer(buf, dtype=torch.uint8).view(n, self.nbytes[kind])
        ks, vs = store.kv[kind]
        rows = {g: store.page_rows(kind, g, pages) for g in set(store.groups[kind])}
        off, P = 0, store.page_size
        for j, (kshape, kdt, vshape, vdt) in enumerate(self.layout[kind]):
            r = rows[store.groups[kind][j]]
            for t, shape, dt in ((ks[j], kshape, kdt), (vs[j], vshape, vdt)):
                nb = P * shape.numel() * dt.itemsize
                part = mat[:, off : off + nb].contiguous().view(dt).view(n, P, *shape)
                t[r] = part.to(t.device)
                off += nb


@dataclass
class _Fetch:
    req: Request
    tokens: list[int]  # the prompt's first ``len(keys)`` pages
    keys: list[bytes]
    d: int
    deadline: float
    future: concurrent.futures.Future
    stage: str = "lookup"
    p: int = 0
    full: list[int] = field(default_factory=list)  # reserved host pages
    swa: list[int] = field(default_factory=list)
    pids: list[tuple[bytes, int]] = field(default_factory=list)


class L3Tier:
    """Args: cache: the prefix cache (with a host tier). host: the host tier's tensors. device: the
    device pools' tensors. seed: the salt seed (``gcache.keys.Salt.seed``). io: the I/O thread.
    min_tokens: the least extension worth a fetch (raised to the window). timeout_s,
    per_ki_token_s: a fetch's deadline, base + per 1024 tokens fetched (SGLang's prefetch
    timeout). clock: seconds. max_backlog: put bytes in flight before new puts are dropped."""

    def __init__(
        self,
        cache: PrefixCache,
        host: PagedKV,
        device: PagedKV,
        seed: bytes,
        io: L3IO,
        min_tokens: int = 256,
        timeout_s: float = 2.0,
        per_ki_token_s: float = 0.1,
        clock: Callable[[], float] | None = None,
        max_backlog: int = 256 << 20,
    ) -> None:
        wp = cache.tree.window_pages()
        if cache.host_full is None or cache.host_swa is None or wp is None:
            raise ValueError("L3 needs the hybrid layout, SWA layers and a host tier (--host-cache-memory)")
        self.cache, self.host, self.device, self.seed, self.io = cache, host, device, seed, io
        self.P, self.wp = cache.page_size, wp
        self.min_pages = max(wp, -(-min_tokens // self.P))
        self.timeout_s, self.per_ki = timeout_s, per_ki_token_s
        import time

        self.clock = clock or time.monotonic
        self.bytes = PageBytes(host)
        self.fetches: dict[str, _Fetch] = {}
        self.puts: list[tuple[concurrent.futures.Future, list[bytes], int]] = []
        self.backlog, self.max_backlog = 0, max_backlog
        self.close = io.close
        self.known: OrderedDict[bytes, None] = OrderedDict()
        self.chain = ChainKeys(self.P, self.seed)
        self.stats: Counter[str] = Counter()
        self._throttle = Throttle(clock=self.clock)
        cache.l3_sink = self.sink

    # -- read path --------------------------------------------------------------------------------
    def begin(self, req: Request) -> bool:
        """Start an L3 lookup for ``req`` if its prompt could gain ``min_tokens``; True: it waits
        for ``poll``."""
        P = self.P
        tokens = req.prompt_token_ids
        maxp = (len(tokens) - 1) // P  # the prompt's last token is always computed
        d = len(self.cache.tree.walk(tokens, maxp))
        if maxp - d < self.min_pages:
            return False
        keys = page_keys(tokens[: maxp * P], P, self.seed)
        pids = [(keys[i], k) for k in (FULL_KIND, SWA_KIND) for i in range(d, maxp)]
        places = placements(keys, 0)
        pl = [places[i] for _ in range(2) for i in range(d, maxp)]
        self.stats["lookups"] += 1
        fut = self.io.run(self.io.store.lookup, pids, pl)
        ttl = self.timeout_s + self.per_ki * (maxp - d) * P / 1024
        self.fetches[req.request_id] = _Fetch(req, tokens[: maxp * P], keys, d, self.clock() + ttl, fut)
        return True

    def pending(self) -> bool:
        return bool(self.fetches)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a fetch to move on (the step loop has nothing else to do)."""
        futs = [f.future for f in self.fetches.values()]
        if futs:
            concurrent.futures.wait(futs, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def cancel(self, request_id: str) -> bool:
        """Drop ``request_id``'s fetch (aborted); True if it had one."""
        f = self.fetches.pop(request_id, None)
        if f is None:
            return False
        self._abandon(f, "aborted", count=False)
        return True

    def poll(self) -> list[Request]:
        """Advance fetches; returns the requests whose fetch ended (hit or not), to schedule."""
        done: list[Request] = []
        now = self.clock()
        for rid, f in list(self.fetches.items()):
            if not f.future.done():
                if now >= f.deadline:
                    self._abandon(f, "deadline")
                    done.append(self.fetches.pop(rid).req)
                continue
            try:
                result = f.future.result()
            except Exception as e:  # L3Error or a transport's own: a miss
                self._warn(f"L3 {f.stage} failed: {e}")
                self._abandon(f, "error")
                done.append(self.fetches.pop(rid).req)
                continue
            if f.stage == "lookup" and self._plan(f, result):
                continue  # the get is in flight
            if f.stage == "get":
                self._land(f, result)
            done.append(self.fetches.pop(rid).req)
        self._reap_puts()
        return done

    def counters(self) -> dict[str, int]:
        """``stats`` and, from a store over several nodes, its failed node operations
        (``node_errors_<op>``: such a store answers "absent" for a failed node)."""
        out = dict(self.stats)
        for op, n in dict(getattr(self.io.store, "node_errors", {})).items():
            out[f"node_errors_{op}"] = n
        return out

    def _warn(self, what: str) -> None:
        """Log an L3 failure (each costs only its hit): the first, then at most one a minute."""
        held = self._throttle()
        if held is not None:
            log.warning("%s (%d more failures since the last warning; swaserve:l3_fetches_lost_total)",
                        what, held)  # fmt: skip

    def _plan(self, f: _Fetch, found: Found) -> bool:
        best = best_stop(found.present, f.d, self.wp, self.min_pages)
        if not best:
            self.stats["lookup_misses"] += 1
            self.io.run(self.io.store.get, found, [])  # ends the lease
            return False
        f.p = best
        got = self.cache.reserve_host(f.tokens, f.d, best - f.d, self.wp)
        if got is None:
            self.stats["unfulfilled_staging_full"] += (best - f.d) * self.P
            self.io.run(self.io.store.get, found, [])
            return False
        f.full, f.swa = got
        f.pids = [(f.keys[i], FULL_KIND) for i in range(f.d, best)]
        f.pids += [(f.keys[i], SWA_KIND) for i in range(best - self.wp, best)]
        places = placements(f.keys, 0)
        pl = [places[i] for i in range(f.d, best)] + [places[i] for i in range(best - self.wp, best)]
        f.stage = "get"
        f.future = self.io.run(self.io.store.get, found, f.pids, pl)
        return True

    def _land(self, f: _Fetch, objs: list) -> None:
        P, bad = self.P, []
        full_pl: list[memoryview] = []
        swa_pl: list[memoryview] = []
        n = f.p - f.d
        for j, ((key, kind), obj) in enumerate(zip(f.pids, objs, strict=True)):
            i = f.d + j if j < n else f.p - self.wp + (j - n)
            if obj is None:
                bad.append(("missing", key, kind))
                continue
            try:
                body = codec.verify(
                    obj, kind=kind, salt=self.seed, key=key, parent=f.keys[i - 1] if i else self.seed,
                    tokens=f.tokens[i * P : (i + 1) * P], index=i, payload_len=self.bytes.nbytes[FULL if kind == FULL_KIND else SWA],
                )  # fmt: skip
            except codec.CorruptPage as e:
                bad.append(("corrupt", key, kind))
                log.warning("L3 page %s refused: %s", key.hex(), e)
                continue
            (full_pl if kind == FULL_KIND else swa_pl).append(body)
        if bad:
            corrupt = [(k, kd) for why, k, kd in bad if why == "corrupt"]
            if corrupt:
                self.stats["corrupt_pages"] += len(corrupt)
                self.io.run(self.io.store.remove, corrupt, None)
            self._abandon(f, bad[0][0])
            return
        self.bytes.scatter(self.host, FULL, f.full, full_pl)
        self.bytes.scatter(self.host, SWA, f.swa, swa_pl)
        x = self.cache.insert_host(f.tokens, f.d, f.full, [None] * (n - self.wp) + list(f.swa))
        if x is None:
            self._abandon(f, "raced")
            return
        for k in f.keys[: f.p]:
            self._know(k)
        f.req.l3_tokens = n * P
        self.stats["fetched_tokens"] += n * P
        self.stats["fetched_pages"] += n + self.wp

    def _abandon(self, f: _Fetch, why: str, count: bool = True) -> None:
        if f.full or f.swa:
            self.cache.free_host(f.full, f.swa)
            f.full, f.swa = [], []
        if f.stage == "lookup":  # its leases end once granted (now, if they are), unread
            f.future.add_done_callback(self._release_late)
        if count:
            self.stats[f"lost_{why}"] += 1

    def _release_late(self, fut: concurrent.futures.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.io.run(self.io.store.get, fut.result(), [])

    # -- write path -------------------------------------------------------------------------------
    def sink(self, y: RadixNode, swa_only: bool) -> None:
        """``PrefixCache.l3_sink``: copy out ``y``'s pages (module docstring) and put them."""
        if self.backlog >= self.max_backlog:
            self.stats["puts_dropped"] += 1
            return
        self.cache.mover.sync()  # host copies still in flight (CUDA)
        tokens, keys, picked = writeback(y, swa_only, self.wp, self.chain, self.known)
        stores = {"host": self.host, "device": self.device}
        items = [(kind, i, stores[tier], page) for kind, i, tier, page in picked]
        if not items:
            return
        pages = self._encode(items, tokens, keys)
        nbytes = sum(len(p.obj) for p in pages)
        self.backlog += nbytes
        self.stats["put_pages"] += len(pages)
        fut = self.io.run(self.io.store.put, pages)
        self.puts.append((fut, [p.pid[0] for p in pages if p.pid[1] == FULL_KIND], nbytes))

    def _encode(
        self, items: list[tuple[str, int, PagedKV, int]], tokens: list[int], keys: list[bytes]
    ) -> list[PutPage]:
        P = self.P
        payload: dict[tuple[str, int], bytes] = {}
        groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for kind, i, st, page in items:
            groups.setdefault((kind, id(st)), []).append((i, page))
        stores = {id(self.host): self.host, id(self.device): self.device}
        for (kind, sid), lst in groups.items():
            blobs = self.bytes.gather(stores[sid], kind, [pg for _, pg in lst])
            for (i, _), b in zip(lst, blobs, strict=True):
                payload[(kind, i)] = b
        places = placements(keys, 0)
        blocks = router_blocks(tokens, self.P, self.cache.events)
        out = []
        for kind, i, _, _ in items:
            k = KINDS[kind]
            parent = keys[i - 1] if i else self.seed
            obj = codec.encode(
                k, i, self.seed, keys[i], parent, tokens[i * P : (i + 1) * P], payload[(kind, i)]
            )
            block = blocks.get(i) if kind == FULL else None
            out.append(PutPage((keys[i], k), parent, i, obj, places[i], block=block))
        return out

    def _reap_puts(self) -> None:
        keep = []
        for fut, keys, nbytes in self.puts:
            if not fut.done():
                keep.append((fut, keys, nbytes))
                continue
            self.backlog -= nbytes
            try:
                oks = fut.result()
            except Exception as e:
                self._warn(f"L3 put failed: {e}")
                self.stats["put_errors"] += 1
                continue
            for k, ok in zip(keys, oks, strict=False):
                if ok:
                    self._know(k)
        self.puts = keep

    def _know(self, key: bytes) -> None:
        self.known[key] = None
        self.known.move_to_end(key)
        while len(self.known) > KNOWN_KEYS:
            self.known.popitem(last=False)

    def flush_puts(self, timeout: float = 30.0) -> None:
        """Wait for the puts in flight (tests, shutdown)."""
        concurrent.futures.wait([f for f, _, _ in self.puts], timeout=timeout)
        self._reap_puts()


def build_l3(
    config: EngineConfig, model_dir: str | Path, model_config: ModelConfig, cache: PrefixCache | None,
    host: PagedKV | None, device: PagedKV, clock: Callable[[], float],
) -> L3Tier | None:  # fmt: skip
    """The engine's L3 tier for ``config.l3_url`` (None without one). Raises ValueError when L3
    cannot work with this configuration, or for a bad URL."""
    if not config.l3_url:
        return None
    if cache is None or host is None or config.kv_layout != "hybrid":
        raise ValueError(
            "an L3 cache needs prefix caching, a host tier (--host-cache-memory) and the hybrid layout"
        )
    weights = config.weights_id or weights_digest(model_dir)
    pb = PageBytes(host)
    # the KV identity: the model dtype and each pool's page format (an FP8 page never serves bf16)
    formats = host.formats
    kv_dtype = (
        config.dtype
        if not any(f.quantized for f in formats.values())
        else format_label(config.dtype, formats)
    )
    salt = Salt(config_digest(model_config), weights, kv_dtype, config.page_size, pb.describe())
    io = L3IO(config.l3_url)
    return L3Tier(
        cache, host, device, salt.seed(), io, config.l3_min_tokens, config.l3_timeout_s,
        config.l3_timeout_per_ki_token_s, clock,
    )  # fmt: skip
