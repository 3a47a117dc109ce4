"""The router's resume of a request after output started (``services.router.attempt.Progress``),
on the tiny checkpoint's real tokenizer: at every possible interruption point, the client's text
equals an uninterrupted run's (UTF-8 characters split across tokens, a stop string spanning the
boundary, a stop token, two resumes), the resumed request carries the remaining budget and no stop
strings, and usage counts the whole output. The workers' outputs are built here the way the engine
emits them (``IncrementalDetokenizer``, one token per output); the cluster test is
``tests/services/router/test_router_resume.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from services.router.attempt import Interrupted, Progress
from swaserve.engine.detokenizer import IncrementalDetokenizer
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams, StructuredOutput, TokenLogprob

TEXT = "Hello wörld, naïve café — 日本語のテキスト 🙂 done. STOP here and then some more"


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_dir))


def engine_outputs(
    tok: Any, prompt: list[int], ids: list[int], params: SamplingParams, eos: int | None = None
) -> list[RequestOutput]:
    """What a worker streams for a request that samples ``ids`` (the engine's ``_append``): one
    output per token, text from its detokenizer, the last one finished (a stop string, a stop
    token ``eos``, or ``max_tokens``)."""
    detok = IncrementalDetokenizer(tok, prompt, params.skip_special_tokens, params.stop)
    outs = []
    for n, t in enumerate(ids, 1):
        reason = None
        text = ""
        if t == eos:
            reason = FinishReason.STOP
        else:
            text = detok.add([t])
            if detok.stopped:
                reason = FinishReason.STOP
        if reason is None and n >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None and not detok.stopped:
            text += detok.flush()
        lp = [TokenLogprob(t, -0.5 - t / 1000)]
        outs.append(
            RequestOutput("r", [t], text, lp, reason is not None, reason, len(prompt), n, cached_tokens=3)
        )
        if reason is not None:
            break
    return outs


def joined(outs: list[RequestOutput]) -> tuple[list[int], str, list[TokenLogprob]]:
    return (
        [t for o in outs for t in o.new_token_ids],
        "".join(o.new_text for o in outs),
        [lp for o in outs for lp in o.new_logprobs],
    )


def interrupted_run(
    tok: Any,
    prompt: list[int],
    ids: list[int],
    params: SamplingParams,
    cuts: list[int],
    eos: int | None = None,
) -> tuple[list[RequestOutput], Progress]:
    """The client's outputs when the request is interrupted after each token count in ``cuts``
    and resumed; a resumed worker's text is garbage (the router must not use it)."""
    progress = Progress(tok, prompt, params)
    sent: list[RequestOutput] = []
    cur_prompt, cur_params, done = prompt, params, 0
    for cut in [*cuts, None]:
        outs = engine_outputs(tok, cur_prompt, ids[done:], cur_params, eos)
        if progress.resumed:
            outs = [RequestOutput(o.request_id, o.new_token_ids, "#garbage#", o.new_logprobs, o.finished,
                                  o.finish_reason, o.prompt_tokens, o.completion_tokens, 99) for o in outs]  # fmt: skip
        for o in outs[: None if cut is None else cut - done]:
            sent.append(progress.relay(o))
            if sent[-1].finished:
                return sent, progress
        assert cut is not None, "the last attempt ended without a finish"
        cur_prompt, cur_params = progress.resume()
        assert cur_prompt == prompt + ids[:cut]
        assert cur_params.max_tokens == params.max_tokens - cut and cur_params.stop == ()
        done = cut
    raise AssertionError("unreachable")


@pytest.mark.parametrize("stop", [(), ("テキスト 🙂",), ("STOP", "naïve")])
def test_resumed_text_equals_an_uninterrupted_run_at_every_point(tok: Any, stop: tuple[str, ...]) -> None:
    prompt = tok.encode("A prompt: ", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), temperature=0.0, stop=stop, logprobs=0)
    want_ids, want_text, want_lps = joined(engine_outputs(tok, prompt, ids, params))
    if stop:
        assert len(want_ids) < len(ids)  # the stop string ended it
    assert "\ufffd" not in want_text
    for cut in range(1, len(want_ids)):
        got, progress = interrupted_run(tok, prompt, ids, params, [cut])
        g_ids, g_text, g_lps = joined(got)
        assert (g_ids, g_text) == (want_ids, want_text), cut
        assert g_lps == want_lps
        assert [o.finished for o in got] == [False] * (len(got) - 1) + [True]  # one final output
        last = got[-1]
        assert last.finish_reason == (FinishReason.STOP if stop else FinishReason.LENGTH)
        assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (
            len(prompt),
            len(want_ids),
            3,
        )
        assert progress.cut == bool(stop)  # the router ended it; the resumed worker had no stop strings


