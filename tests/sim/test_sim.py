"""The simulator (real routing + radix-cache code in simulated time) and the priority queue's
starvation bound."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest

from swaserve.kvcache.hashing import block_hashes
from swaserve.sched.cost import MIMO_V2_FLASH_H200, CostModel
from swaserve.sched.priority import ComputeAwarePriority, PriorityQueue
from swaserve.shapes import model_config, shape
from swaserve.sim.cluster import SimConfig, Simulator
from swaserve.sim.run import deployment, simulate
from swaserve.sim.workload import SimRequest, Workload, mooncake, scale_for_load

TRACE = Path(__file__).resolve().parents[2] / "data" / "traces" / "conversation_trace.jsonl"
COST = CostModel("unit", 0.0, 1e-3, 0.0, 1e-3, 1e-4, 0.0)  # 1 ms per prefill token
FLASH = model_config(shape("MiMo-V2-Flash"))


def synthetic(specs: list[tuple[float, int, int]], seed: int = 0) -> Workload:
    """(arrival s, prompt tokens, output tokens) -> unrelated random prompts."""
    rng = random.Random(seed)
    reqs = []
    for i, (t, n, out) in enumerate(specs):
        p = [rng.randrange(10, 250) for _ in range(n)]
        reqs.append(SimRequest(str(i), t, n, out, block_hashes(p, 16), functools.partial(list, p)))
    return Workload("synthetic", reqs, 16)


def config(n: int, policy: str, priority: str = "fcfs", **kw: object) -> SimConfig:
    return SimConfig(n, 1, policy, COST, FLASH, device_bytes=20 * 10**9, priority=priority, **kw)  # type: ignore[arg-type]


def test_priority_queue_orders_and_bounds() -> None:
    pr = ComputeAwarePriority(COST, max_wait_s=5.0, wait_weight=0.5)
    q: PriorityQueue[str] = PriorityQueue(pr)
    q.push("long", 0.0, uncached=8000)  # 8 s of work
    q.push("short", 1.0, uncached=100)
    h = q.push("gone", 1.5, uncached=1)
    q.remove(h)
    assert len(q) == 2 and q.items() == ["long", "short"]
    assert q.peek(2.0) == "short" and q.pop(2.0) == "short"
    q.push("short2", 3.0, uncached=100)
    assert q.pop(5.0) == "long"  # waited 5 s = max_wait_s: overdue, first
    assert q.pop(5.0) == "short2" and q.pop(5.0) is None and len(q) == 0
    fifo: PriorityQueue[int] = PriorityQueue(None)
    for k in range(5):
        fifo.push(k, float(k), uncached=10 - k)
    assert [fifo.pop(10.0) for _ in range(5)] == [0, 1, 2, 3, 4]


def test_starvation_bound_under_adversarial_short_stream() -> None:
    """One long prompt at t=0 on a single instance, then a short one every 0.09 s (each takes
    0.1 s: the queue never empties). Shortest-first alone would starve the long one; with the
    bound it starts within max_wait_s + one short's service of its arrival."""
    specs = [(0.01, 100, 1), (0.0, 100, 1)] + [(0.02 + 0.09 * k, 100, 1) for k in range(300)]
    specs[0] = (0.01, 5000, 1)  # the long one (5 s), arriving just after the first short
    work = synthetic(specs)
    for max_wait, bound_ok in ((3.0, True), (1e9, False)):
        sim = Simulator(config(1, "round_robin", "compute", max_wait_s=max_wait, wait_weight=0.0))
        res = sim.run(work)
        long_job = next(j for j in sim.finished if j.req.rid == "0")
        waited = long_job.prefill_start - long_job.arrival
        assert res.requests == len(specs)
        if bound_ok:
            assert waited <= max_wait + 0.1 + 1e-9
        else:
            assert waited > 20.0  # pure shortest-first: it waits for the whole short stream
    fcfs = Simulator(config(1, "round_robin", "fcfs"))
    fcfs.run(work)
    assert next(j for j in fcfs.finished if j.req.rid == "0").prefill_start == pytest.approx(0.1)


def test_cache_aware_routing_hits_more_on_the_conversation_trace() -> None:
    """First 600 Mooncake requests, 4 prefill instances, H200 deployment at 80% load: the real
    radix caches see more hits when the router follows the prefix index."""
    work = mooncake(TRACE, limit=600)
    dep = deployment("mimo-v2-flash-h200")
    rows = {p: simulate(work, 4, 2, p, dep, load=0.8) for p in ("round_robin", "least_load", "cache_aware")}
    assert all(r["requests"] == 600 and r["rejected"] == 0 for r in rows.values())
    rr, ca = rows["round_robin"]["hit_rate"], rows["cache_aware"]["hit_rate"]
    assert isinstance(rr, float) and isinstance(ca, float)
    assert ca >= 1.25 * rr > 0
    assert rows["cache_aware"]["ttft_p90"] < rows["round_robin"]["ttft_p90"]  # type: ignore[operator]


