"""``swaserve bench ep``: expert parallelism in one run (issue 19).

Part 1, prefill tokens/s at EP = 1, 2, 4 on this machine. The real engine: EP 1 is one engine core
in its own process (``build_engine_client``, ``engine_process`` separate), EP N is N engine-core
rank processes as one instance (``EPEngineClient``: 1/N of the routed experts each, data-parallel
attention, gloo all-to-all dispatch/combine, lockstep steps). All of them are started first and
stay up; each round then runs the same requests through every EP size in turn (interleaved, so a
change in the machine's background load hits every size alike). A round: ``requests`` distinct
agent-trace prompts (``bench.mtp.prompts``: the first calls of the bundled agent sessions, ChatML,
cut to their last ``prompt_tokens`` tokens), all submitted at once, greedy, ``max_tokens`` 1, prefix
cache off (prefill-bound; nothing hits). Tokens/s = prompt tokens / (last request done - first
submitted); best and median of ``rounds``. Two arrangements of the torch threads
(``arrangements``): ``one-core``, every rank of every EP size pinned to the same CPU with 1 thread
(equal compute: the ratio is EP's overhead alone, and no OpenMP team waits on a busy core);
``all-cores``, ``threads`` in all (default: the usable CPUs) split between the ranks, at least 1
each, not pinned (EP 1: 2 threads; EP 2: 1 per rank; EP 4: 1 per rank, 4 threads on 2 cores). The
same step budget per rank (``chunk`` tokens). CPU ranks share the cores and talk over loopback TCP
(gloo), not NVLink: the figure is EP's overhead on this machine, not a speedup. Exactness: each request's greedy first token at EP N against EP 1's.

Part 2, expert load balance per MoE layer at EP 2 and 4 on the same rounds, from the engine's
counters (``client.stats().ep``: per step, the (token, expert) rows each rank computed; per layer
sum of the mean over ranks / sum of the max, SGLang's metric; 1 = even). Over layers: weighted by
their mean rows (every MoE layer routes every token, so the plain mean of the layers).

Part 3, the ``plan-ep`` table (``sched.ep_plan``): the smallest EP of each KV layout for
MiMo-V2-Flash and MiMo-V2.5-Pro on 141 GB GPUs at ``plan_contexts`` (the planner's defaults
otherwise), marking where the hybrid layout needs half the EP or less.

Part 4, the simulated cluster (``sim.ep.compare``, the ``mimo-v2-flash-h200`` deployment, the
conversation trace's first ``sim_limit`` requests, cache-aware routing, 2 decode instances): 16
prefill GPUs as EP N instances against EP N/2 with twice the instances, same arrivals, at each
``sim_loads``; TTFT p50/p90, hit rate, prompt tok/s.

    swaserve bench ep [--json PATH] [--model DIR] [--ep 1 --ep 2 --ep 4] [--requests 48]
                      [--prompt-tokens 512] [--rounds 3] [--threads N] [--sim-limit 2000] [--quick]"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.cpus import usable_cpus
from swaserve.engine.client import LocalEngineClient
from swaserve.engine.types import SamplingParams
from swaserve.model.ep_stats import EPStats

ARRANGEMENTS = ("one-core", "all-cores")
CONVERSATION = "data/traces/conversation_trace.jsonl"
PLAN_MODELS = ("mimo-v2-flash", "mimo-v2.5-pro")
SIM_GPUS = 16  # prefill GPUs of each simulated deployment (EP N x 16/N instances)
PRODUCTION_BALANCE = 0.85  # mean/max tokens per rank reported without balancing (issue 19)
NOTE = (
    "CPU ranks share the machine's cores and exchange tokens over loopback TCP (gloo), with no "
    "NVLink: tokens/s at EP N measures EP's overhead here, not a speedup"
)


@dataclass(frozen=True)
class Settings:
    """One run's sizes (``quick``: the smoke test's tiny run)."""

    ep_sizes: tuple[int, ...] = (1, 2, 4)
    requests: int = 48
    prompt_tokens: int = 512
    rounds: int = 3
    arrangements: tuple[str, ...] = ARRANGEMENTS
    threads: int = field(default_factory=usable_cpus)  # all-cores: torch threads in all, split between ranks
    chunk: int = 2048  # prefill tokens per step and rank (max_num_batched_tokens)
    plan_contexts: tuple[int, ...] = (4096, 8192, 16384, 32768, 65536, 131072, 262144)
    plan_concurrency: int = 8
    sim_limit: int = 2000
    sim_eps: tuple[int, ...] = (16, 8)  # each against half its size
    sim_loads: tuple[float, ...] = (0.8, 1.5)

    @staticmethod
    def quick() -> Settings:
        return Settings(
            ep_sizes=(1, 2), requests=4, prompt_tokens=48, rounds=1, chunk=256, plan_contexts=(32768,),
            sim_limit=60, sim_eps=(16,), sim_loads=(1.5,),
        )  # fmt: skip


class BenchInputError(ValueError):
    """Settings this model cannot run (an EP size that does not divide its experts)."""


def check_settings(model_dir: Path, s: Settings) -> None:
    """Raises BenchInputError where ``s`` cannot run on ``model_dir``."""
    from swaserve.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    bad = [ep for ep in s.ep_sizes if not cfg.n_routed_experts or cfg.n_routed_experts % ep]
    if bad:
        raise BenchInputError(
            f"EP sizes {bad} do not divide the {cfg.n_routed_experts} routed experts of {model_dir}"
        )
    if unknown := set(s.arrangements) - set(ARRANGEMENTS):
        raise BenchInputError(f"arrangements are {', '.join(ARRANGEMENTS)}, not {', '.join(sorted(unknown))}")


# -- part 1 and 2: the real engine -------------------------------------------------------------------
def threads_per_rank(arrangement: str, ep: int, threads: int) -> int:
    """Torch threads of each of ``ep`` ranks: 1 on one core, else ``threads`` split (at least 1)."""
    return 1 if arrangement == "one-core" else max(1, threads // ep)


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process (and the processes it starts meanwhile) on ``cpus`` (None: unchanged)."""
    if cpus is None:
        yield
        return
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, old)


