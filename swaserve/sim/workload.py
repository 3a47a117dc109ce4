"""Simulator workloads: trace requests with arrival times, prompts, output lengths and the block
chains the router indexes (Mooncake: 512-token blocks; agent sessions: 64-token blocks, closed loop
per session). ``scale_for_load`` picks the ``time_scale`` that offers a prefill load of ``load``
relative to the work an infinite prefix cache would leave.

Design notes: docs/DESIGN.md#simworkloadpy"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from swaserve.kvcache.hashing import block_hashes, chain_ids
from swaserve.sched.cost import CostModel
from swaserve.traces import TRACE_BLOCK_TOKENS, TokenBlocks, detect_kind, read_mooncake

MOONCAKE_VOCAB = 256
AGENT_BLOCK_TOKENS = 64


class Planned(Protocol):
    """One request a replay sends (as ``swaserve.replay.PlannedRequest``); times in seconds."""

    index: int
    send_at_s: float
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class SimRequest:
    """One request. ``arrival`` in trace seconds (before scaling); ``prompt()`` builds the token
    ids on demand (a 12k-request trace would hold ~100M ints otherwise)."""

    rid: str
    arrival: float
    prompt_len: int
    output_len: int
    hashes: list[int]
    prompt: Callable[[], list[int]] = field(repr=False)
    after: str | None = None  # closed loop: sent only once this request (same session) is done


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    block_tokens: int  # tokens per router index block

    @property
    def span_s(self) -> float:
        return max(r.arrival for r in self.requests) - min(r.arrival for r in self.requests)


def mooncake(path: str | Path, limit: int | None = None, seed: int = 0) -> Workload:
    reqs = read_mooncake(Path(path), limit)
    blocks = TokenBlocks(TRACE_BLOCK_TOKENS, MOONCAKE_VOCAB, seed=seed, cache_blocks=1 << 15)  # ~130 MB
    out = []
    for i, r in enumerate(reqs):

        def make(r=r) -> list[int]:  # type: ignore[no-untyped-def]
            return blocks.prompt(r)

        whole = r.input_length // TRACE_BLOCK_TOKENS
        out.append(
            SimRequest(
                str(i),
                r.timestamp_ms / 1000,
                r.input_length,
                r.output_length,
                chain_ids(r.hash_ids[:whole]),
                make,
            )
        )
    return Workload(Path(path).name, out, TRACE_BLOCK_TOKENS)


def agent(path: str | Path, limit: int | None = None, copies: int = 1) -> Workload:
    """Agent sessions, closed loop per session. ``copies`` > 1 replays every session that many
    times as unrelated sessions (copy ``c`` adds ``c`` to every token id modulo the vocabulary:
    same lengths and reuse structure, no shared content), its arrivals shifted by ``c / copies``
    of the trace's span: the trace has too few sessions to load many instances closed loop."""
    from swaserve.agentic import estimate_output_tokens, read_agent_sessions, tokenize_calls
    from swaserve.hf_tokenizer import load_tokenizer
    from swaserve.model.checkpoint import tokenizer_dir

    calls = read_agent_sessions(path, limit)
    ids = tokenize_calls(calls, load_tokenizer(tokenizer_dir("default")))
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    vocab = max(max(p) for p in ids) + 1
    span = (calls[-1].timestamp_ms - calls[0].timestamp_ms) / 1000 if calls else 0.0
    out = []
    for k in range(copies):
        last: dict[str, str] = {}  # session -> its latest call's rid
        for i, (c, p0) in enumerate(zip(calls, ids, strict=True)):
            p = p0 if k == 0 else [(t + k) % vocab for t in p0]
            rid = f"{k}/{i}" if copies > 1 else str(i)
            after = last.get(c.session_id)
            last[c.session_id] = rid
            out.append(
                SimRequest(
                    rid,
                    c.timestamp_ms / 1000 + span * k / copies,
                    len(p),
                    estimate_output_tokens(c),
                    block_hashes(p, AGENT_BLOCK_TOKENS),
                    functools.partial(list, p),
                    after,
                )
            )
    out.sort(key=lambda r: r.arrival)
    return Workload(Path(path).name, out, AGENT_BLOCK_TOKENS)


def load(path: str | Path, limit: int | None = None, copies: int = 1) -> Workload:
    """Mooncake or agent sessions (``copies``: see ``agent``), by the first record's fields.

    Raises:
        TraceError: neither format, or a bad record. ValueError: ``copies`` > 1 for a Mooncake
            trace (its requests are not sessions that can be replayed as unrelated copies).
    """
    if detect_kind(Path(path)) == "mooncake":
        if copies != 1:
            raise ValueError("--copies applies to agent sessions only, not to a Mooncake trace")
        return mooncake(path, limit)
    return agent(path, limit, copies)


def leading_seen(chains: Iterable[Sequence[int]]) -> Iterator[int]:
    """Per key chain, in order: how many of its leading keys an earlier chain had (what one
    infinite cache shared by everyone would hit, in blocks)."""
    seen: set[int] = set()
    for keys in chains:
        k = 0
        while k < len(keys) and keys[k] in seen:
            k += 1
        yield k
        seen.update(keys)


def ideal_work_s(reqs: Sequence[SimRequest], block_tokens: int, cost: CostModel) -> float:
    """Prefill seconds if every block seen before were cached (block granularity)."""
    ordered = sorted(reqs, key=lambda r: r.arrival)
    total = 0.0
    for r, k in zip(ordered, leading_seen(r.hashes for r in ordered), strict=True):
        cached = min(k * block_tokens, r.prompt_len - 1)
        total += cost.prefill_s(r.prompt_len - cached, cached)
    return total


def scale_for_load(work: Workload, cost: CostModel, instances: int, load: float) -> float:
    """``time_scale`` giving an offered prefill load of ``load`` (docs/DESIGN.md#simworkloadpy).

    Raises:
        ValueError: ``load`` not in (0, 2] or the trace has no time span.
    """
    if not 0 < load <= 2:
        raise ValueError(f"load must be in (0, 2], got {load}")
    span = work.span_s
    if span <= 0:
        raise ValueError("the trace has no time span to scale")
    return ideal_work_s(work.requests, work.block_tokens, cost) / (load * instances * span)


def from_planned(planned: Sequence[Planned], block_tokens: int, name: str = "replay") -> Workload:
    """The exact requests a ``swaserve.replay`` run sends (prompts, send times already divided by
    its ``time_scale``, capped outputs), indexed in blocks of ``block_tokens`` as the real router
    hashes them (``--block-tokens``): for comparing the simulator with the real cluster."""
    out = [
        SimRequest(str(p.index), p.send_at_s, len(p.prompt_token_ids), p.max_tokens,
                   block_hashes(p.prompt_token_ids, block_tokens), functools.partial(list, p.prompt_token_ids))
        for p in planned
    ]  # fmt: skip
    return Workload(name, out, block_tokens)
