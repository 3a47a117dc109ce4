"""The scheduler's incremental waiting order (``WaitingQueue``) against the full sort per step it
replaced: the previous ``Scheduler`` is kept here (``SortingScheduler``; since then given the
same chunk-level preemption of prefills in progress, over its own sorted keys), and both run the
same random sequences of add (with and without a prefix-cache hit, with imported KV), step (time
forwards, sometimes backwards), abort of a waiting request and finish of a running one. At every
step the waiting order, the chunks scheduled, the running set and the ``bypassed`` counters must be
identical.

Exactness: the old key is ``prefill_s - w * (now - arrival)``, the new one ``prefill_s + w *
arrival``; equal orders in exact arithmetic, but floating point may round two keys within an ulp of
each other differently. The property test therefore uses a cost model, weights and clock grid that
are dyadic (every key is computed exactly), which makes ties (same work, same arrival; or work
difference exactly compensated by waiting) common; a seeded test with a real preset and arbitrary
float times checks the realistic case.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swaserve.engine.request import Request, RequestStatus
from swaserve.engine.scheduler import ScheduledChunk, Scheduler, WaitingQueue
from swaserve.engine.types import SamplingParams
from swaserve.kvcache.manager import Admission
from swaserve.sched.cost import CostModel, preset
from swaserve.sched.priority import ComputeAwarePriority

# dyadic coefficients: every prefill_s, static key and aged key below is exact in binary floating point
DYADIC = CostModel("dyadic", 2.0**-3, 2.0**-6, 2.0**-10, 0.0, 0.0, 0.0)
IMPORTED = object()  # stands for a KVPayload (decode role): the fake importer only checks it is set


class SortingScheduler(Scheduler):
    """The scheduler before ``WaitingQueue``: sorts the whole waiting deque every step (reference)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._uncached: dict[str, tuple[int, int, int]] = {}  # rid -> (uncached, cached, arrival seq)
        self._seq = 0
        self.waiting: deque[Request] = deque()  # type: ignore[assignment]

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
            return self._key(r, unc, cached, now), seq

        self.waiting = deque(sorted(self.waiting, key=key))

    def _key(self, r: Request, uncached: int, cached: int, now: float) -> tuple[int, float]:
        """ComputeAwarePriority.key as it was, inlined: independent of the code under test."""
        p = self.priority
        assert p is not None
        waited = now - r.arrival_time
        if waited >= p.max_wait_s:
            return (0, r.arrival_time)
        return (1, p.cost.prefill_s(uncached, cached) - p.wait_weight * waited)

    def schedule(self, now: float) -> list[ScheduledChunk]:
        budget = self.budget
        chunks: list[ScheduledChunk] = []
        decoding = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        budget = self._run_chunks(decoding, budget, chunks)
        self._order_waiting(now)
        if self.priority is not None and prefilling:  # chunk-level preemption (module docstring)
            keys = {r: self._key(r, r.num_tokens - r.num_computed, r.num_computed, now) for r in prefilling}
            prefilling.sort(key=keys.__getitem__)
            budget = self._admit_sorted(now, budget, chunks, keys[prefilling[0]])
        budget = self._run_chunks(prefilling, budget, chunks)
        self._admit_sorted(now, budget, chunks, None)
        for c in chunks:
            if c.req.first_scheduled_time is None:
                c.req.first_scheduled_time = now
        return chunks

    def _admit_sorted(
        self, now: float, budget: int, chunks: list[ScheduledChunk], below: tuple[int, float] | None
    ) -> int:
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            if i > 0 and self.waiting[0].bypassed >= self.max_bypass:
                break
            req = self.waiting[i]
            if below is not None:
                unc, cached, _ = self._uncached.get(req.request_id, (req.num_prompt, 0, 0))
                if self._key(req, unc, cached, now) >= below:
                    break
            imported = req.kv_payload is not None and not req.export_kv
            prompt = None if imported else req.prompt_token_ids
            adm = self.kv.admit(req.request_id, req.max_total_tokens, prompt)
            if adm is None:
                i += 1
                continue
            if imported:
                assert self.on_import is not None
                self.on_import(req)
            else:
                req.num_computed = req.cached_tokens = adm.hit_tokens
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
        return budget

    def finish(self, req: Request) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._uncached.pop(req.request_id, None)
        was_running = req.status == RequestStatus.RUNNING
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id, req.token_slice(0, req.num_computed) if was_running else None)


