"""A model-free driver of pools + prefix cache + host tier with real KV tensors.

Each computed position writes a *label* into its KV slots, in both pools: the id of the token prefix
ending there (``tokens[:pos + 1]``). A request may only read slots whose label equals the id of its
own prefix at that position, so any pseudo-hit, recycled slot or stale host copy shows up as a label
mismatch. Copies between tiers go through the real ``HostKVStorage``.

Also the random request streams of the property tests (``run_stream``), and the blocks a radix tree
holds (``tree_blocks``, ``cached_blocks``): the truth the index-event tests compare an index with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from swaserve.config import FULL, SWA, AttnShape, ModelConfig
from swaserve.kvcache import invariants
from swaserve.kvcache.block_events import path_tokens
from swaserve.kvcache.hashing import block_hashes
from swaserve.kvcache.host import HostKVStorage
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.plan import PoolPlan
from swaserve.kvcache.radix import RadixTree
from swaserve.kvcache.storage import KVStorage


def tiny_config(window: int) -> ModelConfig:
    shape = AttnShape(1, 1, 1, 1, 1e4, 0, False)
    return ModelConfig(
        vocab_size=64,
        hidden_size=8,
        num_layers=2,
        layer_types=(FULL, SWA),
        mlp_types=("dense", "dense"),
        full=shape,
        swa=shape,
        sliding_window=window + 1,
        intermediate_size=8,
        moe_intermediate_size=8,
        n_routed_experts=1,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rms_norm_eps=1e-6,
        value_scale=1.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


@dataclass
class Live:
    rid: str
    tokens: list[int]  # prompt + outputs so far
    prompt_len: int
    max_out: int
    computed: int = 0
    hit: int = 0
    outputs: list[int] = field(default_factory=list)


class PrefixHarness:
    """Pools of ``full_pages`` / ``swa_pages`` pages (``host``: (full, swa) host pages or None).
    ``shared``: one byte budget of that many pages' bytes both pools draw from (SWA pages 3x the
    bytes of full pages), split by ``kvcache.adaptive``; the host pools share theirs likewise."""

    def __init__(
        self,
        page: int,
        window: int,
        full_pages: int,
        swa_pages: int,
        layout: str = "hybrid",
        host: tuple[int, int] | None = None,
        policy: str = "on_evict",
        shared: bool = False,
    ) -> None:
        self.page, self.window, self.layout = page, window, layout
        cfg = tiny_config(window)
        plan = PoolPlan(full_pages, swa_pages, 8 * page, 8 * page)
        host_bytes = None
        if shared:
            pbf, pbs = 8 * page, 24 * page
            total = full_pages * pbf + swa_pages * pbs
            plan = PoolPlan(total // pbf, total // pbs, pbf, pbs, shared_bytes=total)
            if host:
                host_bytes = host[0] * pbf + host[1] * pbs
                host = (host_bytes // pbf, host_bytes // pbs)
        self.storage = KVStorage(cfg, plan, page, torch.float32, "cpu")
        self.host = HostKVStorage(self.storage, {FULL: host[0], SWA: host[1]}, page) if host else None
        self.kv = KVCacheManager(
            plan, page, window, layout, 1, 1, prefix_caching=True, host_pages=host, mover=self.host,
            write_policy=policy, host_bytes=host_bytes,  # type: ignore[arg-type]
        )  # fmt: skip
        self.ids: dict[tuple[int, ...], int] = {}
        self.live: dict[str, Live] = {}
        self.hits = 0
        self.host_hits = 0

    def label(self, tokens: list[int], pos: int) -> float:
        key = tuple(tokens[: pos + 1])
        return float(self.ids.setdefault(key, len(self.ids) + 1))

    def _slots(self, kind: str, rid: str, lo: int, end: int) -> torch.Tensor:
        mgr = self.kv.full if kind == FULL else self.kv.swa
        return mgr.slots(rid, lo, end)

    def verify_reads(self, r: Live, start: int) -> None:
        """Every KV slot a chunk starting at ``start`` reads holds this request's own prefix."""
        for kind in (FULL, SWA):
            window = None if kind == FULL or self.layout == "full" else self.window
            lo = 0 if window is None else max(0, start - window)
            if lo >= start:
                continue
            slots = self._slots(kind, r.rid, lo, start)
            got = self.storage.read(kind, 0, slots)[0][:, 0, 0].tolist()
            want = [self.label(r.tokens, p) for p in range(lo, start)]
            assert got == want, f"{kind} KV of {r.rid} [{lo}, {start}) holds another prefix (pseudo-hit)"

    def admit(self, rid: str, prompt: list[int], max_out: int) -> bool:
        adm = self.kv.admit(rid, len(prompt) + max_out, prompt)
        if adm is None:
            return False
        r = Live(rid, list(prompt), len(prompt), max_out)
        r.computed = r.hit = adm.hit_tokens
        assert r.hit % self.page == 0 and r.hit < len(prompt)
        self.hits += r.hit
        self.host_hits += adm.host_tokens
        self.verify_reads(r, r.hit)
        self.live[rid] = r
        return True

    def advance(self, rid: str, chunk: int, next_token: int, partial: bool = True) -> bool:
        """Compute the next chunk (prefill) or one decode token; ``partial``: insert the computed
        prefix into the cache as the engine does after a prefill chunk. Returns True when finished."""
        r = self.live[rid]
        start = r.computed
        want = min(chunk, len(r.tokens) - start)
        n = self.kv.max_chunk(rid, start, start + want)
        assert n > 0, "a one-token step must always fit (reservation)"
        assert self.kv.allocate(rid, start, start + n)
        self.verify_reads(r, start)
        for kind in (FULL, SWA):
            slots = self._slots(kind, rid, start, start + n)
            labels = torch.tensor([self.label(r.tokens, p) for p in range(start, start + n)])
            x = labels.view(-1, 1, 1)
            self.storage.write(kind, 0, slots, x, x)
        r.computed = start + n
        if r.computed < len(r.tokens):
            if partial:
                self.kv.cache_partial(rid, r.tokens[: r.computed])
            return False
        if len(r.outputs) == r.max_out:
            self.finish(rid)
            return True
        r.outputs.append(next_token)
        r.tokens.append(next_token)
        return False

    def finish(self, rid: str) -> list[int]:
        """Finish or abort: the computed tokens go to the cache. Returns prompt + outputs."""
        r = self.live.pop(rid)
        self.kv.free(rid, r.tokens[: r.computed])
        return r.tokens

    def check(self) -> None:
        invariants.check(self.kv)

    def drain_and_flush(self) -> None:
        for rid in list(self.live):
            self.finish(rid)
        self.check()
        self.kv.flush_cache()
        self.check()
        pools = [self.kv.full.pool, self.kv.swa.pool]
        if self.kv.cache is not None and self.kv.cache.host_full is not None:
            pools += [self.kv.cache.host_full, self.kv.cache.host_swa]  # type: ignore[list-item]
        for p in pools:
            assert p.num_free == p.num_pages and p.reserved == 0, "pages left after drain + flush"
            assert p.budget is None or (p.budget.used, p.budget.reserved) == (0, 0), "bytes left"
        assert not self.kv.cache or not self.kv.cache.tree.nodes()