def make_client(model_dir: Path, ep: int, threads: int, s: Settings) -> LocalEngineClient:
    """An unstarted client of ``ep`` rank processes with ``threads`` torch threads each."""
    from swaserve.engine.factory import build_engine_client, check_ep

    cfg = EngineConfig(
        ep_size=ep, engine_process="separate", enable_prefix_caching=False, max_num_seqs=s.requests,
        max_num_batched_tokens=s.chunk, kv_cache_memory=256 << 20, device="cpu",
    )  # fmt: skip
    if ep == 1:
        return build_engine_client(model_dir, cfg, num_threads=threads)
    from swaserve.engine.ep_client import EPEngineClient

    check_ep(model_dir, cfg)
    return EPEngineClient(model_dir, cfg, num_threads=threads)  # the factory leaves threads to the client


async def _one(client: LocalEngineClient, ids: list[int], rid: str) -> tuple[int, float]:
    """(greedy first token, monotonic time the request finished)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = -1
    async for out in client.generate(ids, params, rid):
        if out.new_token_ids and first < 0:
            first = out.new_token_ids[0]
    return first, time.monotonic()


async def run_round(client: LocalEngineClient, prompts: list[list[int]], tag: str) -> tuple[float, list[int]]:
    """Every prompt at once; (prompt tokens/s, each request's first token)."""
    t0 = time.monotonic()
    done = await asyncio.gather(*(_one(client, p, f"{tag}-{i}") for i, p in enumerate(prompts)))
    wall = max(t for _, t in done) - t0
    return sum(map(len, prompts)) / wall, [tok for tok, _ in done]


def _ranks(client: LocalEngineClient) -> list[LocalEngineClient]:
    return list(getattr(client, "ranks", [client]))


async def settled_ep(client: LocalEngineClient, wait_s: float = 5.0) -> EPStats | None:
    """The instance's EP counters once every rank has reported its last step (None: no EP)."""
    deadline = time.monotonic() + wait_s
    while True:
        got = [c.stats().ep for c in _ranks(client)]
        if got[0] is None or all(g == got[0] for g in got) or time.monotonic() > deadline:
            return got[0]
        await asyncio.sleep(0.05)


def balance_of(before: EPStats, after: EPStats) -> dict[str, Any]:
    """Balance per MoE layer over the steps between two snapshots, and over layers (weighted by
    each layer's mean rows per rank)."""
    mean = [a - b for a, b in zip(after.mean_sum, before.mean_sum, strict=True)]
    top = [a - b for a, b in zip(after.max_sum, before.max_sum, strict=True)]
    per_layer = [m / x if x else 1.0 for m, x in zip(mean, top, strict=True)]
    weight = sum(mean)
    overall = sum(m * b for m, b in zip(mean, per_layer, strict=True)) / weight if weight else 1.0
    return {"per_layer": per_layer, "token_weighted_mean": overall, "min_layer": min(per_layer),
            "max_layer": max(per_layer), "mean_rows_sum": mean, "max_rows_sum": top}  # fmt: skip


class _Arm:
    """One EP size in one arrangement: its client, timings and first tokens."""

    def __init__(self, model_dir: Path, arrangement: str, ep: int, s: Settings) -> None:
        self.arrangement, self.ep = arrangement, ep
        self.threads = threads_per_rank(arrangement, ep, s.threads)
        self.cpus = {max(os.sched_getaffinity(0))} if arrangement == "one-core" else None
        self.client = make_client(model_dir, ep, self.threads, s)
        self.tok_s: list[float] = []
        self.firsts: list[list[int]] = []
        self.start: tuple[EPStats | None, list[int]] = (None, [])

    async def snapshot(self) -> tuple[EPStats | None, list[int]]:
        return await settled_ep(self.client), [r.stats().prompt_tokens_total for r in _ranks(self.client)]

    def row(self, base: _Arm, end: tuple[EPStats | None, list[int]]) -> dict[str, Any]:
        """Figures against ``base`` (EP 1 of the same arrangement)."""
        best, median = max(self.tok_s), statistics.median(self.tok_s)
        same = [sum(a == b for a, b in zip(f, base.firsts[0], strict=True)) for f in self.firsts]
        row: dict[str, Any] = {
            "arrangement": self.arrangement, "ep": self.ep, "threads_per_rank": self.threads,
            "cpus": sorted(self.cpus) if self.cpus else None, "tok_s": self.tok_s, "best_tok_s": best,
            "median_tok_s": median, "spread": best / min(self.tok_s),
            "vs_ep1_best": best / max(base.tok_s), "vs_ep1_median": median / statistics.median(base.tok_s),
            "first_tokens_equal_ep1": min(same), "first_tokens_stable": all(f == self.firsts[0] for f in self.firsts),
            "mismatches": [i for i, (a, b) in enumerate(zip(self.firsts[0], base.firsts[0], strict=True)) if a != b],
            "rank_prompt_tokens": [a - b for a, b in zip(end[1], self.start[1], strict=True)],
        }  # fmt: skip
        if end[0] is not None and self.start[0] is not None:
            row["balance"] = balance_of(self.start[0], end[0])
        return row


async def _measure(model_dir: Path, prompts: list[list[int]], s: Settings) -> list[dict[str, Any]]:
    arms = [_Arm(model_dir, a, ep, s) for a in s.arrangements for ep in s.ep_sizes]
    try:
        for arm in arms:  # one at a time: a start loads the model in every rank
            with pinned(arm.cpus):
                await arm.client.start()
        for arm in arms:  # warm-up: first-call allocations, thread pools, gloo buffers
            await run_round(arm.client, [p[:64] for p in prompts[: max(arm.ep, 2)]], f"warm{arm.ep}")
            arm.start = await arm.snapshot()
        for n in range(s.rounds):
            for arm in arms:
                tok_s, first = await run_round(arm.client, prompts, f"{arm.arrangement}{arm.ep}-r{n}")
                arm.tok_s.append(tok_s)
                arm.firsts.append(first)
        ends = [await arm.snapshot() for arm in arms]
    finally:
        for arm in arms:
            with contextlib.suppress(Exception):
                await arm.client.stop()
    base = {arm.arrangement: arm for arm in arms if arm.ep == 1}
    return [arm.row(base[arm.arrangement], end) for arm, end in zip(arms, ends, strict=True)]


def run_engine_part(model_dir: Path, s: Settings) -> dict[str, Any]:
    """Parts 1 and 2 on ``model_dir``: tokens/s, exactness and balance by EP size."""
    from bench.mtp import prompts as trace_prompts
    from swaserve.config import ModelConfig

    cfg = ModelConfig.from_pretrained(model_dir)
    prompts = trace_prompts(model_dir, s.requests, s.prompt_tokens)
    rows = asyncio.run(_measure(model_dir, prompts, s))
    return {
        "model_dir": str(model_dir),
        "model": {"routed_experts": cfg.n_routed_experts, "top_k": cfg.num_experts_per_tok,
                  "layers": cfg.num_layers, "moe_layers": cfg.mlp_types.count("sparse"),
                  "hidden": cfg.hidden_size},
        "workload": {"source": "agent-session trace, first distinct calls, last prompt_tokens tokens",
                     "requests": len(prompts), "prompt_tokens": s.prompt_tokens,
                     "tokens_per_round": sum(map(len, prompts)), "max_tokens": 1, "greedy": True,
                     "prefix_cache": False, "chunk_per_rank": s.chunk, "rounds": s.rounds},
        "threads": s.threads, "cpus": usable_cpus(), "note": NOTE, "rows": rows,
    }  # fmt: skip


def print_engine(r: dict[str, Any]) -> None:
    m, w = r["model"], r["workload"]
    print(
        f"Part 1: prefill tokens/s by EP size (model: {m['routed_experts']} routed experts, top-{m['top_k']}, "
        f"{m['moe_layers']} MoE of {m['layers']} layers, hidden {m['hidden']})"
    )
    print(
        f"  {w['requests']} agent-trace prompts x {w['prompt_tokens']} tokens at once, greedy, 1 token each, "
        f"prefix cache off; {w['chunk_per_rank']} tokens per step and rank; {w['rounds']} rounds, "
        f"interleaved; {r['cpus']} usable CPUs"
    )
    print("  one-core: every rank of every EP size on the same CPU, 1 torch thread each (equal compute);")
    print(f"  all-cores: {r['threads']} torch threads split between the ranks, at least 1 each, no pinning")
    print(f"  {r['note']}")
    print(
        f"{'arrangement':<11} {'EP':>3} {'threads/rank':>12} {'best tok/s':>11} {'median':>7} {'spread':>7} "
        f"{'best/EP1':>9} {'median/EP1':>10} {'first tok = EP1':>15}  prompt tokens per rank"
    )
    for row in r["rows"]:
        print(f"{row['arrangement']:<11} {row['ep']:>3} {row['threads_per_rank']:>12} {row['best_tok_s']:>11.0f} "
              f"{row['median_tok_s']:>7.0f} {row['spread']:>6.2f}x {row['vs_ep1_best']:>8.3f}x "
              f"{row['vs_ep1_median']:>9.3f}x {row['first_tokens_equal_ep1']:>8}/{w['requests']:<6} "
              f"{row['rank_prompt_tokens']}")  # fmt: skip
    noisy = [f"{row['arrangement']} EP {row['ep']}" for row in r["rows"] if row["spread"] > 1.25]
    if noisy:
        print(f"  noisy: the rounds of {', '.join(noisy)} differ by more than 25% (other work on the CPUs)")
    bal = [row for row in r["rows"] if "balance" in row]
    if not bal:
        return
    print(
        f"\nPart 2: expert load balance per MoE layer (mean / max (token, expert) rows per rank, "
        f"token-weighted over steps), the rounds above; production reports ~{PRODUCTION_BALANCE} "
        "without balancing (256 experts, top-8, large EP)"
    )
    layers = len(bal[0]["balance"]["per_layer"])
    print(
        f"{'arrangement':<11} {'EP':>3} {'mean':>6} {'min':>6}  "
        + " ".join(f"{f'L{i}':>5}" for i in range(layers))
    )
    for row in bal:
        b = row["balance"]
        print(f"{row['arrangement']:<11} {row['ep']:>3} {b['token_weighted_mean']:>6.3f} {b['min_layer']:>6.3f}  "
              + " ".join(f"{x:>5.3f}" for x in b["per_layer"]))  # fmt: skip
    print("  L0..: the MoE layers in order; mean: over layers, weighted by their rows (= plain mean)")


# -- part 3: plan-ep ----------------------------------------------------------------------------------
def run_plan_part(s: Settings) -> dict[str, Any]:
    """``ep_plan.sweep`` for each public shape at ``s.plan_contexts``, both layouts."""
    from swaserve.sched import ep_plan

    inputs = ep_plan.Inputs(concurrency=s.plan_concurrency)
    rows, sources = [], {}
    for shape in PLAN_MODELS:
        name, cfg, weights = ep_plan.resolve(shape)
        sources[name] = weights.source
        for p in ep_plan.sweep(name, cfg, weights, inputs, s.plan_contexts):
            full, hyb = p.layouts["full"], p.layouts["hybrid"]
            rows.append({
                "model": name, "context": p.inputs.context, "tokens_per_gpu": p.inputs.tokens,
                "full_kv_gb": full.kv_bytes / 1e9, "full_ep": full.ep_size,
                "hybrid_kv_gb": hyb.kv_bytes / 1e9, "hybrid_ep": hyb.ep_size,
                "full_over_hybrid": p.halving(),
                "hybrid_halves": hyb.ep_size is not None and (full.ep_size is None or full.ep_size >= 2 * hyb.ep_size),
            })  # fmt: skip
    return {"inputs": asdict(inputs), "weights": sources, "formula": list(ep_plan.FORMULA),
            "assumptions": list(ep_plan.ASSUMPTIONS), "rows": rows}  # fmt: skip


def print_plan(r: dict[str, Any]) -> None:
    i = r["inputs"]
    print(f"\nPart 3: plan-ep, the smallest EP per layout on {i['gpu_bytes'] / 1e9:.0f} GB GPUs "
          f"(U = {i['utilization']} x HBM, reserve {i['reserve_bytes'] / 1e9:.0f} GB, {i['concurrency']} "
          f"requests per GPU, chunk {i['chunk']}, KV {i['kv_dtype_bytes']} B, experts "
          f"{i['expert_bytes']} B/param, the rest {i['non_expert_bytes']} B/param)")  # fmt: skip
    for f in r["formula"]:
        print(f"  {f}")
    for a in r["assumptions"]:
        print(f"  assumed: {a}")
    for model, src in r["weights"].items():
        print(f"  {model}: {src}")
    print(
        f"{'model':<15}{'context':>9}{'full KV GB':>11}{'full EP':>8}{'hybrid KV GB':>13}{'hybrid EP':>10}  "
    )
    for row in r["rows"]:
        mark = "hybrid halves EP" if row["hybrid_halves"] else ""
        if row["hybrid_ep"] is None:
            mark = "neither fits" if row["full_ep"] is None else "hybrid does not fit"
        elif row["full_ep"] is None:
            mark += " (full does not fit)"
        elif row["full_over_hybrid"] != 1:
            mark = f"{row['full_over_hybrid']:.3g}x " + mark
        print(f"{row['model']:<15}{row['context']:>9,}{row['full_kv_gb']:>11.1f}{row['full_ep'] or 'none':>8}"
              f"{row['hybrid_kv_gb']:>13.1f}{row['hybrid_ep'] or 'none':>10}  {mark}")  # fmt: skip


# -- part 4: the simulator ------------------------------------------------------------------------------
SIM_KEYS = ("prefill_ep", "prefill", "prefill_gpus", "prefill_token_us", "device_kv_gb", "requests",
            "hit_rate", "ttft_p50", "ttft_p90", "prompt_tok_s", "prefill_utilization", "load", "time_scale")  # fmt: skip


def run_sim_part(s: Settings, trace: str = CONVERSATION) -> dict[str, Any]:
    """EP N x 16/N instances against EP N/2 x 32/N for each of ``s.sim_eps`` and ``s.sim_loads``."""
    from swaserve.sim import workload as wl
    from swaserve.sim.ep import EPSetup, compare, hardware_line
    from swaserve.sim.run import deployment

    dep, setup = deployment("mimo-v2-flash-h200"), EPSetup()
    work = wl.load(trace, s.sim_limit)
    pairs = []
    for ep in s.sim_eps:
        for load in s.sim_loads:
            deps, rows = compare(work, SIM_GPUS // ep, 2, "cache_aware", dep, ep, setup, load=load)
            n, half = ({k: r[k] for k in SIM_KEYS} for r in rows)
            pairs.append({
                "ep": ep, "load": load, "ep_n": n, "ep_half": half,
                "describe": [d.describe() for d in deps],
                "prompt_tok_s_ratio": half["prompt_tok_s"] / n["prompt_tok_s"] if n["prompt_tok_s"] else None,
                "ttft_p90_ratio": half["ttft_p90"] / n["ttft_p90"] if n["ttft_p90"] else None,
            })  # fmt: skip
    return {"trace": trace, "requests": s.sim_limit, "deployment": dep.name, "gpus": SIM_GPUS,
            "decode": 2, "policy": "cache_aware", "hardware": hardware_line(setup), "pairs": pairs}  # fmt: skip


def print_sim(r: dict[str, Any]) -> None:
    print(
        f"\nPart 4: simulated cluster, {r['deployment']}, {r['trace']} first {r['requests']} requests, "
        f"{r['gpus']} prefill GPUs as EP N x {r['gpus']}/N instances vs EP N/2 x twice as many, same "
        f"arrivals (the time scale offering `load` to EP N), {r['policy']}, {r['decode']} decode instances"
    )
    print(f"  {r['hardware']}")
    seen: set[str] = set()
    for p in r["pairs"]:
        for line in p["describe"]:
            if line not in seen:
                seen.add(line)
                print("  " + line.replace("\n", "\n  "))
    print(f"{'load':>5} {'EP x inst':>10} {'us/tok':>7} {'KV GB/inst':>10} {'hit rate':>9} {'TTFT p50 s':>11} "
          f"{'TTFT p90 s':>11} {'prompt tok/s':>13} {'vs EP N':>8}")  # fmt: skip
    for p in r["pairs"]:
        for row, ratio in ((p["ep_n"], 1.0), (p["ep_half"], p["prompt_tok_s_ratio"])):
            print(f"{p['load']:>5} {row['prefill_ep']:>5} x {row['prefill']:<2} {row['prefill_token_us']:>7.2f} "
                  f"{row['device_kv_gb']:>10.1f} {row['hit_rate']:>9.3f} {row['ttft_p50']:>11.2f} "
                  f"{row['ttft_p90']:>11.2f} {row['prompt_tok_s']:>13,.0f} "
                  f"{'' if ratio is None else f'x{ratio:.3f}':>8}")  # fmt: skip


def main(
    json_path: Path | None = None, model: Path | None = None, s: Settings | None = None
) -> dict[str, Any]:
    """Run the four parts, print their tables, write ``json_path``; returns the result."""
    from swaserve.model.checkpoint import default_model_dir

    s = s or Settings()
    s = replace(s, ep_sizes=tuple(sorted({1, *s.ep_sizes})))  # EP 1 first: the baseline
    t0 = time.perf_counter()
    model_dir = Path(model) if model is not None else Path(default_model_dir())
    check_settings(model_dir, s)
    engine = run_engine_part(model_dir, s)
    print_engine(engine)
    plan = run_plan_part(s)
    print_plan(plan)
    sim = run_sim_part(s)
    print_sim(sim)
    wall = time.perf_counter() - t0
    print(f"\nwall: {wall:.1f} s")
    result = {"settings": asdict(s), "prefill": engine, "plan": plan, "sim": sim, "wall_s": round(wall, 1)}
    if json_path is not None:
        from swaserve.sim.run import write_json

        write_json(Path(json_path), result)
    return result
