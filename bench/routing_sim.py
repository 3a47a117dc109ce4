"""Routing policies in the simulator (``swaserve.sim``, deployment ``mimo-v2-flash-h200``) on the
conversation trace and the agent sessions, 8 and 16 prefill instances at offered load 0.8.
Rows: round-robin, least-load, cache-aware (FCFS queues), cache-aware + compute priority, and
cache-aware over FCFS queues with the compute-order wait estimate. Targets: hit rate cache-aware
>= 1.25 x round-robin; TTFT p90 compute priority <= 0.7 x FCFS.

Design notes: docs/DESIGN.md#benchrouting_simpy"""

from __future__ import annotations

from pathlib import Path

from swaserve.sim import workload
from swaserve.sim.run import Deployment, deployment, print_table, simulate, write_json

ROOT = Path(__file__).resolve().parent.parent
TRACES = {
    "conversation": ROOT / "data" / "traces" / "conversation_trace.jsonl",
    "agent": ROOT / "data" / "agentic" / "agent_sessions.jsonl.gz",
}
ROWS = (
    ("round_robin", "fcfs", "auto"),
    ("least_load", "fcfs", "auto"),
    ("cache_aware", "fcfs", "auto"),
    ("cache_aware", "compute", "auto"),
    ("cache_aware", "fcfs", "compute"),
)


def _row(
    work: workload.Workload, n: int, policy: str, prio: str, order: str, dep: Deployment, load: float
) -> dict[str, object]:
    args: dict[str, float | str] = {"queue_order": order} if policy == "cache_aware" else {}
    return simulate(work, n, n, policy, dep, prio, load=load, policy_args=args)


def main(
    instances: tuple[int, ...] = (8, 16),
    traces: tuple[str, ...] = ("conversation", "agent"),
    load: float = 0.8,
    limit: int | None = None,
    deployment_name: str = "mimo-v2-flash-h200",
    json_path: Path | None = None,
) -> dict[str, object]:
    dep = deployment(deployment_name)
    out: dict[str, object] = {"deployment": dep.name, "load": load, "runs": []}
    runs: list[dict[str, object]] = []
    for name in traces:
        for n in instances:
            # agent sessions run closed loop: `n` copies of the 49 sessions keep ~49 per instance
            work = workload.load(TRACES[name], limit, copies=n if name == "agent" else 1)
            rows = [_row(work, n, pol, prio, order, dep, load) for pol, prio, order in ROWS]
            # the target rows: each queue order with the router estimate made for it (not the fifth)
            by = {f"{r['policy']}+{r['priority']}": r for r in rows if r["queue_order"] != "compute"}
            rr = float(by["round_robin+fcfs"]["hit_rate"])  # type: ignore[arg-type]
            ca = float(by["cache_aware+fcfs"]["hit_rate"])  # type: ignore[arg-type]
            p90_f = float(by["cache_aware+fcfs"]["ttft_p90"])  # type: ignore[arg-type]
            p90_c = float(by["cache_aware+compute"]["ttft_p90"])  # type: ignore[arg-type]
            run = {
                "trace": name,
                "prefill_instances": n,
                "rows": rows,
                "hit_rate_ratio_cache_aware_vs_round_robin": round(ca / rr, 3) if rr else None,
                "ttft_p90_ratio_compute_vs_fcfs": round(p90_c / p90_f, 3) if p90_f else None,
            }
            run["targets_met"] = {
                "hit_rate_ratio>=1.25": rr > 0 and ca / rr >= 1.25,
                "ttft_p90_ratio<=0.7": p90_f > 0 and p90_c / p90_f <= 0.7,
            }
            print(f"\n{name}: {n} prefill + {n} decode instances, load {load}")
            print_table(rows)
            print(
                f"hit rate cache-aware / round-robin: {run['hit_rate_ratio_cache_aware_vs_round_robin']}  "
                f"TTFT p90 compute-aware / FCFS: {run['ttft_p90_ratio_compute_vs_fcfs']}  {run['targets_met']}"
            )
            runs.append(run)
    out["runs"] = runs
    if json_path is not None:
        write_json(json_path, out)
    return out