# -- random request streams (tests/kvcache/test_prefix_cache_props.py) ------------------------------
def run_stream(cfg: dict, seed: int, n_ops: int) -> PrefixHarness:
    rng = random.Random(seed)
    page, window = cfg["page"], cfg["window"]
    swa_need = -(-window // page) + 2 + 8 // page + 2
    h = PrefixHarness(
        page,
        window,
        cfg["full_pages"],
        max(cfg["swa_pages"], swa_need),
        cfg["layout"],
        cfg["host"],
        cfg["policy"],
        cfg.get("shared", False),
    )
    stems = [[rng.randrange(1, 40) for _ in range(rng.randrange(1, 3 * page + 6))] for _ in range(4)]
    done: list[list[int]] = []
    n = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.3 or not h.live:
            if done and rng.random() < 0.5:  # next turn of an earlier conversation
                prompt = rng.choice(done) + [
                    rng.randrange(1, 40) for _ in range(rng.randrange(1, 2 * page + 3))
                ]
            else:  # shared stems, then a branch
                prompt = [t for s in rng.sample(stems, rng.randrange(1, 3)) for t in s]
                prompt += [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
            if len(prompt) > 6 * page + 3 * window + 20:
                prompt = prompt[-(6 * page + 3 * window + 20) :]
            n += 1
            h.admit(f"r{n}", prompt, rng.randrange(1, 6))
        elif op < 0.92:
            rid = rng.choice(list(h.live))
            r = h.live[rid]
            tokens = list(r.tokens)
            if h.advance(rid, rng.randrange(1, 3 * page + 4), rng.randrange(1, 40)):
                done.append(tokens)
        else:
            rid = rng.choice(list(h.live))
            done.append(h.finish(rid))  # abort mid-flight: computed pages still go to the cache
        h.check()
    h.drain_and_flush()
    return h


# -- truth from the tree ----------------------------------------------------------------------------
def tree_blocks(tree: RadixTree, B: int) -> set[int]:
    """Keys of every block whose whole prefix the tree holds (each owned by the node it ends in)."""
    out: set[int] = set()
    for x in tree.nodes():
        assert x.full is not None or x.host_full is not None, f"{x} holds no full KV"
        before = path_tokens(x.parent)
        path = before + x.key
        lo, hi = len(before) // B, len(path) // B
        out.update(block_hashes(path[: hi * B], B)[lo:])
    return out


def cached_blocks(tree: RadixTree, prompt: list[int], B: int) -> int:
    """Leading whole blocks of ``prompt`` whose full KV (device or host) the tree holds."""
    n = 0
    for pg in tree.walk(prompt, len(prompt) // tree.page_size):
        if pg.full is None and pg.host_full is None:
            break
        n += 1
    return n * tree.page_size // B
