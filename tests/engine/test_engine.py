"""Engine-level behaviour: greedy generation equals transformers, pools drain, accounting is exact."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import FinishReason, SamplingParams
from swaserve.kvcache import invariants
from swaserve.kvcache.plan import cdiv

NEW = 64


def reference_prompts(hf, n: int, new: int = NEW) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """Seeded prompts whose greedy transformers continuation runs ``new`` tokens without EOS."""
    g = torch.Generator().manual_seed(1234)
    out = []
    while len(out) < n:
        p = torch.randint(3, 500, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        ref = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False)[0, len(p) :].tolist()
        if len(ref) == new:
            out.append((p, ref))
    return out


@pytest.fixture(scope="module")
def refs(hf_tiny):  # type: ignore[no-untyped-def]
    return reference_prompts(hf_tiny, 5)


@pytest.mark.parametrize(
    "ecfg",
    [
        EngineConfig(page_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20),
        EngineConfig(page_size=16, max_num_batched_tokens=7, kv_cache_memory=4 << 20),
        EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=4 << 20, kv_layout="full"),
    ],
    ids=["page4-chunk16", "page16-chunk7", "full-layout"],
)
def test_greedy_equals_transformers_generate(tiny_dir: Path, refs, ecfg: EngineConfig) -> None:  # type: ignore[no-untyped-def]
    eng = LLMEngine(tiny_dir, ecfg)
    outs = eng.generate([p for p, _ in refs], SamplingParams(max_tokens=NEW, temperature=0.0))
    for (_, ref), out in zip(refs, outs, strict=True):
        assert out == ref
    stats = eng.stats()
    assert stats.pools["full"].request_pages == 0 and stats.pools["swa"].request_pages == 0


def test_requests_joining_mid_flight_are_exact(tiny_dir: Path, refs) -> None:  # type: ignore[no-untyped-def]
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=24, kv_cache_memory=4 << 20))
    got: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=NEW, temperature=0.0)
    pending = list(enumerate(refs))
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % 9 == 0:  # a new request joins every 9 steps
            i, (p, _) = pending.pop(0)
            eng.add_request(f"j{i}", p, params)
            got[f"j{i}"] = []
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
        step += 1
    for i, (_, ref) in enumerate(refs):
        assert got[f"j{i}"] == ref


def test_swa_pages_held_stay_within_window_plus_chunk(tiny_dir: Path) -> None:
    chunk, page = 12, 4
    eng = LLMEngine(
        tiny_dir, EngineConfig(page_size=page, max_num_batched_tokens=chunk, kv_cache_memory=4 << 20)
    )
    window = eng.model_config.window
    rng = random.Random(0)
    for i in range(6):
        eng.add_request(
            f"s{i}",
            [rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))],
            SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.0, ignore_eos=True),
        )
    while eng.has_unfinished():
        eng.step()
        for rid, t in eng.kv.swa.tables.items():
            assert len(t.pages) <= cdiv(window + chunk, page) + 1, rid
    assert eng.stats().pools["swa"].request_pages == 0


def test_pools_drain_after_mixed_finish_and_abort(tiny_dir: Path) -> None:
    eng = LLMEngine(
        tiny_dir,
        EngineConfig(page_size=4, max_num_batched_tokens=20, kv_cache_memory=1 << 20, max_num_seqs=4),
    )
    rng = random.Random(1)
    live: list[str] = []
    for step in range(200):
        if rng.random() < 0.3:
            rid = f"m{step}"
            eng.add_request(
                rid,
                [rng.randrange(3, 500) for _ in range(rng.randrange(1, 80))],
                SamplingParams(
                    max_tokens=rng.randrange(1, 30), temperature=0.8, seed=step, ignore_eos=rng.random() < 0.5
                ),
            )
            live.append(rid)
        if live and rng.random() < 0.1:
            out = eng.abort_request(live.pop(rng.randrange(len(live))))
            assert out is None or (out.finished and out.finish_reason == FinishReason.ABORT)
        for o in eng.step():
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        pools = eng.stats().pools
        for p in pools.values():
            assert 0 <= p.used_pages <= p.total_pages
    for rid in live:
        eng.abort_request(rid)
    while eng.has_unfinished():
        eng.step()
    for p in eng.stats().pools.values():
        assert p.request_pages == 0
    assert eng.kv.full.pool.reserved == 0 and eng.kv.swa.pool.reserved == 0
    eng.kv.flush_cache()
    for p in eng.stats().pools.values():
        assert p.used_pages == 0


@pytest.mark.parametrize("ratio", [None, 0.5])  # None: the shared arena; a ratio: pools of their own
def test_bytes_reported_equal_bytes_allocated(tiny_dir: Path, ratio: float | None) -> None:
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, kv_cache_memory=3 << 20, swa_full_tokens_ratio=ratio))
    pools = eng.stats().pools
    if ratio is None:  # each pool can hold what is free of the arena: both together hold it once
        assert eng.kv.budget is not None and eng.kv.budget.total == eng.storage.nbytes()
        for p in pools.values():
            assert eng.storage.nbytes() - p.page_bytes < p.total_bytes <= eng.storage.nbytes()
    else:
        assert eng.kv.budget is None
        assert pools["full"].total_bytes + pools["swa"].total_bytes == eng.storage.nbytes()
    assert eng.storage.nbytes() <= 3 << 20
    eng.add_request("b", list(range(3, 40)), SamplingParams(max_tokens=3, temperature=0.0))
    eng.step()
    pools = eng.stats().pools
    assert pools["full"].used_bytes == eng.kv.full.held("b") * pools["full"].page_bytes
    if ratio is None:
        free = eng.storage.nbytes() - pools["full"].used_bytes - pools["swa"].used_bytes
        assert pools["full"].free_pages == free // pools["full"].page_bytes


@pytest.mark.parametrize("ratio", [None, 0.5])  # the shared arena; pools of their own
def test_admission_waits_for_room_instead_of_failing(tiny_dir: Path, ratio: float | None) -> None:
    # room for about two requests' pages: the third waits, nothing fails
    eng = LLMEngine(
        tiny_dir,
        EngineConfig(
            page_size=4, max_num_batched_tokens=64, kv_cache_memory=200_000 if ratio else 300_000,
            max_num_seqs=4, swa_full_tokens_ratio=ratio,
        ),
    )  # fmt: skip
    if eng.kv.budget is None:
        pages = eng.kv.full.pool.num_pages // 2
    else:  # half the arena less one request's SWA window and its prompt chunk's, in full pages
        swa = (eng.kv.swa.guarantee_for(1000) + 5) * eng.kv.swa.pool.page_bytes
        pages = (eng.kv.budget.total // 2 - swa) // eng.kv.full.pool.page_bytes
    per_req = pages * 4 - 20
    for i in range(3):
        eng.add_request(
            f"w{i}", list(range(3, 23)), SamplingParams(max_tokens=per_req, temperature=0.0, ignore_eos=True)
        )
    eng.step()
    assert eng.stats().num_running == 2 and eng.stats().num_waiting == 1
    done = set()
    while eng.has_unfinished():
        done |= {o.request_id for o in eng.step() if o.finished}
    assert done == {"w0", "w1", "w2"}


@pytest.mark.parametrize(
    "bad,msg",
    [
        (([], SamplingParams()), "empty"),
        (([1, 2, 10**6], SamplingParams()), "out of range"),
        ((list(range(10)), SamplingParams(max_tokens=10**6)), "maximum context length"),
        ((list(range(10)), SamplingParams(top_p=0.0)), "top_p"),
    ],
)
def test_bad_requests_raise_value_error(tiny_dir: Path, bad, msg: str) -> None:  # type: ignore[no-untyped-def]
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, kv_cache_memory=1 << 20))
    with pytest.raises(ValueError, match=msg):
        eng.add_request("x", *bad)
    assert not eng.has_unfinished()


def test_long_prefill_does_not_stall_running_decodes(tiny_dir: Path) -> None:
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20))
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add_request(f"d{i}", [5 + i] * 6, greedy)
    while any(r.num_computed < r.num_prompt for r in eng.requests.values()):
        eng.step()
    eng.add_request("long", list(range(3, 300)), SamplingParams(max_tokens=2, temperature=0.0))
    eng.step()  # admits "long"; put it at the head of the running list, as if it had arrived first
    running = eng.scheduler.running
    running.insert(0, running.pop(running.index(eng.requests["long"])))
    for _ in range(10):  # the long prompt needs ~19 steps of prefill at this budget
        got = {o.request_id for o in eng.step()}
        assert {"d0", "d1", "d2"} <= got  # every decode advanced this step
    assert eng.requests["long"].num_computed > 0


def test_small_requests_pass_a_blocked_head_but_only_max_bypass_times(tiny_dir: Path) -> None:
    eng = LLMEngine(
        tiny_dir,
        EngineConfig(page_size=4, max_num_batched_tokens=64, kv_cache_memory=200_000, max_num_seqs=8),
    )
    eng.scheduler.max_bypass = 2
    room = eng.limits.max_fit_tokens  # one request alone: its full pages and SWA window
    greedy = SamplingParams(max_tokens=room // 2, temperature=0.0, ignore_eos=True)
    eng.add_request("big0", [5] * 10, greedy)  # holds half the pool
    eng.add_request("big1", [6] * 10, SamplingParams(max_tokens=room - 20, temperature=0.0, ignore_eos=True))
    for i in range(4):
        eng.add_request(
            f"small{i}", [7 + i] * 4, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
    eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    waiting = [r.request_id for r in eng.scheduler.waiting]
    assert running == {"big0", "small0", "small1"}  # two small ones overtook the blocked big1 ...
    assert waiting == ["big1", "small2", "small3"]  # ... then the bound stopped further overtaking
    done = []
    while eng.has_unfinished():
        done += [o.request_id for o in eng.step() if o.finished]
    assert set(done) == {"big0", "big1", "small0", "small1", "small2", "small3"}


@pytest.mark.parametrize("ratio", [None, 0.2])  # the shared arena; pools of their own
def test_a_hit_that_leaves_no_room_is_dropped_not_waited_on(tiny_dir: Path, ratio: float | None) -> None:
    """The pages a prefix hit locks come on top of a request's guarantee: at a budget where ``b``
    fits alone but not beside its own hit, it is admitted without the hit (it used to wait for
    it forever), and its greedy output is the cache-off one."""
    base = dict(page_size=4, max_num_batched_tokens=12, max_num_seqs=4, kv_cache_memory=55 * 1536)
    eng = LLMEngine(tiny_dir, EngineConfig(**base, swa_full_tokens_ratio=ratio))  # type: ignore[arg-type]
    prefix = list(range(10, 50))
    eng.add_request("a", prefix, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    b = prefix + list(range(100, 131))
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng.add_request("b", b, greedy)
    got: list[int] = []
    for _ in range(200):
        got += [t for o in eng.step() for t in o.new_token_ids]
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished(), "b never admitted: it waits on its own cache hit"
    off = LLMEngine(tiny_dir, EngineConfig(**base, enable_prefix_caching=False))  # type: ignore[arg-type]
    off.add_request("b", b, greedy)
    want: list[int] = []
    while off.has_unfinished():
        want += [t for o in off.step() for t in o.new_token_ids]
    assert got == want and len(got) == 10
    invariants.check(eng.kv)