def test_two_resumes_and_a_stop_token(tok: Any) -> None:
    prompt = tok.encode("Another prompt ", add_special_tokens=False)
    ids = [*tok.encode(TEXT[:40], add_special_tokens=False), tok.eos_token_id, 5, 6]
    eos = tok.eos_token_id
    params = SamplingParams(max_tokens=100, temperature=0.0)
    want = engine_outputs(tok, prompt, ids, params, eos)
    want_ids, want_text, _ = joined(want)
    assert want_ids[-1] == eos and want[-1].finish_reason == FinishReason.STOP
    n = len(want_ids)
    for cuts in ([1, 2], [3, n - 1], [n // 2, n // 2 + 3]):
        got, progress = interrupted_run(tok, prompt, ids, params, cuts, eos)
        assert joined(got)[:2] == (want_ids, want_text), cuts
        assert got[-1].finish_reason == FinishReason.STOP and got[-1].completion_tokens == n
        assert progress.resumes == 2 and not progress.cut


def test_text_the_worker_held_back_is_sent_after_the_resume(tok: Any) -> None:
    prompt = tok.encode("x ", add_special_tokens=False)
    ids = tok.encode(TEXT, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(ids), temperature=0.0)
    want_ids, want_text, _ = joined(engine_outputs(tok, prompt, ids, params))
    progress = Progress(tok, prompt, params)
    first = engine_outputs(tok, prompt, ids, params)[:10]
    sent = [progress.relay(RequestOutput("r", o.new_token_ids, "", o.new_logprobs)) for o in first]
    assert progress.text_len == 0  # as if every character had been held back
    p2, q2 = progress.resume()
    rest = engine_outputs(tok, p2, ids[10:], q2)
    sent += [progress.relay(o) for o in rest]
    assert joined(sent)[:2] == (want_ids, want_text)


def test_nothing_left_to_resume_is_an_interruption(tok: Any) -> None:
    progress = Progress(tok, [5, 6], SamplingParams(max_tokens=2))
    progress.relay(RequestOutput("r", [7, 8], "ab"))
    with pytest.raises(Interrupted, match="without a finish reason"):
        progress.resume()


def test_structured_output_is_not_resumed(tok: Any) -> None:
    params = SamplingParams(max_tokens=9, structured=StructuredOutput("regex", "[a-z]+"))
    progress = Progress(tok, [5, 6], params)
    progress.relay(RequestOutput("r", [7, 8], "ab"))
    with pytest.raises(Interrupted, match="after 2 generated tokens: structured output is not resumed"):
        progress.resume()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=9, seed=77, temperature=0.0),
        SamplingParams(max_tokens=9, temperature=0.8),  # unseeded: the same distribution goes on
        SamplingParams(max_tokens=9, repetition_penalty=1.3),  # over prompt + output
        # the workers count the tokens sent as output and move a seeded generator on by them
        SamplingParams(max_tokens=9, temperature=0.8, seed=77),
        SamplingParams(max_tokens=9, frequency_penalty=1.5),
        SamplingParams(max_tokens=9, presence_penalty=-0.5),
    ],
)
def test_requests_that_continue_exactly_are_resumed(tok: Any, params: SamplingParams) -> None:
    progress = Progress(tok, [5, 6], params)
    progress.relay(RequestOutput("r", [7, 8], "ab"))
    prompt, resumed = progress.resume()
    assert prompt == [5, 6, 7, 8] and resumed.max_tokens == 7 and resumed.prior_output_tokens == 2
    progress.relay(RequestOutput("r", [9], "c"))
    prompt, resumed = progress.resume()  # a second resume counts every token sent
    assert prompt == [5, 6, 7, 8, 9] and resumed.max_tokens == 6 and resumed.prior_output_tokens == 3


@pytest.mark.parametrize(
    ("params", "resumes"),
    [
        (SamplingParams(max_tokens=9, temperature=0.8), True),  # a retried prefill would draw anew
        (SamplingParams(max_tokens=9, temperature=0.0), False),  # retried: the same first token
        (SamplingParams(max_tokens=9, temperature=0.8, seed=5), False),
        (
            SamplingParams(max_tokens=9, temperature=0.8, structured=StructuredOutput("regex", "[a-z]+")),
            False,
        ),
    ],
)
def test_a_failure_after_only_the_first_token_resumes_an_unseeded_sampled_request(
    tok: Any, params: SamplingParams, resumes: bool
) -> None:
    progress = Progress(tok, [5, 6], params)
    assert not progress.should_resume(False)  # nothing sent yet: a retry
    progress.relay(RequestOutput("r", [7], "a"))  # the prefill worker's first token
    assert progress.should_resume(False) is resumes
    assert progress.should_resume(True)  # decode output reached the client: always a resume


def test_a_resume_that_needs_prior_output_tokens_goes_only_to_workers_that_list_it() -> None:
    """Workers of an older release ignore ``prior_output_tokens`` (during a rolling upgrade): a
    resumed seeded or penalized request goes only to workers whose GetLoad lists the feature,
    else it ends with a clean 503 rather than other tokens. (A cluster resume of such a request,
    ``test_router_resume.py``, passes through this filter with real workers.)"""
    from services.convert import PRIOR_OUTPUT_FEATURE, needs_prior_output
    from services.router.cluster import NoWorkerAvailable, exact_resume_workers
    from services.router.worker_handle import WorkerHandle
    from swaserve.v1 import worker_pb2 as pb

    def handle(address: str, features: list[str] | None) -> WorkerHandle:
        load = None if features is None else pb.Load(role="decode", features=features)
        return WorkerHandle(address, "decode", None, None, load=load)  # type: ignore[arg-type]  # not called

    new, old, unpolled = handle("a", [PRIOR_OUTPUT_FEATURE]), handle("b", []), handle("c", None)
    assert exact_resume_workers({"a": new, "b": old, "c": unpolled}, "decode") == {"a": new}
    with pytest.raises(NoWorkerAvailable, match="no decode worker continues this resumed request exactly"):
        exact_resume_workers({"b": old, "c": unpolled}, "decode")
    assert exact_resume_workers({}, "decode") == {}  # nothing to filter: the usual no-worker error
    sampled, seeded = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, seed=3)
    assert needs_prior_output(dataclasses.replace(seeded, prior_output_tokens=4))
    assert needs_prior_output(dataclasses.replace(sampled, presence_penalty=0.5, prior_output_tokens=4))
    assert not needs_prior_output(dataclasses.replace(sampled, prior_output_tokens=4))  # same distribution
    assert not needs_prior_output(SamplingParams(temperature=0.0, seed=3, prior_output_tokens=4))  # greedy
    assert not needs_prior_output(seeded)  # not a resume
