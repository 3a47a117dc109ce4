"""Routing policies on the real cluster on this CPU, next to the simulator on the same requests.

``swaserve up`` with ``--prefill`` prefill workers and one decode worker, once per row (round-robin,
cache-aware, cache-aware + compute priority), on agent sessions (closed loop) or a Mooncake slice;
then ``swaserve.sim`` (``cpu-tiny``) on exactly the requests sent: hit rate and TTFT p50/p90 side by side.

Design notes: docs/DESIGN.md#benchrouting_clusterpy"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROWS = (("round_robin", "fcfs"), ("cache_aware", "fcfs"), ("cache_aware", "compute"))


def _agent_work(sessions: list[list[list[int]]], max_output: int, block_tokens: int) -> Any:
    """The closed-loop agent replay as a simulator workload (all sessions start at 0)."""
    import functools

    from swaserve.kvcache.hashing import block_hashes
    from swaserve.sim.workload import SimRequest, Workload

    reqs = []
    for si, calls in enumerate(sessions):
        prev = None
        for k, p in enumerate(calls):
            rid = f"{si}/{k}"
            reqs.append(SimRequest(rid, 0.0, len(p), max_output, block_hashes(p, block_tokens),
                                   functools.partial(list, p), prev))  # fmt: skip
            prev = rid
    return Workload("agent sessions", reqs, block_tokens)


def main(
    json_path: Path | None = None,
    limit: int = 200,
    block_tokens: int = 16,
    max_output: int = 32,
    time_scale: float = 1.0,
    prefill: int = 2,
    workload: str = "agent",
    sessions: int = 6,
    calls: int = 6,
) -> dict[str, Any]:
    import asyncio
    from dataclasses import replace

    from bench.prefix_replay import _closed_loop, agent_sessions
    from swaserve.config import ModelConfig
    from swaserve.launcher import Cluster
    from swaserve.model.checkpoint import default_model_dir
    from swaserve.replay import run_replay
    from swaserve.replay_plan import ReplayOptions, plan_requests, token_space_from_model_dir
    from swaserve.sched.cost import CPU_TINY
    from swaserve.sim.cluster import SimConfig, Simulator
    from swaserve.sim.workload import from_planned
    from swaserve.traces import read_mooncake

    if workload not in ("agent", "conversation"):
        raise ValueError(f"workload must be agent or conversation, got {workload!r}")
    model_dir = Path(default_model_dir())
    vocab, reserved = token_space_from_model_dir(model_dir)
    trace = read_mooncake(limit=limit)
    opts = ReplayOptions(
        url="", time_scale=time_scale, block_tokens=block_tokens, max_output_tokens=max_output,
        vocab_size=vocab, reserved_ids=reserved, progress=False,
    )  # fmt: skip
    if workload == "agent":
        plan = agent_sessions(sessions, calls)
        work = _agent_work(plan, max_output, block_tokens)
    else:
        work = from_planned(plan_requests(trace, opts), block_tokens, "conversation slice")
    model = ModelConfig.from_pretrained(model_dir)
    rows = []
    for policy, prio in ROWS:
        print(f"{policy} + {prio}: {prefill} prefill + 1 decode ...", file=sys.stderr, flush=True)
        router_args = ["--policy", policy, "--block-tokens", str(block_tokens)]
        with Cluster(
            model_dir, prefill, 1, router_args=router_args, prefill_args=["--schedule-policy", prio]
        ) as c:
            url = c.start(600)
            if workload == "agent":
                rep = asyncio.run(_closed_loop(url, model_dir.name, plan, max_output))
            else:
                rep = run_replay(trace, replace(opts, url=url))
        sim = Simulator(
            SimConfig(
                prefill,
                1,
                policy,
                CPU_TINY,
                model,
                256 * 1024 * 1024,
                priority=prio,
                decode_batch=64,
                page_size=16,
                chunk=512,
            )
        ).run(work)
        s = sim.summary()
        row = {
            "policy": policy, "priority": prio, "failed": rep["failed"],
            "measured": {"hit_rate": rep["cached_fraction"], "ttft_p50": rep["ttft_s"]["p50"],
                         "ttft_p90": rep["ttft_s"]["p90"]},
            "simulated": {"hit_rate": s["hit_rate"], "ttft_p50": s["ttft_p50"], "ttft_p90": s["ttft_p90"]},
        }  # fmt: skip
        row["sim_over_measured"] = {
            k: round(row["simulated"][k] / row["measured"][k], 3) if row["measured"][k] else None
            for k in ("hit_rate", "ttft_p50", "ttft_p90")
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(
        f"{'policy':<24} {'hit meas':>8} {'hit sim':>8} {'p50 meas':>9} {'p50 sim':>8} {'p90 meas':>9} {'p90 sim':>8}"
    )
    for r in rows:
        m, s2 = r["measured"], r["simulated"]
        print(
            f"{r['policy'] + '+' + r['priority']:<24} {m['hit_rate']:>8.3f} {s2['hit_rate']:>8.3f} "
            f"{m['ttft_p50']:>9.3f} {s2['ttft_p50']:>8.3f} {m['ttft_p90']:>9.3f} {s2['ttft_p90']:>8.3f}"
        )
    out = {
        "workload": {"name": workload, "requests": len(work.requests), "block_tokens": block_tokens,
                     "max_output_tokens": max_output, "time_scale": time_scale if workload != "agent" else None,
                     "sessions": sessions if workload == "agent" else None, "prefill": prefill, "decode": 1},
        "rows": rows,
    }  # fmt: skip
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2) + "\n")
    return out
