"""Simulated prefill and decode instances: the real ``KVCacheManager`` (radix cache, pools, host tier;
page accounting, no tensors) and the real priority queue, with step times from a ``CostModel``.
A prefill instance runs one request at a time (``cost.prefill_s(uncached, cached)``), in chunks as
the engine does; a decode instance runs continuous batching (``cost.decode_step_s``).

Design notes: docs/DESIGN.md#siminstancespy"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from swaserve.config import EngineConfig, ModelConfig
from swaserve.kvcache.arena import arena_layout
from swaserve.kvcache.manager import KVCacheManager
from swaserve.kvcache.sizing import host_plan, plan_pools
from swaserve.routing.load import Lease
from swaserve.sched.cost import CostModel
from swaserve.sched.priority import ComputeAwarePriority, PriorityQueue
from swaserve.sim.l3 import SimL3
from swaserve.sim.workload import SimRequest


@dataclass
class Job:
    """A request on its way through the simulated cluster (times in simulated seconds)."""

    req: SimRequest
    arrival: float
    prefill: str = ""
    decode: str = ""
    lease: Lease | None = None
    decode_lease: Lease | None = None
    prompt: list[int] | None = field(default=None, repr=False)
    est_cached: int = 0  # what the router expected
    local_cached: int = 0  # what the instance's cache held at enqueue (priority key)
    cached: int = 0  # what admission actually reused
    from_host: int = 0
    from_l3: int = 0  # of ``cached``, fetched from L3 for it
    prefill_start: float = 0.0
    first_token: float = 0.0
    done: float = 0.0
    generated: int = 0
    context: int = 0


class PrefillSim:
    """Args:
    name: instance id. model: shape (page bytes, window). cost: step times.
    device_bytes, host_bytes: KV cache budgets. priority: queue order (None: FCFS).
    page_size, chunk: as the engine's ``page_size`` / ``max_num_batched_tokens``.
    """

    def __init__(
        self,
        name: str,
        model: ModelConfig,
        cost: CostModel,
        device_bytes: int,
        host_bytes: int = 0,
        priority: ComputeAwarePriority | None = None,
        page_size: int = 16,
        chunk: int = 8192,
        dtype_bytes: int = 2,
        l3: SimL3 | None = None,
    ) -> None:
        ecfg = EngineConfig(
            page_size=page_size,
            kv_cache_memory=device_bytes,
            max_num_seqs=1,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=True,
        )
        # as the engine: one arena both pools draw from, split by the traffic (no tensors here)
        arena = (
            arena_layout(model, page_size, dtype_bytes) if model.full_layers and model.swa_layers else None
        )
        plan = plan_pools(model, ecfg, dtype_bytes, shared=arena is not None, arena=arena)
        host = host_plan(plan, host_bytes) if host_bytes > 0 else None
        self.kv = KVCacheManager(
            plan, page_size, model.window, "hybrid", len(model.full_layers), len(model.swa_layers),
            prefix_caching=True, host_pages=host, host_bytes=host_bytes if plan.shared_bytes and host_bytes else None,
        )  # fmt: skip
        self.name, self.cost, self.chunk, self.page_size = name, cost, chunk, page_size
        self.queue: PriorityQueue[Job] = PriorityQueue(priority)
        self.current: Job | None = None
        self.queued_tokens = 0  # uncached tokens waiting (heartbeat)
        self.busy_s = 0.0
        self.rejected = 0  # prompts that never fit the pools (computed without the cache)
        self.l3 = l3
        if l3 is not None:
            if not host_bytes:
                raise ValueError("an L3 tier needs a host tier (host bytes > 0)")
            assert self.kv.cache is not None
            l3.attach(self.kv.cache)

    def peek_cached(self, prompt: list[int]) -> int:
        """Tokens of ``prompt`` this instance's cache would reuse now (no lock taken)."""
        assert self.kv.cache is not None
        limit = (len(prompt) - 1) // self.page_size * self.page_size
        return self.kv.cache.match_length(prompt, limit)[0]

    def enqueue(self, job: Job) -> None:
        assert job.prompt is not None
        if self.queue.priority is not None:  # only the priority key needs it
            job.local_cached = self.peek_cached(job.prompt)
        uncached = job.req.prompt_len - job.local_cached
        self.queue.push(job, job.arrival, uncached, job.local_cached)
        self.queued_tokens += uncached

    def start_next(self, now: float) -> float | None:
        """Start the next queued request if idle; returns its completion time."""
        if self.current is not None:
            return None
        job = self.queue.pop(now)
        if job is None:
            return None
        self.queued_tokens -= job.req.prompt_len - job.local_cached
        self.current = job
        job.prefill_start = now
        fetched = 0
        if self.l3 is not None and job.prompt is not None:
            assert self.kv.cache is not None
            fetched = self.l3.extend(self.kv.cache, job.prompt)
        job.cached, job.from_host = self._run(job)
        job.from_l3 = min(fetched, job.from_host)
        job.from_host -= job.from_l3
        took = self.cost.prefill_s(job.req.prompt_len - job.cached, job.cached)
        took += self.cost.l3_fetch_s(job.from_l3)
        self.busy_s += took
        return now + took

    def _run(self, job: Job) -> tuple[int, int]:
        kv, prompt, rid = self.kv, job.prompt, job.req.rid
        assert prompt is not None
        n = len(prompt)
        adm = kv.admit(rid, n + 1, prompt)
        if adm is None:
            self.rejected += 1
            return 0, 0
        hit, from_host = adm.hit_tokens, adm.host_tokens
        start = hit
        while start < n:
            step = kv.max_chunk(rid, start, min(n, start + self.chunk))
            if step == 0 or not kv.allocate(rid, start, start + step):
                break  # cannot happen alone in the pools (admission reserved it); stop cleanly
            start += step
            if start < n:
                kv.cache_partial(rid, prompt[:start])
        kv.free(rid, prompt[:start])
        return hit, from_host

    def finish(self) -> Job:
        job, self.current = self.current, None
        assert job is not None
        job.prompt = None  # its tokens live on in the cache only
        return job