class FakeCache:
    def match_length(self, tokens: list[int], limit: int) -> tuple[int]:
        return (min(tokens[0], limit),)  # the first token says how many tokens the cache holds


class FakeKV:
    """A pool of ``capacity`` tokens, reserved whole at admission; every chunk fits."""

    page_size = 4

    def __init__(self, capacity: int, cache: bool) -> None:
        self.capacity = capacity
        self.cache = FakeCache() if cache else None
        self.held: dict[str, int] = {}

    def admit(
        self, rid: str, max_total_tokens: int, prompt: list[int] | None, l3_tokens: int = 0
    ) -> Admission | None:
        if sum(self.held.values()) + max_total_tokens > self.capacity:
            return None
        self.held[rid] = max_total_tokens
        P = self.page_size
        hit = 0
        if prompt is not None and self.cache is not None:
            hit = self.cache.match_length(prompt, (len(prompt) - 1) // P * P)[0]
        return Admission(hit_tokens=hit)

    def max_chunk(self, rid: str, start: int, end: int) -> int:
        return end - start

    def allocate(self, rid: str, start: int, end: int) -> bool:
        return rid in self.held

    def free(self, rid: str, tokens: list[int] | None) -> None:
        self.held.pop(rid, None)


def import_kv(req: Request) -> None:
    assert req.kv_payload is IMPORTED
    req.num_computed = req.num_prompt
    req.kv_payload = None


class Twin:
    """One side of the comparison: a scheduler, its fake pool and its own request objects."""

    def __init__(
        self, cls: type[Scheduler], priority: ComputeAwarePriority | None, cfg: dict[str, Any]
    ) -> None:
        kv = FakeKV(cfg["capacity"], cfg["cache"])
        self.sched = cls(
            kv,  # type: ignore[arg-type]
            cfg["max_num_seqs"],
            cfg["budget"],
            max_bypass=cfg["max_bypass"],
            on_import=import_kv,
            priority=priority,
        )
        self.reqs: dict[str, Request] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int, arrival: float, imported: bool) -> None:
        req = Request(
            rid, list(prompt), SamplingParams(max_tokens=max_tokens), arrival, len(prompt) + max_tokens
        )
        if imported:
            req.kv_payload = IMPORTED  # type: ignore[assignment]
            req.output_token_ids.append(1)  # sampled by the prefill worker
        self.reqs[rid] = req
        self.sched.add(req)

    def order(self, now: float) -> list[str]:
        """The waiting order at ``now``, as ``schedule(now)`` will see it (idempotent)."""
        s = self.sched
        if isinstance(s, SortingScheduler):
            s._order_waiting(now)
        else:
            s.waiting.order(now)
        return [r.request_id for r in s.waiting]

    def step(self, now: float) -> list[tuple[str, int, int]]:
        """``schedule(now)`` then what the engine does with the chunks; returns them."""
        chunks = self.sched.schedule(now)
        for c in chunks:
            c.req.num_computed = c.start + c.n
            if c.samples:
                c.req.output_token_ids.append(1)
                if len(c.req.output_token_ids) >= c.req.params.max_tokens:
                    self.sched.finish(c.req)
        return [(c.req.request_id, c.start, c.n) for c in chunks]

    def state(self) -> tuple[list[str], list[str], dict[str, tuple[int, str, int]]]:
        """Waiting (as a set: between steps the old deque is sorted only up to the last step),
        running, and each request's ``bypassed``, status and progress."""
        s = self.sched
        return (
            sorted(r.request_id for r in s.waiting),
            [r.request_id for r in s.running],
            {rid: (r.bypassed, r.status.value, r.num_computed) for rid, r in self.reqs.items()},
        )


