"""The cluster in simulated time: arrivals are routed by the real ``Dispatcher`` (prefix index,
load leases, policy, length buckets, all in-memory backends with the simulation's clock), prefill
and decode instances are ``sim.instances``. Events (arrival, prefill done, KV transfer done,
decode step done) run from one heap in time order.

TTFT is prefill completion minus arrival (the prefill instance streams the first token, as in
the real cluster); the KV then moves to the decode instance chosen at dispatch, taking
``cost.transfer_s``, and decoding produces the remaining ``output_len - 1`` tokens.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from swaserve.config import FULL, SWA, ModelConfig
from swaserve.kvcache.hashing import block_hashes
from swaserve.routing.buckets import LengthBuckets
from swaserve.routing.dispatch import Dispatcher
from swaserve.routing.events import apply_events
from swaserve.routing.index import IndexConfig, InMemoryPrefixIndex
from swaserve.routing.load import InMemoryLoadBook, WorkerReport
from swaserve.routing.policy import make_policy
from swaserve.sched.cost import CostModel
from swaserve.sched.priority import ComputeAwarePriority
from swaserve.sim.instances import DecodeSim, Job, PrefillSim
from swaserve.sim.l3 import SimL3
from swaserve.sim.workload import SimRequest, Workload

L3_NODE = "l3:sim"  # the simulated GCache node's name in the routers' index


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment.

    Attributes:
        prefill, decode: instance counts. policy: routing policy name (``routing.policy.POLICIES``).
        priority: prefill queue order, ``"fcfs"`` or ``"compute"`` (``ComputeAwarePriority``).
        cost: step costs. model: KV shape (page bytes, window).
        device_bytes, host_bytes: KV cache budget of each prefill instance.
        decode_batch, decode_kv_tokens: a decode instance's batch limits.
        time_scale: multiplies trace inter-arrival times. page_size, chunk: engine settings.
        buckets: prompt-length range per prefill instance index (None: one bucket).
        max_wait_s, wait_weight: ``ComputeAwarePriority``. policy_args: policy constructor args.
    """

    prefill: int
    decode: int
    policy: str
    cost: CostModel
    model: ModelConfig
    device_bytes: int
    host_bytes: int = 0
    priority: str = "fcfs"
    decode_batch: int = 256
    decode_kv_tokens: int = 10**9
    time_scale: float = 1.0
    page_size: int = 16
    chunk: int = 8192
    buckets: tuple[tuple[int, int], ...] | None = None
    max_wait_s: float = 30.0
    wait_weight: float = 0.1
    policy_args: dict[str, float | str] = field(default_factory=dict)
    index: IndexConfig = field(default_factory=IndexConfig)
    max_model_len: int | None = None  # longer requests (prompt + output) are refused, as the API does
    index_mode: str = "approximate"  # or "precise": the index follows the prefill caches' block events
    l3_bytes: int = 0  # a GCache (L3) tier shared by the prefill instances (needs host_bytes); 0: none
    l3_min_tokens: int = 256


@dataclass
class SimResult:
    policy: str
    priority: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    host_tokens: int
    ttft_s: list[float] = field(repr=False)
    steps: list[tuple[float, int]] = field(repr=False)  # decode steps: (seconds, tokens)
    e2e_s: list[float] = field(repr=False)
    decisions: dict[str, int]
    prefill_busy: float  # mean utilization of prefill instances until the last first token
    makespan_s: float
    wall_s: float
    rejected: int
    too_long: int = 0  # refused: prompt + output over the deployment's max_model_len
    l3_tokens: int = 0  # of cached_tokens, fetched from L3
    prefill_span_s: float = 0.0  # first arrival to the last first token

    def summary(self) -> dict[str, object]:
        def pct(xs: list[float], q: float) -> float:
            return round(float(np.percentile(xs, q)), 4) if xs else 0.0

        t = max(self.prompt_tokens, 1)
        itl = np.repeat([s for s, _ in self.steps], [n for _, n in self.steps]).tolist()
        return {
            "policy": self.policy,
            "priority": self.priority,
            "requests": self.requests,
            "hit_rate": round(self.cached_tokens / t, 4),
            "host_hit_rate": round(self.host_tokens / t, 4),
            "l3_hit_rate": round(self.l3_tokens / t, 4),
            "ttft_mean": round(float(np.mean(self.ttft_s)), 4) if self.ttft_s else 0.0,
            "ttft_p50": pct(self.ttft_s, 50),
            "ttft_p90": pct(self.ttft_s, 90),
            "ttft_p99": pct(self.ttft_s, 99),
            "itl_p50": pct(itl, 50),
            "itl_p90": pct(itl, 90),
            "e2e_p50": pct(self.e2e_s, 50),
            "prefill_utilization": round(self.prefill_busy, 4),
            "prompt_tok_s": round(self.prompt_tokens / self.prefill_span_s, 1)
            if self.prefill_span_s
            else 0.0,
            "decisions": self.decisions,
            "rejected": self.rejected,
            "too_long": self.too_long,
            "makespan_s": round(self.makespan_s, 2),
            "wall_s": round(self.wall_s, 2),
        }


