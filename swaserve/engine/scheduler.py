"""Continuous batching with chunked prefill under a per-step token budget.

Each step: decodes first, then prefills in progress, then waiting requests admitted FCFS or by
``sched.priority`` (prefills in progress then compete by their remaining work: chunk-level
preemption), while the pools can reserve their pages; at most ``max_bypass`` requests overtake a
blocked head. Prefill and decode share a step (Sarathi-Serve, Agrawal et al. OSDI'24,
"stall-free batching"); ``WaitingQueue`` keeps the order incrementally.
Design notes: docs/DESIGN.md#engineschedulerpy"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice

from swaserve.engine.request import Request, RequestStatus
from swaserve.kvcache.manager import KVCacheManager
from swaserve.sched.priority import ComputeAwarePriority


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + n)`` of ``req`` this step; sample if that reaches the end
    (with ``draft`` > 0: a verify chunk, the request's last token then its first ``draft`` drafts)."""

    req: Request
    start: int
    n: int
    draft: int = 0  # of the n rows, the last ``draft`` are draft tokens to verify (``req.spec_drafts``)
    # whether it reaches the request's end as scheduled (fixed here: the step appends tokens later)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", self.start + self.n - self.draft == self.req.num_tokens)


_Entry = tuple[float, int, Request]  # (sort key, sequence number of add: unique, breaks ties, request)


def _find(entries: list[_Entry], e: _Entry) -> int:
    """Index of ``e`` in the sorted ``entries`` (O(log n))."""
    i = bisect_left(entries, e)
    if i == len(entries) or entries[i][1] != e[1]:
        raise RuntimeError("waiting queue entry not found (internal error)")
    return i


