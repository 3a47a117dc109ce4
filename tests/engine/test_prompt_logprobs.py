"""Prompt logprobs (``echo``/``prompt_logprobs``), ``max_tokens`` 0 and ``logit_bias`` in the engine:
values against transformers' log-softmax of the same prompt, with chunking and a warm prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from swaserve.config import EngineConfig
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from tests.helpers.engine import reference_logits

TOL = 1e-4


def run(eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> list[RequestOutput]:
    eng.add_request(rid, prompt, params)
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("chunk", [5, 64], ids=["chunked", "one-shot"])
def test_prompt_logprobs_equal_transformers_log_softmax(tiny_dir: Path, hf_tiny, chunk: int) -> None:  # type: ignore[no-untyped-def]
    prompt = [*range(7, 40), 3, 9, 27, 81, 243]
    ref = torch.log_softmax(reference_logits(hf_tiny, prompt), dim=-1)  # [P, V]
    eng = LLMEngine(
        tiny_dir,
        EngineConfig(
            page_size=4, max_num_batched_tokens=chunk, kv_cache_memory=4 << 20, enable_prefix_caching=True
        ),
    )
    run(eng, "warm", prompt, SamplingParams(max_tokens=2, temperature=0.0))  # the prompt is now cached
    outs = run(eng, "lp", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=4))
    lps = outs[0].prompt_logprobs
    assert lps is not None and all(o.prompt_logprobs is None for o in outs[1:])
    assert outs[-1].cached_tokens == 0  # every prompt position was computed, not read from the cache
    assert [lp.token_id for lp in lps] == prompt[1:]
    for q, lp in enumerate(lps):  # logits at position q predict prompt token q + 1
        assert abs(lp.logprob - ref[q, prompt[q + 1]].item()) <= TOL
        vals, ids = ref[q].topk(4)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert max(abs(v - r) for (_, v), r in zip(lp.top, vals.tolist(), strict=True)) <= TOL
        higher = (ref[q] > ref[q, prompt[q + 1]] + TOL).sum().item()  # its rank, up to ties within TOL
        assert higher + 1 <= lp.rank <= (ref[q] > ref[q, prompt[q + 1]] - TOL).sum().item() + 1
    assert any(lp.rank > 4 for lp in lps)  # ranks outside the top-4 are known too
    # the same request without prompt logprobs samples the same tokens
    plain = run(eng, "plain", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    assert [t for o in plain for t in o.new_token_ids] == [t for o in outs for t in o.new_token_ids]


def test_max_tokens_zero_computes_the_prompt_only(tiny_dir: Path, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = torch.log_softmax(reference_logits(hf_tiny, prompt), dim=-1)
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=16, kv_cache_memory=4 << 20))
    outs = run(eng, "z", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(outs) == 1 and outs[0].finish_reason == FinishReason.LENGTH
    assert outs[0].new_token_ids == [] and outs[0].completion_tokens == 0
    got = [lp.logprob for lp in outs[0].prompt_logprobs or []]
    want = [ref[q, prompt[q + 1]].item() for q in range(len(prompt) - 1)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
    stats = eng.stats()
    assert stats.pools["full"].request_pages == 0 and stats.num_running == 0


def test_logit_bias_forces_and_bans_tokens(tiny_dir: Path) -> None:
    eng = LLMEngine(tiny_dir, EngineConfig(page_size=4, max_num_batched_tokens=32, kv_cache_memory=4 << 20))
    prompt = [11, 12, 13, 14]
    base = run(eng, "b", prompt, SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True))
    first = base[0].new_token_ids[0]
    forced = run(
        eng,
        "f",
        prompt,
        SamplingParams(max_tokens=4, temperature=0.0, logit_bias=((77, 100.0),), logprobs=0, ignore_eos=True),
    )
    assert [t for o in forced for t in o.new_token_ids] == [77] * 4
    # logprobs stay those of the raw logits (as vLLM's default): the first one is unchanged by the bias
    raw77 = forced[0].new_logprobs[0].logprob
    assert raw77 < base[0].new_logprobs[0].logprob
    banned = run(
        eng, "x", prompt, SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((first, -100.0),))
    )
    assert banned[0].new_token_ids[0] != first
    sampled = run(
        eng,
        "s",
        prompt,
        SamplingParams(max_tokens=6, temperature=1.0, seed=3, logit_bias=((77, 100.0),), ignore_eos=True),
    )
    assert [t for o in sampled for t in o.new_token_ids] == [77] * 6
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request("bad", prompt, SamplingParams(logit_bias=((10**9, 1.0),)))