class Simulator:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.now: float = 0.0
        prio = (
            ComputeAwarePriority(cfg.cost, cfg.max_wait_s, cfg.wait_weight)
            if cfg.priority == "compute"
            else None
        )
        if cfg.priority not in ("fcfs", "compute"):
            raise ValueError(f"priority must be 'fcfs' or 'compute', got {cfg.priority!r}")
        if cfg.index_mode not in ("approximate", "precise"):
            raise ValueError(f"index mode must be 'approximate' or 'precise', got {cfg.index_mode!r}")
        self.precise = cfg.index_mode == "precise"
        self.l3: SimL3 | None = None
        if cfg.l3_bytes:
            probe = PrefillSim(
                "probe", cfg.model, cfg.cost, cfg.device_bytes, 0, None, cfg.page_size, cfg.chunk
            )
            plan, wp = (
                probe.kv.plan,
                cfg.model.window // cfg.page_size + (cfg.model.window % cfg.page_size > 0),
            )
            self.l3 = SimL3(
                cfg.l3_bytes, cfg.page_size, wp, {FULL: plan.full_page_bytes, SWA: plan.swa_page_bytes},
                cfg.l3_min_tokens, lambda: self.now,
            )  # fmt: skip
        self.prefill = {
            f"p{i}": PrefillSim(
                f"p{i}",
                cfg.model,
                cfg.cost,
                cfg.device_bytes,
                cfg.host_bytes,
                prio,
                cfg.page_size,
                cfg.chunk,
                l3=self.l3,
            )
            for i in range(cfg.prefill)
        }
        self.decode = {
            f"d{i}": DecodeSim(f"d{i}", cfg.cost, cfg.decode_batch, cfg.decode_kv_tokens)
            for i in range(cfg.decode)
        }
        self.now = 0.0
        buckets = LengthBuckets()
        if cfg.buckets:
            for i, (lo, hi) in enumerate(cfg.buckets):
                buckets.set(f"p{i}", lo, hi)
        self.book = InMemoryLoadBook()
        self.dispatcher = Dispatcher(
            InMemoryPrefixIndex(cfg.index), self.book, make_policy(cfg.policy, **cfg.policy_args), cfg.cost,
            buckets, block_tokens=1, clock=lambda: self.now,
        )  # fmt: skip
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.finished: list[Job] = []
        self._done: set[str] = set()
        self.too_long = 0  # requests refused for exceeding max_model_len
        self._blocked: dict[str, list[SimRequest]] = {}  # rid -> requests waiting for it (closed loop)
        self.decisions: Counter[str] = Counter()

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def _heartbeat(self, p: PrefillSim) -> None:
        running = p.current.req.prompt_len if p.current else 0
        rep = WorkerReport(
            p.queued_tokens, running, int(p.current is not None), len(p.queue), at=self.now,
            queue_order=self.cfg.priority,
        )  # fmt: skip
        self.book.heartbeat(p.name, rep, ttl_s=1e18)

    def run(self, work: Workload) -> SimResult:
        """Simulate every request of ``work``; returns the result (``summary()`` for JSON)."""
        wall = time.perf_counter()
        self.dispatcher.block_tokens = work.block_tokens
        if self.precise:  # the workers' events, at the index's block size, over their real tokens
            for p in self.prefill.values():
                p.kv.enable_cache_events(work.block_tokens)
        t0 = min(r.arrival for r in work.requests)
        for r in work.requests:
            self._at((r.arrival - t0) * self.cfg.time_scale, functools.partial(self._arrive_request, r))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        jobs = self.finished
        span = max((j.done for j in jobs), default=0.0)
        prefill_span = max((j.first_token for j in jobs), default=0.0)
        busy = sum(p.busy_s for p in self.prefill.values()) / max(prefill_span * len(self.prefill), 1e-9)
        return SimResult(
            self.cfg.policy, self.cfg.priority, len(jobs), sum(j.req.prompt_len for j in jobs),
            sum(j.cached for j in jobs), sum(j.from_host for j in jobs),
            [j.first_token - j.arrival for j in jobs], [s for d in self.decode.values() for s in d.steps],
            [j.done - j.arrival for j in jobs], dict(self.decisions), busy, span,
            time.perf_counter() - wall, sum(p.rejected for p in self.prefill.values()), self.too_long,
            sum(j.from_l3 for j in jobs), prefill_span,
        )  # fmt: skip

    # -- events -----------------------------------------------------------------------------------
    def _arrive_request(self, r: SimRequest) -> None:
        if r.after is not None and r.after not in self._done:
            self._blocked.setdefault(r.after, []).append(r)  # sent when its predecessor is done
            return
        limit = self.cfg.max_model_len
        if limit is not None and r.prompt_len + r.output_len > limit:
            self.too_long += 1  # the API would answer 400: nothing runs, its session goes on
            self._done.add(r.rid)
            for nxt in self._blocked.pop(r.rid, []):
                self._at(self.now, functools.partial(self._arrive_request, nxt))
            return
        job = Job(r, self.now)
        job.prompt = r.prompt()
        # precise: the keys the workers' events carry (chains of the real tokens); approximate:
        # the workload's own chains (trace hash ids: the same identity, no hashing of tokens)
        hashes = block_hashes(job.prompt, self.dispatcher.block_tokens) if self.precise else r.hashes
        l3_nodes = [L3_NODE] if self.precise and self.l3 is not None else []
        route = self.dispatcher.route_prefill(
            r.rid, r.prompt_len, hashes, self.prefill.keys(), record=not self.precise, l3_nodes=l3_nodes
        )
        d = route.decision
        self.decisions[d.reason + ("+fallback" if d.fallback else "")] += 1
        job.prefill, job.lease, job.est_cached = d.instance, route.lease, d.cached_tokens
        job.decode_lease = self.dispatcher.route_decode(
            r.rid, r.prompt_len + r.output_len, self.decode.keys()
        )
        job.decode = job.decode_lease.instance
        p = self.prefill[d.instance]
        p.enqueue(job)
        self._heartbeat(p)
        self._kick_prefill(p)

    def _kick_prefill(self, p: PrefillSim) -> None:
        end = p.start_next(self.now)
        if self.precise:  # what its cache stored and evicted while admitting and running it
            apply_events(self.dispatcher.index, p.name, p.kv.drain_cache_events(self.now), self.now)
            if self.l3 is not None:  # and what its write-backs did to L3 (the node's events)
                apply_events(self.dispatcher.index, L3_NODE, self.l3.drain_events(), self.now)
        if end is not None:
            self._at(end, lambda: self._prefill_done(p))

    def _prefill_done(self, p: PrefillSim) -> None:
        job = p.finish()
        assert job.lease is not None
        self.dispatcher.release(job.lease)
        job.first_token = self.now
        job.generated = 1
        self._heartbeat(p)
        self._kick_prefill(p)
        if job.req.output_len <= 1:
            self._finish(job)
            return
        self._at(self.now + self.cfg.cost.transfer_s(job.req.prompt_len), lambda: self._to_decode(job))

    def _to_decode(self, job: Job) -> None:
        d = self.decode[job.decode]
        d.add(job)
        if not d.stepping:
            self._decode_step(d)

    def _decode_step(self, d: DecodeSim) -> None:
        took = d.step()
        if took is not None:
            self._at(self.now + took, lambda: self._decode_done(d, took))

    def _decode_done(self, d: DecodeSim, took: float) -> None:
        for job in d.end_step(self.now, took):
            self._finish(job)
        self._decode_step(d)

    def _finish(self, job: Job) -> None:
        if job.done == 0.0:
            job.done = self.now
        self._done.add(job.req.rid)
        for r in self._blocked.pop(job.req.rid, []):
            self._at(self.now, functools.partial(self._arrive_request, r))
        if job.decode_lease is not None:
            self.dispatcher.release(job.decode_lease)
        self.finished.append(job)