def replay(priority: ComputeAwarePriority | None, cfg: dict[str, Any], ops: list[tuple[Any, ...]]) -> int:
    """Run ``ops`` on both schedulers, asserting the same behaviour at every step; returns the number
    of admissions (to check the sequence did something)."""
    old, new = Twin(SortingScheduler, priority, cfg), Twin(Scheduler, priority, cfg)
    now, n = 0.0, 0
    admitted = 0
    for op in ops:
        if op[0] == "add":
            _, plen, hint, offset, imported, max_tokens = op
            n += 1
            prompt = [hint] + [7] * (plen - 1)
            for t in (old, new):
                t.add(f"r{n}", prompt, max_tokens, now + offset, imported)
        elif op[0] == "step":
            now += op[1]
            want = old.order(now)
            assert new.order(now) == want
            chunks = old.step(now)
            assert new.step(now) == chunks
            assert [r.request_id for r in new.sched.waiting] == [r.request_id for r in old.sched.waiting]
            admitted += len(set(want) - {r.request_id for r in old.sched.waiting})  # left by admission
        else:  # abort a waiting request, or finish a running one, chosen by index
            _, which, k = op
            pool = sorted(r.request_id for r in old.sched.waiting if which == "abort") or sorted(
                r.request_id for r in old.sched.running if which == "finish"
            )
            if pool:
                rid = pool[k % len(pool)]
                for t in (old, new):
                    t.sched.finish(t.reqs[rid])
        if op[0] != "add":
            assert new.state() == old.state()
    return admitted


# times on a 1/8 s grid, weights powers of two: every key exact
grid = st.integers(-16, 48).map(lambda k: k / 8)
add_op = st.tuples(
    st.just("add"),
    st.integers(1, 40),  # prompt length
    st.integers(0, 40),  # prefix-cache hint (capped at whole pages below the prompt's end)
    grid,  # arrival - now (negative: arrived earlier, e.g. a prefilled request from another worker)
    st.booleans(),  # imported KV (decode role)
    st.integers(1, 5),  # max_tokens
)
step_op = st.tuples(st.just("step"), st.one_of(grid, st.integers(0, 8).map(float)))
end_op = st.tuples(st.just("end"), st.sampled_from(["abort", "finish"]), st.integers(0, 1000))
priorities = st.one_of(
    st.none(),
    st.builds(
        ComputeAwarePriority,
        st.just(DYADIC),
        st.sampled_from([0.0, 0.5, 2.0, 5.0, 1e6]),
        st.sampled_from([0.0, 0.25, 1.0, 4.0]),
    ),
)
configs = st.fixed_dictionaries(
    {
        "capacity": st.integers(10, 120),
        "cache": st.booleans(),
        "max_num_seqs": st.integers(1, 4),
        "budget": st.integers(1, 64),
        "max_bypass": st.sampled_from([0, 1, 2, 32]),
    }
)


@settings(max_examples=300, deadline=None)
@given(priorities, configs, st.lists(st.one_of(add_op, add_op, step_op, step_op, end_op), max_size=120))
def test_incremental_order_equals_full_sort(
    priority: ComputeAwarePriority | None, cfg: dict[str, Any], ops: list[tuple[Any, ...]]
) -> None:
    replay(priority, cfg, ops)


@pytest.mark.parametrize("seed", range(4))
def test_incremental_order_equals_full_sort_real_cost_model(seed: int) -> None:
    """A real preset, the default weight (0.1, not dyadic) and arbitrary float times."""
    rng = random.Random(seed)
    priority = ComputeAwarePriority(preset("mimo-v2-flash-h200"), max_wait_s=rng.choice([0.05, 0.3]))
    cfg = {"capacity": 400, "cache": True, "max_num_seqs": 3, "budget": 48, "max_bypass": 2}
    ops: list[tuple[Any, ...]] = []
    for _ in range(1500):
        x = rng.random()
        if x < 0.45:
            plen = rng.randrange(1, 120)
            ops.append(("add", plen, rng.randrange(0, 120), rng.uniform(-0.5, 0.05), rng.random() < 0.2, 3))
        elif x < 0.9:
            ops.append(("step", rng.uniform(0.0, 0.05)))
        else:
            ops.append(("end", rng.choice(["abort", "finish"]), rng.randrange(1000)))
    assert replay(priority, cfg, ops) > 100


def entry_order(q: WaitingQueue) -> list[str]:
    return [r.request_id for r in q]


def req(rid: str, arrival: float, n: int = 4) -> Request:
    return Request(rid, [5] * n, SamplingParams(max_tokens=1), arrival, n + 1)