def test_every_request_completes_and_counts_add_up() -> None:
    specs = [(0.1 * k, 200 + 50 * (k % 7), 1 + k % 5) for k in range(60)]
    work = synthetic(specs)
    sim = Simulator(config(2, "cache_aware", decode_batch=4))
    res = sim.run(work)
    assert res.requests == 60 and res.prompt_tokens == sum(n for _, n, _ in specs)
    assert all(j.generated == j.req.output_len and j.done >= j.first_token >= j.arrival for j in sim.finished)
    assert sum(n for _, n in res.steps) == sum(out - 1 for _, _, out in specs)  # one ITL sample a token
    # leases released: nothing is left reserved anywhere
    loads = sim.book.loads([*sim.prefill, *sim.decode], now=res.makespan_s)
    assert all(x.leases == 0 for x in loads.values())
    for p in sim.prefill.values():
        from swaserve.kvcache.invariants import check

        check(p.kv)


def test_scale_for_load_and_errors() -> None:
    work = synthetic([(0.0, 1000, 1), (10.0, 1000, 1)])
    # 2 s of work (no shared prefix) over 10 s span on 1 instance at load 0.5 -> 0.4x
    assert scale_for_load(work, COST, 1, 0.5) == pytest.approx(2.0 / (0.5 * 10.0))
    with pytest.raises(ValueError, match="load"):
        scale_for_load(work, COST, 1, 0.0)
    with pytest.raises(ValueError, match="priority"):
        Simulator(config(1, "cache_aware", "lifo"))
    with pytest.raises(ValueError, match="deployment"):
        deployment("tpu")
    assert MIMO_V2_FLASH_H200.transfer_s(1000) > 0
    # settings that do not apply are refused, not ignored
    dep = deployment("mimo-v2-flash-h200")
    with pytest.raises(ValueError, match="compute priority only"):
        simulate(work, 1, 1, "cache_aware", dep, "fcfs", max_wait_s=5.0)
    with pytest.raises(ValueError, match="queue_order"):
        simulate(work, 1, 1, "cache_aware", dep, policy_args={"queue_order": "sjf"})


def test_sim_cli_table_names_its_settings_and_refuses_flags_that_do_not_apply(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from swaserve.cli import app

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {"timestamp": i * 1000, "input_length": 600, "output_length": 4, "hash_ids": [i % 3, i]}
            )
            + "\n"
            for i in range(20)
        )
    )
    base = ["sim", "--trace", str(trace), "--prefill", "2", "--decode", "1"]
    ok = CliRunner().invoke(app, [*base, "--queue-order", "compute"])
    assert ok.exit_code == 0, ok.output
    head, row = ok.output.splitlines()[:2]
    assert head.split()[:6] == [
        "policy",
        "priority",
        "queue_order",
        "index_mode",
        "requests",
        "refused_too_long",
    ]
    assert row.split()[:5] == ["cache_aware", "fcfs", "compute", "approximate", "20"]
    bad = CliRunner().invoke(app, [*base, "--policy", "round_robin", "--queue-order", "compute"])
    assert bad.exit_code == 2 and "applies to --policy cache_aware only" in bad.output
    bad = CliRunner().invoke(app, [*base, "--wait-weight", "0.5"])
    assert bad.exit_code == 2 and "--priority compute" in bad.output


def test_requests_over_the_context_are_refused_and_sessions_go_on() -> None:
    work = synthetic([(0.0, 300, 4), (0.1, 5000, 4), (0.2, 200, 4)])
    work.requests[2].after = "1"  # closed loop behind the refused one
    sim = Simulator(config(1, "cache_aware", max_model_len=1000))
    res = sim.run(work)
    assert res.too_long == 1 and res.requests == 2
    assert {j.req.rid for j in sim.finished} == {"0", "2"}


