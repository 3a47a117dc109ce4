"""Tests for the batched sampler: greedy exactness, penalties, truncation, seeds, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from swaserve.engine.penalties import apply_penalties
from swaserve.engine.sampler import Sampler
from swaserve.engine.sampling_state import SamplingState, generator_seed, skip_draws
from swaserve.engine.types import SamplingParams


def _state(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> SamplingState:
    state = SamplingState.create(params, list(prompt or []), "cpu")
    state.output_token_ids.extend(output or [])
    return state


def _reference_penalties(
    row: list[float], params: SamplingParams, prompt: list[int], output: list[int]
) -> list[float]:
    """Straightforward per-token version of the documented penalty rules."""
    out = list(row)
    for tok in set(prompt) | set(output):
        r = params.repetition_penalty
        out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
    counts = Counter(output)
    for tok, n in counts.items():
        out[tok] -= params.frequency_penalty * n + params.presence_penalty
    return out


def _reference_allowed(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """Token ids that top-k, then top-p, then min-p leave (float64, sort-based)."""
    x = row.double() / params.temperature
    order = torch.argsort(x, descending=True).tolist()
    if params.top_k is not None:
        order = order[: params.top_k]
    vals = x[order]
    probs = torch.softmax(vals, dim=0).tolist()
    kept: list[int] = []
    mass = 0.0
    for tok, p in zip(order, probs, strict=True):
        if kept and mass >= params.top_p:
            break
        kept.append(tok)
        mass += p
    top = x[order[0]].item()
    return {t for t in kept if math.exp(x[t].item() - top) >= params.min_p}


def test_greedy_is_argmax_with_ties_and_mixed_batches() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # a tie: argmax takes the first
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler()
    out = sampler.sample(logits, [_state(greedy) for _ in range(16)])
    assert [t.token_id for t in out] == torch.argmax(logits, dim=-1).tolist()
    assert out[3].token_id == 10
    # Greedy rows stay exact when the batch also holds sampled and penalized rows.
    mixed = [
        _state(greedy)
        if i % 2 == 0
        else _state(SamplingParams(temperature=0.9, repetition_penalty=1.3), [1, 2])
        for i in range(16)
    ]
    out = sampler.sample(logits, mixed)
    expected = torch.argmax(logits, dim=-1).tolist()
    assert [out[i].token_id for i in range(0, 16, 2)] == expected[::2]
    assert all(t.logprob is None for t in out)


def test_greedy_with_penalties_is_argmax_of_penalized_logits() -> None:
    vocab = 8
    logits = torch.tensor([[3.0, 2.9, -1.0, 0.5, 0.1, -2.0, 1.0, 2.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 0 was in the prompt: 3.0 / 2 = 1.5 < 2.9, so token 1 wins.
    out = Sampler().sample(logits, [_state(params, prompt=[0])])
    assert out[0].token_id == 1
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.0)
    # Token 0 generated once: 3.0 - 0.5 = 2.5 < 2.9.
    out = Sampler().sample(logits, [_state(params, prompt=[7], output=[0, 5])])
    assert out[0].token_id == 1
    assert logits.shape[1] == vocab  # input untouched
    assert logits[0, 0].item() == 3.0


def test_penalties_match_reference() -> None:
    torch.manual_seed(1)
    vocab = 50
    cases = [
        (SamplingParams(repetition_penalty=1.7), [1, 2, 3, 3], [4, 4, 5]),
        (SamplingParams(repetition_penalty=0.6), [0, 49], []),
        (SamplingParams(frequency_penalty=0.8), [7, 8], [9, 9, 9, 10, 7]),
        (SamplingParams(presence_penalty=-1.5), [7], [9, 9, 11]),
        (
            SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.4),
            [20, 21],
            [21, 22, 22],
        ),
        (SamplingParams(), [1, 2], [3]),  # no penalties: row untouched
        (SamplingParams(frequency_penalty=1.0), [5], []),  # nothing generated yet
    ]
    logits = torch.randn(len(cases), vocab) * 3
    states = [_state(p, pr, out) for p, pr, out in cases]
    x = logits.clone()
    apply_penalties(x, states)
    for i, (p, pr, out) in enumerate(cases):
        ref = _reference_penalties(logits[i].tolist(), p, pr, out)
        torch.testing.assert_close(x[i], torch.tensor(ref), rtol=1e-6, atol=1e-6)


def test_penalty_token_cache_follows_appends() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    state = _state(params, prompt=[0])
    logits = torch.zeros(1, 40)
    for step in range(30):  # grows the cached output buffer several times
        state.output_token_ids.append(step % 7)
        x = logits.clone()
        apply_penalties(x, [state])
        ref = _reference_penalties([0.0] * 40, params, [0], state.output_token_ids)
        assert x[0].tolist() == pytest.approx(ref)
    state.output_token_ids[:] = [3]  # replaced by a shorter list: re-read from scratch
    x = logits.clone()
    apply_penalties(x, [state])
    assert x[0, 3].item() == -1.0 and x[0, 0].item() == 0.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=1.3, min_p=0.2),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=2.0, top_p=0.95),  # flat: the nucleus exceeds the candidates
    ],
)
def test_truncation_never_samples_outside_allowed_set(params: SamplingParams) -> None:
    torch.manual_seed(2)
    vocab, draws = 300, 4000
    row = torch.randn(vocab) * 2
    allowed = _reference_allowed(row, params)
    # A small candidate count makes flat rows go through the 16x and full-sort retries.
    for sampler in (Sampler(), Sampler(top_p_candidates=4)):
        out = sampler.sample(row.expand(draws, vocab).contiguous(), [_state(params) for _ in range(draws)])
        seen = {t.token_id for t in out}
        assert seen <= allowed
        assert len(seen) >= min(len(allowed), 3)


def test_top_p_always_keeps_top_token() -> None:
    row = torch.tensor([5.0, 0.0, 0.0, 0.0])  # top token alone has mass > top_p
    out = Sampler().sample(
        row.expand(200, 4).contiguous(), [_state(SamplingParams(top_p=0.01)) for _ in range(200)]
    )
    assert {t.token_id for t in out} == {0}


def test_temperature_sampling_matches_softmax() -> None:
    torch.manual_seed(3)
    vocab, draws = 10, 20000
    row = torch.randn(vocab)
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.5, top_k=6, top_p=0.9)):
        allowed = sorted(_reference_allowed(row, params))
        expected = torch.softmax(row.double()[allowed] / params.temperature, dim=0)
        torch.manual_seed(4)
        out = Sampler().sample(row.expand(draws, vocab).contiguous(), [_state(params) for _ in range(draws)])
        counts = Counter(t.token_id for t in out)
        assert set(counts) <= set(allowed)
        chi2 = sum(
            (counts[t] - draws * p) ** 2 / (draws * p)
            for t, p in zip(allowed, expected.tolist(), strict=True)
        )
        # 99.9% quantile of chi-square with <= 9 degrees of freedom is 27.9.
        assert chi2 < 27.9, (params, chi2)


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    torch.manual_seed(5)
    vocab, steps = 500, 12
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    step_logits = [torch.randn(vocab) * 2 for _ in range(steps)]
    sampler = Sampler()

    def run(batch_extra: int, position: int) -> list[int]:
        state = _state(params)
        others = [
            _state(SamplingParams(temperature=0.8, seed=i if i % 2 else None, top_k=7))
            for i in range(batch_extra)
        ]
        tokens = []
        for logits in step_logits:
            states = [*others[:position], state, *others[position:]]
            noise = torch.randn(len(states), vocab) * 3
            noise[position] = logits
            token = sampler.sample(noise, states)[position].token_id
            state.output_token_ids.append(token)
            tokens.append(token)
        return tokens

    alone = run(0, 0)
    assert run(5, 3) == alone
    assert run(31, 31) == alone
    assert run(8, 0) == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99)
    state = _state(other_seed)
    assert [sampler.sample(lg.unsqueeze(0), [state])[0].token_id for lg in step_logits] != alone


def test_logprobs_are_raw_log_softmax_with_sorted_top() -> None:
    torch.manual_seed(6)
    vocab = 200
    logits = torch.randn(4, vocab) * 4
    states = [
        _state(SamplingParams(temperature=0.0, logprobs=5)),
        _state(SamplingParams(temperature=0.5, logprobs=0, repetition_penalty=1.5), prompt=[1, 2, 3]),
        _state(SamplingParams(temperature=1.0)),
        _state(SamplingParams(temperature=1.2, top_k=3, logprobs=20, frequency_penalty=1.0), output=[4, 4]),
    ]
    out = Sampler().sample(logits, states)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out[2].logprob is None
    for i, n in ((0, 5), (1, 0), (3, 20)):
        lp = out[i].logprob
        assert lp is not None and lp.token_id == out[i].token_id
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-4)
        assert len(lp.top) == n
        ref_vals, ref_ids = ref[i].topk(n)
        assert [t for t, _ in lp.top] == ref_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref_vals.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
    assert out[0].logprob is not None and out[0].logprob.top[0][0] == out[0].token_id


def test_logprobs_of_extreme_logits_are_finite() -> None:
    logits = torch.tensor([[0.0, -500.0, -1000.0, 40.0]])
    out = Sampler().sample(logits, [_state(SamplingParams(temperature=0.0, logprobs=4))])
    lp = out[0].logprob
    assert lp is not None and lp.token_id == 3
    ref = torch.log_softmax(logits.double(), dim=-1)[0]
    assert [v for _, v in lp.top] == pytest.approx(sorted(ref.tolist(), reverse=True), rel=1e-5)


def test_low_temperature_and_masked_vocab() -> None:
    torch.manual_seed(7)
    logits = torch.randn(64, 100) * 30
    logits[:, 50:] = -math.inf  # e.g. padded vocabulary
    out = Sampler().sample(logits, [_state(SamplingParams(temperature=0.01)) for _ in range(64)])
    assert [t.token_id for t in out] == logits.argmax(dim=-1).tolist()
    out = Sampler().sample(logits, [_state(SamplingParams(temperature=5.0)) for _ in range(64)])
    assert all(t.token_id < 50 for t in out)


def test_half_precision_logits_and_shape_errors() -> None:
    logits = torch.randn(3, 64, dtype=torch.bfloat16)
    out = Sampler().sample(logits, [_state(SamplingParams(temperature=0.0))] * 3)
    assert [t.token_id for t in out] == logits.float().argmax(dim=-1).tolist()
    with pytest.raises(ValueError):
        Sampler().sample(torch.randn(2, 64), [_state(SamplingParams())])
    with pytest.raises(ValueError):
        Sampler().sample(torch.randn(1, 64), [_state(SamplingParams(repetition_penalty=1.1), prompt=[64])])
    assert Sampler().sample(torch.empty(0, 64), []) == []


def test_seed_creates_generator_on_device() -> None:
    state = SamplingState.create(SamplingParams(seed=7), [1, 2], torch.device("cpu"))
    assert state.generator is not None and state.generator.device.type == "cpu"
    assert SamplingState.create(SamplingParams(), [1], "cpu").generator is None


def test_seeds_that_differ_only_in_high_bits_draw_different_tokens() -> None:
    """torch's CPU generator keeps 32 bits of its seed: 5 and 5 + 2^32 would draw alike."""
    torch.manual_seed(0)
    logits = [torch.randn(4096) for _ in range(8)]
    sampler = Sampler()

    def draws(seed: int) -> list[int]:
        state = _state(SamplingParams(temperature=1.0, seed=seed))
        return [sampler.sample(lg.unsqueeze(0), [state])[0].token_id for lg in logits]

    for a, b in (
        (5, 5 + 2**32),
        (7, 7 + 2**40),
        (-1, 2**63 - 1),
        (123, 123 + 2**63),
        (0, -(2**63)),
        (-1, 2**64 - 1),
    ):
        assert draws(a) != draws(b), (a, b)
        assert draws(b) == draws(b)  # still reproducible
    # seeds in [0, 2^32) seed the generator as they are (their streams are unchanged)
    assert [generator_seed(s) for s in (0, 5, 2**32 - 1)] == [0, 5, 2**32 - 1]
    assert all(0 <= generator_seed(s) < 2**32 for s in (-(2**63), -1, 2**32, 2**64 - 1))


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize("n", [1, 7, 1000])
def test_skipping_draws_leaves_the_generator_where_sampling_n_tokens_does(n: int, device: str) -> None:
    """A resume moves a seeded generator on by one draw per token sent: as ``_draw`` takes them
    (one number into a row of a [S, 1] tensor, other rows from the global RNG)."""
    drawn = torch.Generator(device=device).manual_seed(9)
    for i in range(n):
        u = torch.empty(3, 1, device=device)
        u.uniform_()
        u[i % 3].uniform_(generator=drawn)
    skipped = torch.Generator(device=device).manual_seed(9)
    skip_draws(skipped, n)
    assert torch.equal(drawn.get_state(), skipped.get_state())
    nxt = [torch.rand(4, generator=g, device=device).tolist() for g in (drawn, skipped)]
    assert nxt[0] == nxt[1]