def test_waiting_queue_compute_order_overdue_and_clock_going_back() -> None:
    pr = ComputeAwarePriority(
        CostModel("unit", 0.0, 1.0, 0.0, 0.0, 0.0, 0.0), max_wait_s=10.0, wait_weight=0.5
    )
    q = WaitingQueue(pr)
    rs = {r.request_id: r for r in (req("long", 0.0), req("short", 4.0), req("mid", 2.0), req("twin", 4.0))}
    q.add(rs["long"], uncached=8)  # static key 8 + 0.5 * 0 = 8
    q.add(rs["short"], uncached=1)  # 1 + 2 = 3
    q.add(rs["mid"], uncached=4)  # 4 + 1 = 5
    q.add(rs["twin"], uncached=1)  # 3, added after short: behind it
    q.order(5.0)
    assert entry_order(q) == ["short", "twin", "mid", "long"] and len(q) == 4
    q.order(10.0)  # long waited 10 s: overdue, first
    assert entry_order(q) == ["long", "short", "twin", "mid"]
    late = req("late", 1.0)  # arrived at 1 but only added now (e.g. forwarded by a prefill worker)
    q.add(late, uncached=100)
    q.order(12.0)  # late (11 s) and mid (10 s) overdue too, in arrival order
    assert entry_order(q) == ["long", "late", "mid", "short", "twin"]
    q.order(5.0)  # the clock went back: nobody is overdue
    assert entry_order(q) == ["short", "twin", "mid", "long", "late"]
    q.order(12.0)
    assert q.pop(1).request_id == "late" and q.pop(3).request_id == "twin"
    assert entry_order(q) == ["long", "mid", "short"] and q[2].request_id == "short"
    assert q.remove(rs["mid"]) and not q.remove(rs["mid"]) and rs["mid"] not in q
    assert q.remove(rs["short"]) and entry_order(q) == ["long"]
    with pytest.raises(ValueError, match="already waiting"):
        q.add(rs["long"], uncached=8)
    with pytest.raises(IndexError):
        q[1]


def test_waiting_queue_fcfs_is_order_of_add() -> None:
    q = WaitingQueue(None)
    rs = [req(f"r{k}", arrival=float(10 - k)) for k in range(5)]  # arrival times going back
    for k, r in enumerate(rs):
        q.add(r, uncached=100 - k)  # ignored
    q.order(100.0)
    assert entry_order(q) == ["r0", "r1", "r2", "r3", "r4"]
    assert q.pop(2).request_id == "r2" and q.remove(rs[0]) and not q.remove(rs[2])
    assert entry_order(q) == ["r1", "r3", "r4"] and q[0] is rs[1]


def test_abort_of_a_waiting_request_and_imported_kv_in_the_scheduler() -> None:
    """Through ``Scheduler``: an imported request is ordered by its whole prompt (no cache lookup),
    an aborted waiting request leaves the order and frees nothing it did not hold."""
    pr = ComputeAwarePriority(DYADIC, max_wait_s=100.0, wait_weight=0.0)
    kv = FakeKV(capacity=1000, cache=True)
    s = Scheduler(kv, 1, 64, on_import=import_kv, priority=pr)  # type: ignore[arg-type]
    rs: dict[str, Request] = {}
    for rid, hint, plen, imported in [
        ("a", 0, 20, False),
        ("b", 16, 20, False),
        ("c", 16, 12, True),
        ("d", 0, 8, False),
    ]:
        rs[rid] = r = Request(rid, [hint] + [7] * (plen - 1), SamplingParams(max_tokens=2), 0.0, plen + 2)
        if imported:
            r.kv_payload = IMPORTED  # type: ignore[assignment]
            r.output_token_ids.append(1)
        s.add(r)
    s.waiting.order(0.0)
    # b: 4 uncached after 16 cached; d: 8; c: 12 (imported: no cache lookup; else 4 after 8 would
    # put it first); a: 20
    assert [r.request_id for r in s.waiting] == ["b", "d", "c", "a"]
    s.finish(rs["d"])  # abort while waiting
    assert rs["d"].status == RequestStatus.FINISHED and "d" not in kv.held
    assert [(c.req.request_id, c.start, c.n) for c in s.schedule(0.0)] == [("b", 16, 4)]
    assert [r.request_id for r in s.waiting] == ["c", "a"]
    s.finish(rs["b"])
    assert [(c.req.request_id, c.start, c.n) for c in s.schedule(1.0)] == [("c", 12, 1)]  # decodes
    assert rs["c"].kv_payload is None and s.has_work()