def test_precise_index_tracks_evictions_that_approximate_misses() -> None:
    """Many distinct 2k-token prefixes, each asked twice far apart, through one small cache: the
    approximate index still promises prefixes the cache evicted; the precise one (the caches'
    block events) does not."""
    rng = random.Random(7)
    stems = [[rng.randrange(10, 250) for _ in range(2048)] for _ in range(12)]
    reqs = []
    for k in range(24):
        p = [*stems[k % 12], *(rng.randrange(10, 250) for _ in range(32))]
        reqs.append(SimRequest(str(k), 0.5 * k, len(p), 1, block_hashes(p, 64), functools.partial(list, p)))
    work = Workload("evict", reqs, 64)
    err = {}
    for mode in ("approximate", "precise"):
        sim = Simulator(
            SimConfig(2, 1, "cache_aware", COST, FLASH, device_bytes=3 * 10**8, index_mode=mode, page_size=64)
        )
        sim.run(work)
        err[mode] = sum(abs(j.est_cached - j.cached) for j in sim.finished)
        assert all(j.est_cached <= j.req.prompt_len for j in sim.finished)
    assert err["approximate"] > 0 and err["precise"] < err["approximate"], err
    with pytest.raises(ValueError, match="index mode"):
        Simulator(config(1, "cache_aware", index_mode="exact"))


def test_workload_loading_errors_and_gzip(tmp_path: Path) -> None:
    import gzip

    from swaserve.sim.workload import load
    from swaserve.traces import TraceError

    lines = TRACE.read_text().splitlines()[:20]
    gz = tmp_path / "slice.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write("\n".join(lines) + "\n")
    assert len(load(gz).requests) == 20  # a gzipped Mooncake trace reads like the plain one
    with pytest.raises(ValueError, match="copies"):
        load(TRACE, limit=5, copies=2)
    bad = tmp_path / "notes.md"
    bad.write_text("# not a trace\n")
    with pytest.raises(TraceError, match=r"notes\.md:1"):
        load(bad)


def _returning_sessions(n: int = 12, stem: int = 2048, seed: int = 11) -> Workload:
    """``n`` sessions of two turns: turn 2 extends turn 1's prompt and arrives after every other
    session's turn 1 (a cache that cannot hold all sessions has lost it by then)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(10, 250) for _ in range(stem)] for _ in range(n)]
    reqs = []
    for turn in range(2):
        for s in range(n):
            p = stems[s] + [rng.randrange(10, 250) for _ in range(64 * (turn + 1))] if turn else stems[s][:]
            if turn:
                stems[s] = p
            t = 3.0 * (turn * n + s)  # 1 ms a token: no queue
            reqs.append(
                SimRequest(f"{s}.{turn}", t, len(p), 1, block_hashes(p, 64), functools.partial(list, p))
            )
    return Workload("returning", reqs, 64)


def _run(work: Workload, prefill: int, mode: str, l3: int, device: int = 3 * 10**8) -> Simulator:
    sim = Simulator(
        SimConfig(prefill, 1, "cache_aware", COST, FLASH, device_bytes=device, host_bytes=2 * 10**8,
                  index_mode=mode, page_size=64, l3_bytes=l3)
    )  # fmt: skip
    sim.run(work)
    return sim


def test_l3_tier_keeps_returning_sessions_and_precise_routing_credits_it() -> None:
    """Device + host too small to keep 12 sessions between turns: without L3 turn 2 recomputes;
    with L3 (the real GCache store and the engine's read/write rules) turn 2 hits about as much
    as an unbounded device cache, the hits are counted as L3 hits, and with two instances in
    precise mode the router expects those hits (the L3 node's block events in its index)."""
    work = _returning_sessions()
    turn2 = {r.rid for r in work.requests if r.rid.endswith(".1")}

    def hit(sim: Simulator) -> int:
        return sum(j.cached for j in sim.finished if j.req.rid in turn2)

    off = _run(work, 1, "approximate", 0)
    on = _run(work, 1, "approximate", 10**12)
    ideal = _run(work, 1, "approximate", 0, device=10**12)
    assert hit(off) < 0.2 * hit(ideal)
    assert hit(on) >= 0.9 * hit(ideal) > 0
    assert sum(j.from_l3 for j in on.finished) >= 0.8 * hit(on)
    assert on.l3 is not None and not on.l3.store.pending and not on.l3.store.leases
    work = _returning_sessions(24)  # two instances hold twice as much
    turn2 = {r.rid for r in work.requests if r.rid.endswith(".1")}
    two, two_off = _run(work, 2, "precise", 10**12), _run(work, 2, "precise", 0)

    def est(sim: Simulator) -> int:  # what the router expected each turn 2 to reuse
        return sum(j.est_cached for j in sim.finished if j.req.rid in turn2)

    assert hit(two_off) < 0.2 * hit(two) and est(two_off) < 0.2 * est(two)
    assert est(two) >= 0.75 * hit(two) > 0  # the router credited L3 (the node's block events)
    with pytest.raises(ValueError, match="host tier"):
        Simulator(SimConfig(1, 1, "cache_aware", COST, FLASH, device_bytes=3 * 10**8, l3_bytes=10**12))