class DecodeSim:
    """Args: name. cost: step times. max_batch: running requests at most. kv_tokens: context
    tokens the running batch may hold (full-layer KV), at least one request's."""

    def __init__(self, name: str, cost: CostModel, max_batch: int = 256, kv_tokens: int = 10**9) -> None:
        self.name, self.cost, self.max_batch, self.kv_tokens = name, cost, max_batch, kv_tokens
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.held = 0  # context tokens of running requests, at their final length
        self.stepping = False
        self.busy_s = 0.0
        self.steps: list[tuple[float, int]] = []  # (seconds, tokens) of every step: ITL samples

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            job = self.waiting[0]
            need = job.req.prompt_len + job.req.output_len
            if self.running and self.held + need > self.kv_tokens:
                break
            self.waiting.popleft()
            self.running.append(job)
            self.held += need
            job.context = job.req.prompt_len + 1

    def step(self) -> float | None:
        """Begin a step over the running batch; returns its duration (None if nothing runs)."""
        self._admit()
        if not self.running:
            self.stepping = False
            return None
        self.stepping = True
        took = self.cost.decode_step_s(len(self.running), sum(j.context for j in self.running))
        self.busy_s += took
        return took

    def end_step(self, now: float, took: float) -> list[Job]:
        """Give each running request its token; returns the ones that finished."""
        done, still = [], []
        self.steps.append((took, len(self.running)))
        for j in self.running:
            j.generated += 1
            j.context += 1
            if j.generated >= j.req.output_len:
                j.done = now
                done.append(j)
                self.held -= j.req.prompt_len + j.req.output_len
            else:
                still.append(j)
        self.running = still
        return done

    @property
    def load_tokens(self) -> int:
        return self.held + sum(j.req.prompt_len + j.req.output_len for j in self.waiting)
