"""Property tests: random request streams through pools + prefix cache + host tier.

Streams mix shared prefixes, branches, multi-turn extensions, aborts, chunk sizes and eviction
pressure, with page sizes below and above the window. After every operation all invariants of
``kvcache.invariants`` hold; every chunk reads only slots holding its own prefix (labels, see
``prefix_harness``), which is the window-safe rule checked against the real pool contents; after
draining and flushing every page of every pool and tier is free.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.prefix_harness import PrefixHarness

CONFIGS = st.fixed_dictionaries(
    {
        "page": st.sampled_from([1, 2, 4, 8]),
        "window": st.sampled_from([1, 3, 4, 6, 8]),
        "full_pages": st.integers(10, 60),
        "swa_pages": st.integers(8, 40),
        "layout": st.sampled_from(["hybrid", "hybrid", "full"]),
        "host": st.sampled_from([None, (8, 4), (40, 20), (200, 100)]),
        "policy": st.sampled_from(["on_evict", "second_hit"]),
    }
)


def run_stream(cfg: dict, seed: int, n_ops: int) -> PrefixHarness:
    rng = random.Random(seed)
    page, window = cfg["page"], cfg["window"]
    swa_need = -(-window // page) + 2 + 8 // page + 2
    h = PrefixHarness(
        page,
        window,
        cfg["full_pages"],
        max(cfg["swa_pages"], swa_need),
        cfg["layout"],
        cfg["host"],
        cfg["policy"],
    )
    stems = [[rng.randrange(1, 40) for _ in range(rng.randrange(1, 3 * page + 6))] for _ in range(4)]
    done: list[list[int]] = []
    n = 0
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.3 or not h.live:
            if done and rng.random() < 0.5:  # next turn of an earlier conversation
                prompt = rng.choice(done) + [
                    rng.randrange(1, 40) for _ in range(rng.randrange(1, 2 * page + 3))
                ]
            else:  # shared stems, then a branch
                prompt = [t for s in rng.sample(stems, rng.randrange(1, 3)) for t in s]
                prompt += [rng.randrange(1, 40) for _ in range(rng.randrange(1, 6))]
            if len(prompt) > 6 * page + 3 * window + 20:
                prompt = prompt[-(6 * page + 3 * window + 20) :]
            n += 1
            h.admit(f"r{n}", prompt, rng.randrange(1, 6))
        elif op < 0.92:
            rid = rng.choice(list(h.live))
            r = h.live[rid]
            tokens = list(r.tokens)
            if h.advance(rid, rng.randrange(1, 3 * page + 4), rng.randrange(1, 40)):
                done.append(tokens)
        else:
            rid = rng.choice(list(h.live))
            done.append(h.finish(rid))  # abort mid-flight: computed pages still go to the cache
        h.check()
    h.drain_and_flush()
    return h


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, seed=st.integers(0, 2**32 - 1))
def test_random_streams_keep_every_invariant(cfg: dict, seed: int) -> None:
    run_stream(cfg, seed, 120)


def test_streams_really_hit_the_cache_and_the_host_tier() -> None:
    """Guard against a vacuous property test: the same streams produce device and host hits."""
    hits = host_hits = 0
    for seed in range(6):
        cfg = {
            "page": 2, "window": 3, "full_pages": 20, "swa_pages": 12, "layout": "hybrid",
            "host": (200, 100), "policy": "on_evict",
        }  # fmt: skip
        h = run_stream(cfg, seed, 150)
        hits += h.hits
        host_hits += h.host_hits
    assert hits > 0 and host_hits > 0
