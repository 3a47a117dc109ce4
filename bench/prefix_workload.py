"""The request streams of the prefix-cache benches (``bench.prefix_cache``, ``bench.kv_quant``): the
Mooncake conversation trace (hash ids -> token blocks) and the agent sessions, with their ideal hit
rate; and the pool plans they replay against (hybrid, fixed SWA ratio, full layout)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from swaserve.config import EngineConfig, ModelConfig
from swaserve.kvcache.plan import PoolPlan
from swaserve.kvcache.sizing import page_bytes, plan_pools
from swaserve.traces import TRACE_BLOCK_TOKENS, TokenBlocks, TraceError, detect_kind, read_mooncake

PAGE = 16
CHUNK = 512  # prefill chunk, tokens (EngineConfig.max_num_batched_tokens default)
DTYPE_BYTES = 2
ROOT = Path(__file__).resolve().parent.parent
CONVERSATION_TRACE = ROOT / "data" / "traces" / "conversation_trace.jsonl"
AGENT_TRACE = ROOT / "data" / "agentic" / "agent_sessions.jsonl.gz"
MOONCAKE_VOCAB = 256


class BenchInputError(ValueError):
    """The trace format is unknown or a budget cannot hold the pools."""


@dataclass
class Workload:
    """Prompts of a trace (``prompts()`` yields them afresh each call) and the infinite-cache ideal."""

    name: str
    kind: str  # "mooncake" | "agent"
    requests: int
    prompt_tokens: int
    unique_pages: int  # distinct page chains over all prompts (whole pages only)
    ideal_hits: int  # tokens an infinite cache serves
    prompts: Callable[[], Iterator[list[int]]] = field(repr=False)

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_hits / self.prompt_tokens if self.prompt_tokens else 0.0


def mooncake_workload(path: Path, limit: int | None, seed: int = 0) -> Workload:
    """Token prompts at 512 tokens per hash id. The ideal is computed from the ids: page ``j`` of a
    prompt is page ``j % 32`` of block ``hash_ids[j // 32]``, and a hash id names its block and all
    blocks before it, so a page chain is (hash id, page in block); ``tests`` check this against
    ``ideal_of`` on the tokens."""
    reqs = read_mooncake(path, limit)
    B = TRACE_BLOCK_TOKENS
    per_block = B // PAGE
    seen: dict[int, int] = {}  # hash id -> most whole pages of its block any prompt had
    total = ideal = 0
    for r in reqs:
        n = r.input_length
        total += n
        hit = 0
        while hit < (n - 1) // PAGE and seen.get(r.hash_ids[hit // per_block], 0) > hit % per_block:
            hit += 1
        ideal += hit * PAGE
        whole = n // PAGE
        for k, h in enumerate(r.hash_ids):
            pages = min(per_block, whole - k * per_block)
            if pages > seen.get(h, 0):
                seen[h] = pages

    def prompts() -> Iterator[list[int]]:
        for r in reqs:  # a TokenBlocks per request: its block cache must not grow with the trace
            yield TokenBlocks(B, MOONCAKE_VOCAB, seed=seed).prompt(r)

    return Workload(path.name, "mooncake", len(reqs), total, sum(seen.values()), ideal, prompts)


def ideal_of(prompts: Iterator[list[int]] | list[list[int]]) -> tuple[int, int]:
    """(ideal hit tokens, distinct page chains) of token prompts in order, by hashing page chains."""
    seen: set[int] = set()
    ideal = 0
    for p in prompts:
        h, hit, counting = 0, 0, True
        for i in range(len(p) // PAGE):
            h = hash((h, tuple(p[i * PAGE : (i + 1) * PAGE])))
            if counting and i < (len(p) - 1) // PAGE and h in seen:
                hit += 1
            else:
                counting = False
            seen.add(h)
        ideal += hit * PAGE
    return ideal, len(seen)


def agent_workload(path: Path, limit: int | None) -> Workload:
    """Real prompt token ids of the agent sessions (default model's tokenizer)."""
    from transformers import AutoTokenizer

    from swaserve.agentic import read_agent_sessions, tokenize_calls
    from swaserve.model.checkpoint import tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir("default")))
    ids = tokenize_calls(read_agent_sessions(path, limit), tok)
    ideal, unique = ideal_of(ids)
    total = sum(len(p) for p in ids)
    return Workload(path.name, "agent", len(ids), total, unique, ideal, lambda: iter(ids))


def load_workload(path: Path, limit: int | None = None) -> Workload:
    try:
        kind = detect_kind(path)
    except TraceError as e:
        raise BenchInputError(str(e)) from e
    return mooncake_workload(path, limit) if kind == "mooncake" else agent_workload(path, limit)


# -- pool plans --------------------------------------------------------------------------------------
def footprint_bytes(cfg: ModelConfig, unique_pages: int) -> int:
    """Bytes the trace's distinct pages take in the full layout (both pools)."""
    pbf, pbs = page_bytes(cfg, PAGE, DTYPE_BYTES)
    return unique_pages * (pbf + pbs)


def hybrid_plan(
    cfg: ModelConfig, budget: int, chunk: int = CHUNK, swa_ratio: float | None = None
) -> PoolPlan:
    """The split of ``budget`` bytes with prefix caching (``plan_pools``) for one running request at a
    time: one shared budget split by the traffic (``swa_ratio`` None, the default), or a fixed
    ``swa_ratio`` SWA pages per full page (``--swa-full-tokens-ratio``).

    Raises:
        BenchInputError: the budget cannot hold one page of each pool.
    """
    ecfg = EngineConfig(
        page_size=PAGE,
        kv_cache_memory=budget,
        max_num_seqs=1,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=True,
        swa_full_tokens_ratio=swa_ratio,
    )
    try:
        return plan_pools(cfg, ecfg, DTYPE_BYTES, shared=True)
    except ValueError as e:
        raise BenchInputError(str(e)) from e


def full_plan(cfg: ModelConfig, budget: int) -> PoolPlan:
    """The SWA-unaware layout: equal page counts (``plan_pools`` with ``kv_layout="full"``).

    Raises:
        BenchInputError: the budget cannot hold one page of each pool.
    """
    ecfg = EngineConfig(page_size=PAGE, kv_cache_memory=budget, kv_layout="full")
    try:
        return plan_pools(cfg, ecfg, DTYPE_BYTES)
    except ValueError as e:
        raise BenchInputError(str(e)) from e
