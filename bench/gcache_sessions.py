"""Part 2 of ``swaserve bench gcache``: hit rate and TTFT on returning sessions, in the simulator.

Workloads: the conversation trace (Mooncake, ``data/traces/conversation_trace.jsonl``, open loop) and
the agent sessions (``data/agentic/agent_sessions.jsonl.gz``, closed loop per session, replayed as
``copies`` unrelated copies to load the instances). Deployment ``mimo-v2-flash-h200`` (its cost
model, KV shape, page 64), 4 prefill and 2 decode instances, ``cache_aware`` routing. Each workload
runs three times on the same requests and the same ``time_scale`` (``scale_for_load`` at load 0.8,
computed once), so the TTFTs compare:

- ``without_l3``: a device and a host budget per prefill instance too small to keep a session's
  pages between its turns;
- ``with_l3``: the same plus a GCache tier of ``L3_BYTES`` shared by the prefill instances (host
  evictions are written back to it, a returning prompt fetches its prefix from it);
- ``ideal``: every instance's device cache large enough for the whole workload (no eviction), no
  host tier, no L3. The caches are still per instance: a prefix computed on one instance is
  computed again on another, which a shared L3 avoids, so ``with_l3`` may beat it.

``bound_hit_rate``: the hit rate of one infinite cache shared by all instances (every page-aligned
prefix seen before in the workload is a hit): an upper bound for every run.

Hit rates are cached / prompt tokens; TTFT in simulated seconds; ``wall_s`` real seconds."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swaserve.kvcache.hashing import block_hashes
from swaserve.sim.run import Deployment, deployment, simulate
from swaserve.sim.workload import Workload, leading_seen, load, scale_for_load

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION_TRACE = ROOT / "data/traces/conversation_trace.jsonl"
AGENT_TRACE = ROOT / "data/agentic/agent_sessions.jsonl.gz"
DEPLOYMENT = "mimo-v2-flash-h200"
PREFILL, DECODE, POLICY, LOAD = 4, 2, "cache_aware", 0.8
L3_BYTES = 5 * 10**12
MODES = ("without_l3", "with_l3", "ideal")
KEYS = ("hit_rate", "host_hit_rate", "l3_hit_rate", "ttft_p50", "ttft_p90", "prefill_utilization")


@dataclass(frozen=True)
class Setup:
    """One workload: ``limit`` requests (agent: calls, before copying; None: all), ``copies``
    (agent only), and the per-instance budgets of the without-L3 and with-L3 runs (bytes)."""

    name: str
    trace: Path
    limit: int | None
    copies: int
    device_bytes: int
    host_bytes: int


# budgets picked so a session does not survive between its turns (without_l3 well under ideal);
# the agent host tier still holds one fetched session prefix (an L3 fetch lands in the host tier)
SETUPS = (
    Setup("conversation", CONVERSATION_TRACE, 1000, 1, 10 * 10**9, 5 * 10**9),
    Setup("agent", AGENT_TRACE, None, 2, 5 * 10**8, 5 * 10**8),
)


def bound_hit_rate(work: Workload, page_size: int) -> tuple[float, int]:
    """(hit rate of one infinite shared cache at page granularity, distinct tokens): per request in
    arrival order, its longest run of leading pages seen in any earlier prompt, at most the prompt
    less one token (as the engine); the distinct tokens are what a cache must hold for no miss."""
    ordered = sorted(work.requests, key=lambda r: r.arrival)
    hit = total = 0
    for r, k in zip(ordered, leading_seen(block_hashes(r.prompt(), page_size) for r in ordered), strict=True):
        hit += min(k * page_size, (r.prompt_len - 1) // page_size * page_size)
        total += r.prompt_len
    return hit / max(total, 1), total - hit


def run_setup(setup: Setup, dep: Deployment | None = None) -> dict[str, Any]:
    """The three runs of one workload: ``{"workload", "requests", "time_scale", "bound_hit_rate",
    "ideal_device_bytes", "runs": [row per mode], ratios}``."""
    dep = dep or deployment(DEPLOYMENT)
    t0 = time.perf_counter()
    work = load(setup.trace, setup.limit, setup.copies)
    scale = scale_for_load(work, dep.cost, PREFILL, LOAD)
    bound, distinct = bound_hit_rate(work, dep.page_size)
    # the ideal's device budget holds every distinct token's full-layer KV with room to spare
    footprint = distinct * dep.cost.kv_full_bytes_per_token
    ideal_device = max(dep.device_bytes, 2 * footprint)
    budgets = {
        "without_l3": (setup.device_bytes, setup.host_bytes, 0),
        "with_l3": (setup.device_bytes, setup.host_bytes, L3_BYTES),
        "ideal": (ideal_device, 0, 0),
    }
    runs: list[dict[str, Any]] = []
    for mode in MODES:
        device, host, l3 = budgets[mode]
        print(f"simulating {setup.name} {mode} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        r = simulate(
            work, PREFILL, DECODE, POLICY, dataclasses.replace(dep, device_bytes=device),
            time_scale=scale, host_bytes=host, l3_bytes=l3,
        )  # fmt: skip
        runs.append(
            {"workload": setup.name, "mode": mode, "requests": r["requests"], "device_bytes": device,
             "host_bytes": host, "l3_bytes": l3, **{k: r[k] for k in KEYS},
             "wall_s": round(time.perf_counter() - t, 2)}
        )  # fmt: skip
    by = {r["mode"]: r for r in runs}
    off, l3r, ideal = by["without_l3"], by["with_l3"], by["ideal"]
    return {
        "workload": setup.name,
        "trace": str(setup.trace.relative_to(ROOT) if setup.trace.is_relative_to(ROOT) else setup.trace),
        "requests": len(work.requests),
        "limit": setup.limit,
        "copies": setup.copies,
        "time_scale": round(scale, 6),
        "bound_hit_rate": round(bound, 4),
        "distinct_tokens": distinct,
        "ideal_device_bytes": ideal_device,
        "runs": runs,
        "hit_with_l3_over_ideal": _ratio(l3r["hit_rate"], ideal["hit_rate"]),
        "hit_with_l3_over_bound": _ratio(l3r["hit_rate"], bound),
        "hit_ideal_over_bound": _ratio(ideal["hit_rate"], bound),
        "ttft_p50_with_l3_over_without": _ratio(l3r["ttft_p50"], off["ttft_p50"]),
        "ttft_p50_with_l3_over_ideal": _ratio(l3r["ttft_p50"], ideal["ttft_p50"]),
        "with_l3_above_ideal": l3r["hit_rate"] > ideal["hit_rate"],
        "wall_s": round(time.perf_counter() - t0, 2),
    }


def _ratio(a: Any, b: Any) -> float | None:
    return round(float(a) / float(b), 4) if b else None


def setups(limit: int | None = None, copies: int | None = None) -> tuple[Setup, ...]:
    """``SETUPS`` with ``limit`` (each workload's first N requests / calls) and ``copies`` (agent)."""
    out = []
    for s in SETUPS:
        s = dataclasses.replace(s, limit=limit if limit is not None else s.limit)
        if copies is not None and s.copies > 1:
            s = dataclasses.replace(s, copies=copies)
        out.append(s)
    return tuple(out)


def run_sessions(chosen: tuple[Setup, ...] = SETUPS) -> list[dict[str, Any]]:
    return [run_setup(s) for s in chosen]


def print_sessions(results: list[dict[str, Any]]) -> None:
    print(
        f"\nReturning sessions (simulator, {DEPLOYMENT}, {PREFILL} prefill + {DECODE} decode, {POLICY}; "
        "hit = cached / prompt tokens, TTFT simulated s)"
    )
    head = (f"{'workload':<13}{'mode':<11}{'reqs':>6}{'device GB':>10}{'host GB':>9}{'L3 GB':>7}"
            f"{'hit':>8}{'host hit':>9}{'L3 hit':>8}{'TTFT p50':>10}{'TTFT p90':>10}{'util':>6}{'wall s':>8}")  # fmt: skip
    print(head)
    for res in results:
        for r in res["runs"]:
            print(
                f"{r['workload']:<13}{r['mode']:<11}{r['requests']:>6}{r['device_bytes'] / 1e9:>10.1f}"
                f"{r['host_bytes'] / 1e9:>9.1f}{r['l3_bytes'] / 1e9:>7.0f}{r['hit_rate']:>8.4f}"
                f"{r['host_hit_rate']:>9.4f}{r['l3_hit_rate']:>8.4f}{r['ttft_p50']:>10.4f}"
                f"{r['ttft_p90']:>10.4f}{r['prefill_utilization']:>6.2f}{r['wall_s']:>8.1f}"
            )
        print(
            f"{res['workload']:<13}bound: one infinite shared cache hit {res['bound_hit_rate']:.4f}; "
            f"with L3 / ideal hit {res['hit_with_l3_over_ideal']}, with L3 / bound {res['hit_with_l3_over_bound']}, "
            f"ideal / bound {res['hit_ideal_over_bound']}; TTFT p50 with / without L3 "
            f"{res['ttft_p50_with_l3_over_without']}"
        )
        if res["with_l3_above_ideal"]:
            print(
                f"{'':<13}note: with L3 hits more than the ideal: the ideal's caches are per instance "
                "(a prefix computed on one is computed again on another), L3 is shared"
            )
