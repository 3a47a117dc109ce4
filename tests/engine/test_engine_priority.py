"""Compute-aware admission order in the engine's scheduler: shortest uncached work first, aged,
with the starvation bound, and outputs unchanged by the order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams
from swaserve.kvcache import invariants


def engine(tiny_dir: Path, policy: str, t: list[float], max_num_seqs: int, **kw: float) -> LLMEngine:
    """An engine with 64-token steps and the clock ``t[0]``."""
    cfg = EngineConfig(
        page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20, max_num_seqs=max_num_seqs,
        schedule_policy=policy, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return LLMEngine(tiny_dir, cfg, clock=lambda: t[0])


def run(
    tiny_dir: Path, policy: str, clock_steps: list[float], **kw: float
) -> tuple[list[str], dict[str, list[int]]]:
    """One running request at a time; returns the admission order and each request's tokens.
    ``clock_steps``: the engine clock's values, one per ``step`` (then stays at the last)."""
    t = [0.0]
    eng = engine(tiny_dir, policy, t, 1, **kw)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("first", list(range(10, 30)), params)
    eng.add_request("long", list(range(40, 140)), params)
    for k in range(3):
        eng.add_request(f"short{k}", list(range(200 + k, 210 + k)), params)
    order: list[str] = []
    out: dict[str, list[int]] = {}
    steps = iter(clock_steps)
    while eng.has_unfinished():
        t[0] = next(steps, t[0])
        for o in eng.step():
            if o.request_id not in out:
                order.append(o.request_id)
                out[o.request_id] = []
            out[o.request_id] += o.new_token_ids
    return order, out


def test_compute_priority_admits_short_first_and_keeps_outputs(tiny_dir: Path) -> None:
    fcfs_order, fcfs_out = run(tiny_dir, "fcfs", [0.0])
    assert fcfs_order == ["first", "long", "short0", "short1", "short2"]
    order, out = run(tiny_dir, "compute", [0.0])
    assert order == ["short0", "short1", "short2", "first", "long"]
    assert out == fcfs_out  # the order changes, not the tokens


def test_compute_priority_bound_lets_the_long_request_go_first(tiny_dir: Path) -> None:
    # the clock jumps past max_wait_s after the first admission: every waiting request is
    # overdue, and overdue requests run in arrival order
    order, _ = run(tiny_dir, "compute", [0.0, 100.0], priority_max_wait_s=10.0)
    assert order == ["short0", "first", "long", "short1", "short2"]


def test_bad_schedule_policy_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="schedule_policy"):
        LLMEngine(tiny_dir, EngineConfig(schedule_policy="lifo"))
    with pytest.raises(ValueError, match="cost model"):
        LLMEngine(tiny_dir, EngineConfig(schedule_policy="compute", cost_model="nope"))


def test_compute_priority_with_imported_kv_and_an_aborted_waiting_request(tiny_dir: Path) -> None:
    """Decode role: prefilled requests are ordered by their whole prompt (nothing is looked up in
    the cache for them), mixed with a local request; aborting a waiting one takes it out of the
    order. Tokens equal FCFS's."""
    cfg = EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20, max_num_seqs=1)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    pre = LLMEngine(tiny_dir, cfg)
    prompts = {"long": list(range(40, 100)), "short": list(range(200, 208)), "mid": list(range(300, 330))}
    prefilled = {}
    for rid, p in prompts.items():
        pre.add_request(rid, p, params, export_kv=True)
    while pre.has_unfinished():
        for o in pre.step():
            assert o.finished and o.kv_payload is not None
            prefilled[o.request_id] = (o.new_token_ids[0], o.kv_payload)

    def decode(policy: str) -> tuple[list[str], dict[str, list[int]]]:
        t = [0.0]
        eng = LLMEngine(tiny_dir, dataclasses.replace(cfg, schedule_policy=policy), clock=lambda: t[0])
        eng.add_request("local", list(range(10, 30)), params)  # 20 tokens
        for rid in ("long", "short", "mid"):
            first, payload = prefilled[rid]
            eng.add_prefilled(rid, prompts[rid], first, params, payload)
        eng.add_request("gone", list(range(400, 500)), params)  # the longest: waits in both orders
        order: list[str] = []
        out: dict[str, list[int]] = {}
        for o in eng.step():  # admits one request; "gone" still waits
            order.append(o.request_id)
            out[o.request_id] = list(o.new_token_ids)
        assert [r.request_id for r in eng.scheduler.waiting if r.request_id == "gone"] == ["gone"]
        aborted = eng.abort_request("gone")
        assert aborted is not None and aborted.finished
        assert "gone" not in [r.request_id for r in eng.scheduler.waiting]
        while eng.has_unfinished():
            for o in eng.step():
                if o.request_id not in out:
                    order.append(o.request_id)
                    out[o.request_id] = []
                out[o.request_id] += o.new_token_ids
        invariants.check(eng.kv)
        return order, out

    fcfs_order, fcfs_out = decode("fcfs")
    assert fcfs_order == ["local", "long", "short", "mid"]
    order, out = decode("compute")
    assert order == ["short", "local", "mid", "long"]  # by prompt length; imported: all uncached
    assert out == fcfs_out


def first_token_steps(
    tiny_dir: Path, policy: str, **kw: float
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """A 300-token prompt prefilled 64 tokens a step; a 10-token one arrives after its first chunk.
    Returns the step at which each request got its first token, and each one's tokens."""
    t = [0.0]
    eng = engine(tiny_dir, policy, t, 4, **kw)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng.add_request("long", list(range(40, 340)), params)
    first: dict[str, int] = {}
    out: dict[str, list[int]] = {}
    step = 0
    while eng.has_unfinished():
        step += 1
        t[0] = step * 0.01
        for o in eng.step():
            first.setdefault(o.request_id, step)
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if step == 1:
            eng.add_request("short", list(range(500, 510)), params)
    invariants.check(eng.kv)
    return first, out


def test_compute_priority_pauses_a_long_prefill_for_a_short_request(tiny_dir: Path) -> None:
    """FCFS: the short request waits for the long prompt's remaining chunks. Compute priority: it
    is admitted at the next step, ahead of the long prefill's next chunk (which keeps its pages
    and resumes); the tokens of both are unchanged. Overdue (max wait 0: FCFS), nothing pauses."""
    fcfs_first, fcfs_out = first_token_steps(tiny_dir, "fcfs")
    assert fcfs_first["short"] >= fcfs_first["long"]  # admitted only with the long prompt's last chunk
    first, out = first_token_steps(tiny_dir, "compute")
    assert first["short"] == 2 and first["short"] < first["long"]
    assert first["long"] <= fcfs_first["long"] + 1  # it lost 10 tokens of one step's budget
    assert out == fcfs_out
    bound_first, bound_out = first_token_steps(tiny_dir, "compute", priority_max_wait_s=0.0)
    assert bound_first == fcfs_first and bound_out == fcfs_out
