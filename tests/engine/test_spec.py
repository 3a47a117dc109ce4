"""Speculative acceptance (``swaserve.engine.spec``): greedy runs, oracle drafts with closed-form
accept lengths, budgets and stops inside a run, and sampling: on a toy target (a Markov chain over a
small vocabulary), speculation emits the non-speculative tokens for the same seed, and its token
distribution passes a chi-square test against the target's exact probabilities."""

from __future__ import annotations

import bisect
import itertools
import random

import pytest

from swaserve.engine.spec import SpecStats, verify

V = 6  # toy vocabulary


def _chain(seed: int) -> list[list[float]]:
    """A random transition matrix P[prev][next] (rows sum to 1)."""
    rng = random.Random(seed)
    rows = [[rng.random() ** 2 + 0.02 for _ in range(V)] for _ in range(V)]
    return [[x / sum(r) for x in r] for r in rows]


def _draw(p: list[float], rng: random.Random) -> int:
    """One token from p with one uniform (inverse CDF), as the engine's sampler draws one per token."""
    cdf = list(itertools.accumulate(p))
    return min(bisect.bisect_right(cdf, rng.random() * cdf[-1]), V - 1)


def _argmax(p: list[float]) -> int:
    return max(range(V), key=p.__getitem__)


def generate(target: list[list[float]], n: int, seed: int, draft: list[list[float]] | None, k: int = 3,
             stats: SpecStats | None = None) -> list[int]:  # fmt: skip
    """n tokens after token 0: plain sampling, or verify steps over k greedy drafts of ``draft``."""
    rng, out = random.Random(seed), [0]
    while len(out) < n + 1:
        if draft is None:
            out.append(_draw(target[out[-1]], rng))
            continue
        drafts = [_argmax(draft[out[-1]])]
        while len(drafts) < k:
            drafts.append(_argmax(draft[drafts[-1]]))
        context = [out[-1], *drafts]  # row j follows context[j]
        emitted = verify(drafts, lambda j, c=context: _draw(target[c[j]], rng), n + 1 - len(out))
        if stats is not None:
            stats.record(drafts, emitted)
        out.extend(emitted)
    return out[1:]


# -- greedy ----------------------------------------------------------------------------------------
def test_greedy_accepts_while_drafts_equal_the_argmax() -> None:
    rows = [5, 6, 9, 7]  # the target's argmax per row
    assert verify([5, 6, 7], rows.__getitem__, 10) == [5, 6, 9]  # d3 rejected: the target's 9
    assert verify([5, 6, 9], rows.__getitem__, 10) == [5, 6, 9, 7]  # all accepted + the bonus row
    assert verify([1, 6, 9], rows.__getitem__, 10) == [5]  # d1 rejected: one token, as without MTP
    assert verify([], rows.__getitem__, 10) == [5]


def test_oracle_drafts_have_closed_form_accept_lengths() -> None:
    target = _chain(1)
    greedy = [[1.0 if t == _argmax(r) else 0.0 for t in range(V)] for r in target]  # temperature 0
    for k in (1, 2, 3):
        right, wrong = SpecStats(), SpecStats()
        plain = generate(greedy, 60, 0, None)
        assert generate(greedy, 60, 0, greedy, k, right) == plain  # drafts always right
        anti = [[1.0 if t == (_argmax(r) + 1) % V else 0.0 for t in range(V)] for r in target]
        assert generate(greedy, 60, 0, anti, k, wrong) == plain  # drafts always wrong
        assert right.mean_accept_length == pytest.approx(k + 1, abs=(k + 1) / right.drafts)  # last step cut
        assert wrong.mean_accept_length == 1.0 and wrong.accepted == 0 and wrong.drafts == 60
        assert right.accepted_per_pos[0] == right.drafts


def test_budget_and_stop_end_the_run_inside_it() -> None:
    rows = [5, 6, 9, 7]
    assert verify([5, 6, 9], rows.__getitem__, 2) == [5, 6]  # max_tokens lands inside the run
    assert verify([5, 6, 9], rows.__getitem__, 10, stop=lambda t: t == 6) == [5, 6]  # a stop id
    calls: list[int] = []
    verify([5, 6, 9], lambda j: calls.append(j) or rows[j], 1)
    assert calls == [0]  # no row sampled past the last emitted token
    with pytest.raises(ValueError, match="budget"):
        verify([1], rows.__getitem__, 0)


def test_stats_count_per_position() -> None:
    s = SpecStats()
    assert s.record([1, 2, 3], [1, 2, 4]) == 2
    assert s.record([1, 2, 3], [9]) == 0
    assert s.record([1, 2, 3], [1, 2]) == 2  # cut by the budget on a draft
    assert (s.drafts, s.draft_tokens, s.accepted, s.accepted_per_pos) == (3, 9, 4, [2, 2, 0])
    assert s.mean_accept_length == pytest.approx(1 + 4 / 3)


# -- sampling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("draft_seed", [2, 3])
def test_a_seeded_request_emits_the_same_tokens_with_and_without_speculation(draft_seed: int) -> None:
    target, draft = _chain(1), _chain(draft_seed)  # a draft model that is often wrong
    stats = SpecStats()
    for seed in range(200):
        assert generate(target, 40, seed, draft, 3, stats) == generate(target, 40, seed, None)
    assert 1.0 < stats.mean_accept_length < 4.0  # some drafts accepted, some not


def test_the_token_distribution_is_the_targets() -> None:
    """Pairs (x1, x2) after token 0 from 30,000 speculative runs (drafts from another chain, one
    seed stream for all runs: no two runs share draws) against P[0][x1] * P[x1][x2]: chi-square
    with 35 degrees of freedom under 66.6 (its 0.999 quantile). Fixed seeds: deterministic."""
    target, draft = _chain(1), _chain(4)
    n = 30_000
    counts = [[0] * V for _ in range(V)]
    rng = random.Random(12345)
    for _ in range(n):
        x1, x2 = generate(target, 2, rng.randrange(1 << 62), draft, 3)
        counts[x1][x2] += 1
    chi2 = sum(
        (counts[a][b] - n * target[0][a] * target[a][b]) ** 2 / (n * target[0][a] * target[a][b])
        for a in range(V)
        for b in range(V)
    )
    assert chi2 < 66.6, chi2
    # and the test has power: the draft chain's own distribution is refused
    wrong = sum(
        (counts[a][b] - n * draft[0][a] * draft[a][b]) ** 2 / (n * draft[0][a] * draft[a][b])
        for a in range(V)
        for b in range(V)
    )
    assert wrong > 1000