class WaitingQueue:
    """Waiting requests in admission order, kept sorted as requests come and go.

    FCFS (``priority`` None): order of ``add``. ``ComputeAwarePriority``: the order of sorting by
    ``(priority.key(arrival, uncached, cached, now), sequence of add)`` at the ``now`` of the last
    ``order(now)``, i.e. overdue requests first in (arrival, sequence) order, then the others in
    (``priority.static_key``, sequence) order: their key is the static key minus
    ``wait_weight * now``, a term common to all, so their relative order never changes with time;
    only the overdue set grows, and it is a prefix in arrival order (``priority.overdue``).

    Invariant: ``_by_arrival`` holds every waiting request sorted by (arrival, sequence) (FCFS:
    (0, sequence)); ``_by_key`` holds exactly those not among the first ``_n_overdue`` of them,
    sorted by (static key, sequence); the queue is ``_by_arrival[:_n_overdue] + _by_key``.
    ``order(now)`` moves the boundary ``_n_overdue`` to the end of the requests overdue at ``now``
    (backwards too, if the clock went back). FCFS: everything is in the first part.

    Cost, n waiting: ``add``, ``pop``, ``remove`` O(log n) comparisons plus a list insert/delete
    (a memmove); ``order(now)`` O((m + 1) log n) for the m requests whose class changed; ``q[i]``
    O(1). In exact arithmetic the order equals the full sort's; in floating point the two forms of
    the key round differently, so two requests whose keys differ by a rounding error only may be
    taken either way (the full sort itself could swap such a pair from one step to the next).
    """

    def __init__(self, priority: ComputeAwarePriority | None = None) -> None:
        self.priority = priority
        self._by_arrival: list[_Entry] = []
        self._by_key: list[_Entry] = []
        self._n_overdue = 0
        self._entries: dict[Request, tuple[_Entry, _Entry | None]] = {}  # (arrival, key) entries
        self._seq = 0

    def __len__(self) -> int:
        return len(self._by_arrival)

    def __iter__(self) -> Iterator[Request]:
        """The requests in admission order (as of the last ``order``)."""
        for e in chain(islice(self._by_arrival, self._n_overdue), self._by_key):
            yield e[2]

    def __contains__(self, req: object) -> bool:
        return req in self._entries

    def __getitem__(self, i: int) -> Request:
        """The ``i``-th request in admission order, 0 <= i < len."""
        if not 0 <= i < len(self._by_arrival):
            raise IndexError(i)
        k = self._n_overdue
        return self._by_arrival[i][2] if i < k else self._by_key[i - k][2]

    def add(self, req: Request, uncached: int = 0, cached: int = 0) -> None:
        """Queue ``req`` (``uncached``/``cached`` prompt tokens: its priority; unused for FCFS)."""
        if req in self._entries:
            raise ValueError(f"request {req.request_id!r} is already waiting")
        self._seq += 1
        p = self.priority
        if p is None:
            a: _Entry = (0.0, self._seq, req)
            self._by_arrival.append(a)
            self._n_overdue += 1
            self._entries[req] = (a, None)
            return
        a = (req.arrival_time, self._seq, req)
        k: _Entry = (p.static_key(req.arrival_time, uncached, cached), self._seq, req)
        i = bisect_left(self._by_arrival, a)
        self._by_arrival.insert(i, a)
        if i < self._n_overdue:  # arrived before an overdue request: overdue too
            self._n_overdue += 1
        else:  # not overdue, or found so by the next ``order``
            insort(self._by_key, k)
        self._entries[req] = (a, k)

    def pop(self, i: int) -> Request:
        """Remove and return the ``i``-th request in admission order."""
        req = self[i]
        k = self._n_overdue
        if i < k:
            del self._by_arrival[i]
            self._n_overdue = k - 1
        else:
            del self._by_key[i - k]
            del self._by_arrival[_find(self._by_arrival, self._entries[req][0])]
        del self._entries[req]
        return req

    def remove(self, req: Request) -> bool:
        """Remove ``req`` if it is waiting; returns whether it was."""
        got = self._entries.pop(req, None)
        if got is None:
            return False
        a, key = got
        j = _find(self._by_arrival, a)
        del self._by_arrival[j]
        if j < self._n_overdue:
            self._n_overdue -= 1
        else:
            assert key is not None
            del self._by_key[_find(self._by_key, key)]
        return True

    def key(self, i: int, now: float) -> tuple[int, float]:
        """``ComputeAwarePriority.key`` at ``now`` of the ``i``-th request (as of ``order(now)``;
        compute priority only)."""
        p = self.priority
        assert p is not None
        k = self._n_overdue
        if i < k:
            return (0, self._by_arrival[i][0])
        return (1, self._by_key[i - k][0] - p.wait_weight * now)

    def order(self, now: float) -> None:
        """Bring the order to ``now``: move the requests overdue at ``now`` to the front."""
        p = self.priority
        if p is None:
            return
        arr, n = self._by_arrival, self._n_overdue
        while n > 0 and not p.overdue(arr[n - 1][0], now):  # the clock went back
            n -= 1
            key = self._entries[arr[n][2]][1]
            assert key is not None
            insort(self._by_key, key)
        while n < len(arr) and p.overdue(arr[n][0], now):
            key = self._entries[arr[n][2]][1]
            assert key is not None
            del self._by_key[_find(self._by_key, key)]
            n += 1
        self._n_overdue = n


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_bypass: int = 32,
        on_import: Callable[[Request], None] | None = None,
        priority: ComputeAwarePriority | None = None,
        lookahead: int = 0,
    ) -> None:
        """``on_import``: called when a request that arrives with its prompt's KV (decode role,
        ``req.kv_payload``) is admitted; it allocates the pages, copies the KV in and sets
        ``num_computed``. ``priority``: admission order of waiting requests (None: FCFS).
        ``lookahead`` (speculative decoding): a chunk that samples also gets pages for this many
        positions after it (the draft layers' rows), at most up to ``req.max_total_tokens``; a
        decode chunk carries the request's drafts (``ScheduledChunk.draft``)."""
        self.priority = priority
        self.lookahead = lookahead
        self.kv = kv
        self.on_import = on_import
        self.max_bypass = max_bypass
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting = WaitingQueue(priority)
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        cached = 0
        if (
            self.priority is not None
            and self.kv.cache is not None
            and req.kv_payload is None
            and req.params.prompt_logprobs is None
        ):
            P = self.kv.page_size
            cached = self.kv.cache.match_length(req.prompt_token_ids, (req.num_prompt - 1) // P * P)[0]
        self.waiting.add(req, req.num_prompt - cached, cached)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        # decodes first (one token each, so a long prefill never stalls them), then prefill chunks
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        budget = self._run_chunks(decoding, budget, chunks)
        self.waiting.order(now)
        p = self.priority
        if p is not None and prefilling:
            # compute priority: prefills in progress compete with waiting requests by remaining
            # work (chunk-level preemption; a paused prefill keeps its pages). Waiting requests
            # whose key is below every in-progress prefill's are admitted first.
            keys = {
                r: p.key(r.arrival_time, r.num_tokens - r.num_computed, r.num_computed, now)
                for r in prefilling
            }
            prefilling.sort(key=keys.__getitem__)  # stable: admission order among equal keys
            budget = self._admit(now, budget, chunks, below=keys[prefilling[0]])
        budget = self._run_chunks(prefilling, budget, chunks)
        self._admit(now, budget, chunks)
        for c in chunks:
            if c.req.first_scheduled_time is None:
                c.req.first_scheduled_time = now
        return chunks

    def _run_chunks(self, reqs: list[Request], budget: int, chunks: list[ScheduledChunk]) -> int:
        """The next chunk of each of ``reqs`` that fits ``budget``, in order; returns what is left."""
        for req in reqs:
            if budget == 0:
                break
            c = self._chunk(req, budget)
            if c is not None:
                chunks.append(c)
                budget -= c.n
        return budget

    def _admit(
        self, now: float, budget: int, chunks: list[ScheduledChunk], below: tuple[int, float] | None = None
    ) -> int:
        """Admit waiting requests in order (bypass rules: docs/DESIGN.md#engineschedulerpy), each with its
        first chunk, while ``budget`` and ``max_num_seqs`` allow; with ``below``, only requests
        whose priority key is smaller. Returns the budget left."""
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if i > 0 and self.waiting[0].bypassed >= self.max_bypass:
                break  # the head has waited long enough: nobody else overtakes it now
            if below is not None and self.waiting.key(i, now) >= below:
                break  # the queue is in key order: nobody further on is smaller
            req = self.waiting[i]
            imported = req.kv_payload is not None and not req.export_kv
            # no cache lookup for imported KV, nor where every prompt position must be computed
            prompt = None if imported or req.params.prompt_logprobs is not None else req.prompt_token_ids
            adm = self.kv.admit(req.request_id, req.max_total_tokens, prompt, req.l3_tokens)
            if adm is None:
                i += 1  # a request that fits may go ahead of one that does not (yet)
                continue
            if imported:
                if self.on_import is None:
                    raise RuntimeError("request with KV to import but no importer (internal error)")
                self.on_import(req)
            else:
                req.num_computed = req.cached_tokens = adm.hit_tokens
                req.cached_host_tokens = adm.host_tokens
            self.waiting.pop(i)
            if i > 0:
                self.waiting[0].bypassed += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            c = self._chunk(req, budget)
            if c is not None:
                chunks.append(c)
                budget -= c.n
        return budget

    def _chunk(self, req: Request, budget: int) -> ScheduledChunk | None:
        start = req.num_computed
        left = req.num_tokens - start
        # drafts: within the budget, and at positions < max_total_tokens (the full pool's guarantee)
        draft = min(len(req.spec_drafts), budget - 1, req.max_total_tokens - start - 1) if left == 1 else 0
        draft = max(0, draft)
        want = min(left + draft, budget)
        if req.media is not None and (stop := req.media_ready_end()) < req.num_tokens:
            want = min(want, stop - start)  # not into a media span whose embeddings have not come
            if want <= 0:
                return None
        room = 0  # positions past the chunk it samples whose pages it gets (``lookahead``)
        if self.lookahead and want == left + draft:
            room = max(0, min(self.lookahead, req.max_total_tokens - (start + want)))
        rid = req.request_id
        n = self.kv.max_chunk(rid, start, start + want + room)
        if n < want + room:  # not all of it: no lookahead, and no drafts
            room = 0
            if draft:
                draft, want = 0, 1
            n = min(n, want - 1) if want > 1 and n < want else min(n, want)
        else:
            n = want
        if n == 0:
            return None
        if not self.kv.allocate(rid, start, start + n + room):
            raise RuntimeError("allocation failed after max_chunk said it fits (internal error)")
        req.spec_end = start + n + room
        return ScheduledChunk(req, start, n, draft)

    def finish(self, req: Request) -> None:
        """Remove a running or waiting request and free its pages."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        was_running = req.status == RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id, req.token_slice(0, req.num_computed) if was_running else None)
