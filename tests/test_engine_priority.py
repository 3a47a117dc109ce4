"""Compute-aware admission order in the engine's scheduler: shortest uncached work first, aged,
with the starvation bound, and outputs unchanged by the order."""

from __future__ import annotations

from pathlib import Path

import pytest

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import SamplingParams


def run(
    tiny_dir: Path, policy: str, clock_steps: list[float], **kw: float
) -> tuple[list[str], dict[str, list[int]]]:
    """One running request at a time; returns the admission order and each request's tokens.
    ``clock_steps``: the engine clock's values, one per ``step`` (then stays at the last)."""
    t = [0.0]
    cfg = EngineConfig(
        page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20, max_num_seqs=1,
        schedule_policy=policy, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    eng = LLMEngine(tiny_dir, cfg, clock=lambda: t[0])
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
