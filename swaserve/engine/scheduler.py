"""Continuous batching with chunked prefill under a per-step token budget.

Each step: decoding requests first (one token each, so a long prefill never stalls them), then
requests still prefilling, in admission order (each gets the next chunk that fits the remaining
budget and the pools), then waiting requests are admitted, in arrival order (FCFS) or by
``routing.priority.ComputeAwarePriority`` (fewest uncached tokens first, aged by waiting time,
with a hard bound on waiting; the uncached count is the prefix cache's match when the request
arrived), while both pools can reserve their guaranteed pages and fewer than ``max_num_seqs`` run. A request that does not fit yet (e.g. a chat whose default max_tokens fills
the context) does not block smaller ones behind it, but only ``max_bypass`` requests may overtake
the head of the queue; then admission waits for the head, so it cannot starve. Prefill and decode
share a step (Sarathi-Serve, Agrawal et al. OSDI'24, "stall-free batching"); requests join and
leave between steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from swaserve.engine.request import Request, RequestStatus
from swaserve.kvcache.manager import KVCacheManager
from swaserve.routing.priority import ComputeAwarePriority


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + n)`` of ``req`` this step; sample if that reaches the end."""

    req: Request
    start: int
    n: int

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.req.num_tokens


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_bypass: int = 32,
        on_import: Callable[[Request], None] | None = None,
        priority: ComputeAwarePriority | None = None,
    ) -> None:
        """``on_import``: called when a request that arrives with its prompt's KV (decode role,
        ``req.kv_payload``) is admitted; it allocates the pages, copies the KV in and sets
        ``num_computed``. ``priority``: admission order of waiting requests (None: FCFS)."""
        self.priority = priority
        self._uncached: dict[str, tuple[int, int, int]] = {}  # rid -> (uncached, cached, arrival seq)
        self._seq = 0
        self.kv = kv
        self.on_import = on_import
        self.max_bypass = max_bypass
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)
        if self.priority is not None:
            cached = 0
            if self.kv.cache is not None and req.kv_payload is None:
                P = self.kv.page_size
                cached = self.kv.cache.match_length(req.prompt_token_ids, (req.num_prompt - 1) // P * P)[0]
            self._seq += 1
            self._uncached[req.request_id] = (req.num_prompt - cached, cached, self._seq)

    def _order_waiting(self, now: float) -> None:
        """Sort the waiting queue by the priority key at ``now``, arrival order among equals."""
        p = self.priority
        if p is None or len(self.waiting) < 2:
            return
        u = self._uncached

        def key(r: Request) -> tuple[tuple[int, float], int]:
            unc, cached, seq = u.get(r.request_id, (r.num_prompt, 0, 0))
            return p.key(r.arrival_time, unc, cached, now), seq

        self.waiting = deque(sorted(self.waiting, key=key))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        # decodes first (one token each, so a long prefill never stalls them), then prefill chunks
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        for req in decoding + prefilling:
            if budget == 0:
                break
            c = self._chunk(req, budget)
            if c is not None:
                chunks.append(c)
                budget -= c.n
        self._order_waiting(now)
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if i > 0 and self.waiting[0].bypassed >= self.max_bypass:
                break  # the head has waited long enough: nobody else overtakes it now
            req = self.waiting[i]
            imported = req.kv_payload is not None and not req.export_kv
            prompt = None if imported else req.prompt_token_ids  # imported KV: no cache lookup
            if not self.kv.admit(req.request_id, req.max_total_tokens, prompt):
                i += 1  # a request that fits may go ahead of one that does not (yet)
                continue
            if imported:
                if self.on_import is None:
                    raise RuntimeError("request with KV to import but no importer (internal error)")
                self.on_import(req)
            else:
                req.num_computed = req.cached_tokens = self.kv.hit_tokens(req.request_id)
            del self.waiting[i]
            self._uncached.pop(req.request_id, None)
            if i > 0:
                self.waiting[0].bypassed += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            c = self._chunk(req, budget)
            if c is not None:
                chunks.append(c)
                budget -= c.n
        for c in chunks:
            if c.req.first_scheduled_time is None:
                c.req.first_scheduled_time = now
        return chunks

    def _chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        start = req.num_computed
        want = min(req.num_tokens - start, budget)
        n = self.kv.max_chunk(req.request_id, start, start + want)
        if n == 0:
            return None
        if not self.kv.allocate(req.request_id, start, start + n):
            raise RuntimeError("allocation failed after max_chunk said it fits (internal error)")
        return ScheduledChunk(req, start, n)

    def finish(self, req: Request) -> None:
        """Remove a running or waiting request and free its pages."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._uncached.pop(req.request_id, None)
        was_running = req.status == RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id, req.token_slice(0, req.num_computed) if was_running else None)
