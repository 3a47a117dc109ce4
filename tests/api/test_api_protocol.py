"""OpenAI request validation, SamplingParams translation, logprob formatting and request metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from swaserve.api.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from swaserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ProtocolError,
    check_token_ids,
)
from swaserve.api.responses import MIN_LOGPROB
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from swaserve.kvcache.prefix_cache import CacheStats
from swaserve.kvcache.stats import PoolStats
from swaserve.metrics import ITL_BUCKETS, TTFT_BUCKETS, RequestTimer, ServerMetrics

MAX_LEN = 100


def completion(**kw: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def chat(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def refused(fn: object, *args: object) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


# ---------------------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        ([5, 6, 7], [[5, 6, 7]]),
        (["hello"], ["hello"]),
        ([[5, 6]], [[5, 6]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_forms(prompt: object, expected: object) -> None:
    assert completion(prompt=prompt).prompt_inputs() == expected


@pytest.mark.parametrize("prompt", ["", [], [""], [[]], ["a", ""]])
def test_empty_prompt_is_refused(prompt: object) -> None:
    err = refused(completion(prompt=prompt).prompt_inputs)
    assert err.param == "prompt" and err.status == 400 and "empty" in err.message


def test_suffix_and_best_of_above_n_are_refused() -> None:
    assert refused(completion(suffix="x").prompt_inputs).param == "suffix"
    assert refused(completion(best_of=3).prompt_inputs).param == "best_of"
    assert completion(echo=True, best_of=2, n=2).prompt_inputs() == ["hi"]


def test_echo_with_logprobs_asks_for_prompt_logprobs_and_allows_max_tokens_zero() -> None:
    p = completion(echo=True, logprobs=2, max_tokens=0).sampling_params(5, MAX_LEN)
    assert p.prompt_logprobs == 2 and p.max_tokens == 0 and p.logprobs == 2
    assert completion(echo=True).sampling_params(5, MAX_LEN).prompt_logprobs is None
    assert refused(completion(max_tokens=0).sampling_params, 5, MAX_LEN).param == "max_tokens"


def test_logit_bias_keys_and_range() -> None:
    assert completion(logit_bias={"7": 100, "3": -5.5}).sampling_params(5, MAX_LEN).logit_bias == (
        (3, -5.5),
        (7, 100.0),
    )
    assert refused(completion(logit_bias={"x": 1}).sampling_params, 5, MAX_LEN).param == "logit_bias"
    assert refused(completion(logit_bias={"1": 101}).sampling_params, 5, MAX_LEN).param == "logit_bias"


def test_n_and_max_logprobs_bounds() -> None:
    assert completion(n=3).sampling_params(5, MAX_LEN) == SamplingParams(max_tokens=16)
    assert refused(completion(n=0).sampling_params, 5, MAX_LEN).param == "n"
    assert refused(completion(n=65).sampling_params, 5, MAX_LEN).param == "n"
    assert refused(completion(logprobs=6).sampling_params, 5, MAX_LEN, 5).param == "logprobs"
    assert refused(chat(logprobs=True, top_logprobs=6).sampling_params, 5, MAX_LEN, 5).param == "top_logprobs"
    assert refused(completion(prompt_logprobs=6).sampling_params, 5, MAX_LEN, 5).param == "prompt_logprobs"


def test_chat_template_options() -> None:
    assert chat().template_options() == {"add_generation_prompt": True, "continue_final_message": False}
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    opts = chat(messages=msgs, add_generation_prompt=False, continue_final_message=True,
                chat_template_kwargs={"enable_thinking": False}).template_options()  # fmt: skip
    assert opts == {"enable_thinking": False, "add_generation_prompt": False, "continue_final_message": True}
    assert refused(chat(continue_final_message=True).template_options).param == "continue_final_message"
    bad = chat(
        messages=msgs,
        add_generation_prompt=False,
        continue_final_message=True,
        chat_template_kwargs={"tokenize": True},
    )
    assert refused(bad.template_options).param == "chat_template_kwargs"
    assert chat(messages=[{"role": "developer", "content": "x"}]).template_messages()[0]["role"] == "system"


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x", "max_tokens": "3"},
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "max_tokens": 2.5},
        {"prompt": "x", "temperature": "0.5"},
        {"prompt": "x", "temperature": False},
        {"prompt": [1, True]},
        {"prompt": [1.5]},
        {"prompt": 7},
        {"prompt": "x", "stop": [1]},
        {"prompt": "x", "stream": "yes"},
        {"max_tokens": 3},
    ],
)
def test_wrong_types_and_missing_fields_fail_validation(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_unknown_fields_are_refused_and_ints_count_as_floats() -> None:
    req = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "top_p": 1})
    params = req.sampling_params(1, MAX_LEN)
    assert params.temperature == 0.0 and params.greedy and params.top_p == 1.0
    with pytest.raises(ValidationError, match="frobnicate"):
        CompletionRequest.model_validate({"prompt": "x", "frobnicate": {"a": 1}})


# ---------------------------------------------------------------------------- sampling params


def test_completion_defaults() -> None:
    assert completion().sampling_params(5, MAX_LEN) == SamplingParams(max_tokens=16)


def test_all_fields_reach_sampling_params() -> None:
    req = completion(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        stop="END",
        stop_token_ids=[4, 9],
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
    )
    assert req.sampling_params(5, MAX_LEN) == SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        stop=("END",),
        stop_token_ids=(4, 9),
        ignore_eos=True,
        logprobs=3,
        skip_special_tokens=False,
    )


@pytest.mark.parametrize("top_k", [None, -1])
def test_top_k_disabled_spellings(top_k: int | None) -> None:
    assert completion(top_k=top_k).sampling_params(1, MAX_LEN).top_k is None


def test_stop_list_and_limits() -> None:
    assert completion(stop=["a", "b", "c", "d"]).sampling_params(1, MAX_LEN).stop == ("a", "b", "c", "d")
    assert refused(completion(stop=["a", "b", "c", "d", "e"]).sampling_params, 1, MAX_LEN).param == "stop"
    assert refused(completion(stop="").sampling_params, 1, MAX_LEN).param == "stop"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("max_tokens", 0),
        ("max_tokens", -4),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("repetition_penalty", math.inf),
    ],
)
def test_invalid_sampling_values_name_the_field(field: str, value: float) -> None:
    err = refused(completion(**{field: value}).sampling_params, 1, MAX_LEN)
    assert err.status == 400 and err.param == field and field in err.message


def test_context_length_check_reports_the_numbers() -> None:
    assert completion(max_tokens=90).sampling_params(10, MAX_LEN).max_tokens == 90
    err = refused(completion(max_tokens=91).sampling_params, 10, MAX_LEN)
    assert err.code == "context_length_exceeded" and err.param == "max_tokens"
    for number in ("100", "101", "10", "91"):
        assert number in err.message
    err = refused(completion().sampling_params, MAX_LEN, MAX_LEN)
    assert err.code == "context_length_exceeded" and err.param == "prompt" and str(MAX_LEN) in err.message


def test_check_token_ids() -> None:
    check_token_ids([0, 5, 9], 10, "prompt")
    for bad in ([10], [-1], [3, 12]):
        err = refused(check_token_ids, bad, 10, "prompt")
        assert err.param == "prompt" and "[0, 10)" in err.message


# ---------------------------------------------------------------------------- chat


def test_chat_default_max_tokens_fill_the_context() -> None:
    assert chat().sampling_params(30, MAX_LEN).max_tokens == 70
    assert chat(max_tokens=5).sampling_params(30, MAX_LEN).max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).sampling_params(30, MAX_LEN).max_tokens == 9
    err = refused(chat(max_completion_tokens=71).sampling_params, 30, MAX_LEN)
    assert err.param == "max_completion_tokens" and err.code == "context_length_exceeded"
    err = refused(chat().sampling_params, MAX_LEN, MAX_LEN)
    assert err.param == "messages"
    assert (
        refused(chat(max_completion_tokens=0).sampling_params, 30, MAX_LEN).param == "max_completion_tokens"
    )
    assert chat(max_completion_tokens=0, prompt_logprobs=1).sampling_params(30, MAX_LEN).max_tokens == 0


def test_chat_logprobs_flags() -> None:
    assert chat().sampling_params(1, MAX_LEN).logprobs is None
    assert chat(logprobs=True).sampling_params(1, MAX_LEN).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).sampling_params(1, MAX_LEN).logprobs == 5
    assert refused(chat(top_logprobs=2).sampling_params, 1, MAX_LEN).param == "top_logprobs"
    assert refused(chat(logprobs=True, top_logprobs=21).sampling_params, 1, MAX_LEN).param == "top_logprobs"


def test_chat_messages_render_for_templates() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "function": {"name": "f"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ]
        }
    )
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "wizard", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": "x"}}]}],
        [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": []}],  # a null user content is refused; an empty list too
        [{"role": "assistant", "content": []}],
        "hello",
    ],
)
def test_bad_messages_fail_validation(messages: object) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": messages})


def test_stream_options() -> None:
    assert not chat(stream=True).include_usage
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


# ---------------------------------------------------------------------------- logprobs


TEXT = {1: "a", 2: "bc", 3: "d", 4: "\u00e9"}
RAW = {i: t.encode() for i, t in TEXT.items()}


def test_completion_logprobs_offsets_and_top() -> None:
    items = [TokenLogprob(2, -0.5, ((2, -0.5), (1, -1.5))), TokenLogprob(3, -2.0, ((1, -0.1), (4, -1.0)))]
    lp = completion_logprobs(items, TEXT.__getitem__, text_offsets=[10, 12])
    assert lp.tokens == ["bc", "d"]
    assert lp.token_logprobs == [-0.5, -2.0]
    assert lp.text_offset == [10, 12]
    assert lp.top_logprobs == [{"bc": -0.5, "a": -1.5}, {"a": -0.1, "\u00e9": -1.0, "d": -2.0}]


def test_logprobs_clamp_non_finite_values() -> None:
    items = [TokenLogprob(1, -math.inf, ((3, -math.inf),))]
    lp = completion_logprobs(items, TEXT.__getitem__, [0])
    assert lp.token_logprobs == [MIN_LOGPROB] and lp.top_logprobs == [{"d": MIN_LOGPROB, "a": MIN_LOGPROB}]
    out = chat_logprobs(items, TEXT.__getitem__, RAW.__getitem__, 1)
    assert out.content is not None and out.content[0].logprob == MIN_LOGPROB
    assert out.content[0].top_logprobs[0].logprob == MIN_LOGPROB


def test_chat_logprobs_bytes_and_top_count() -> None:
    items = [TokenLogprob(4, -0.25, ((4, -0.25), (1, -2.0), (3, -3.0)))]
    out = chat_logprobs(items, TEXT.__getitem__, RAW.__getitem__, num_top=2)
    assert out.content is not None
    tok = out.content[0]
    assert (tok.token, tok.logprob, tok.bytes) == ("\u00e9", -0.25, [0xC3, 0xA9])
    assert [(t.token, t.logprob, t.bytes) for t in tok.top_logprobs] == [
        ("\u00e9", -0.25, [0xC3, 0xA9]),
        ("a", -2.0, [97]),
    ]
    none = chat_logprobs(items, TEXT.__getitem__, RAW.__getitem__, num_top=0)
    assert none.content is not None and none.content[0].top_logprobs == []


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from swaserve.model.checkpoint import tiny_model_dir

    return AutoTokenizer.from_pretrained(str(tiny_model_dir()))


def test_token_texts_recover_bytes_of_a_byte_level_vocabulary(tokenizer: Any) -> None:
    tok = tokenizer
    texts = TokenTexts(tok)
    vocab = len(tok)
    partial = 0
    for tid in range(vocab):
        raw = texts.raw(tid)
        assert raw, tid
        text = texts.text(tid)
        try:
            assert text == raw.decode("utf-8") == tok.decode([tid])
        except UnicodeDecodeError:
            partial += 1
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            assert "\ufffd" in tok.decode([tid])
    assert partial > 0  # the tiny vocabulary splits some multi-byte characters
    # concatenated token bytes are exactly the UTF-8 of the decoded sequence
    sample = "caf\u00e9 \u2014 na\u00efve \u65e5\u672c"
    ids = tok.encode(sample)
    assert b"".join(texts.raw(i) for i in ids).decode() == tok.decode(ids) == sample
    assert texts.raw(2) == b"<|im_end|>" and texts.text(2) == "<|im_end|>"


# ---------------------------------------------------------------------------- metrics


def _stats() -> EngineStats:
    return EngineStats(
        num_running=3,
        num_waiting=2,
        pools={
            "full": PoolStats(
                total_pages=100, used_pages=25, peak_used_pages=40, page_bytes=1024, num_layers=2
            ),
            "swa": PoolStats(total_pages=50, used_pages=10, peak_used_pages=12, page_bytes=512, num_layers=6),
        },
        prompt_tokens_total=123,
        generation_tokens_total=45,
        prefix_cache=CacheStats(queries=1000, hits_device=600, hits_host=150),
        cache_pages={"full": 7, "swa": 3, "host_full": 20, "host_swa": 2},
    )


def test_engine_gauges_are_read_at_scrape_time() -> None:
    state = {"stats": _stats()}
    m = ServerMetrics(lambda: state["stats"], "tiny")
    get = m.registry.get_sample_value
    assert get("swaserve:num_requests_running", {"model_name": "tiny"}) == 3
    assert get("swaserve:num_requests_waiting", {"model_name": "tiny"}) == 2
    assert get("swaserve:kv_cache_usage_perc", {"model_name": "tiny", "pool": "full"}) == 0.25
    assert get("swaserve:kv_cache_usage_perc", {"model_name": "tiny", "pool": "swa"}) == 0.2
    assert get("swaserve:kv_cache_used_pages", {"model_name": "tiny", "pool": "swa"}) == 10
    assert get("swaserve:kv_cache_total_pages", {"model_name": "tiny", "pool": "full"}) == 100
    assert get("swaserve:kv_cache_peak_used_pages", {"model_name": "tiny", "pool": "full"}) == 40
    assert get("swaserve:kv_cache_used_bytes", {"model_name": "tiny", "pool": "full"}) == 25 * 1024
    assert get("swaserve:prompt_tokens_total", {"model_name": "tiny"}) == 123
    assert get("swaserve:generation_tokens_total", {"model_name": "tiny"}) == 45
    assert get("swaserve:prefix_cache_queries_total", {"model_name": "tiny"}) == 1000
    assert get("swaserve:prefix_cache_hits_total", {"model_name": "tiny", "tier": "device"}) == 600
    assert get("swaserve:prefix_cache_hits_total", {"model_name": "tiny", "tier": "host"}) == 150
    assert get("swaserve:prefix_cache_pages", {"model_name": "tiny", "pool": "host_full"}) == 20
    state["stats"] = EngineStats(num_running=0, num_waiting=0)
    assert get("swaserve:num_requests_running", {"model_name": "tiny"}) == 0
    text, content_type = m.render()
    assert content_type.startswith("text/plain") and b"swaserve:num_requests_waiting" in text


def test_registries_are_per_app() -> None:
    a, b = ServerMetrics(_stats, "m"), ServerMetrics(_stats, "m")
    a.count_finished(FinishReason.STOP)
    assert (
        a.registry.get_sample_value(
            "swaserve:request_success_total", {"model_name": "m", "finished_reason": "stop"}
        )
        == 1
    )
    assert (
        b.registry.get_sample_value(
            "swaserve:request_success_total", {"model_name": "m", "finished_reason": "stop"}
        )
        == 0
    )


class FakeClock:
    """A settable clock (time itself is the thing under test, not a component of ours)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_request_timer_latencies() -> None:
    m = ServerMetrics(_stats, "m")
    clock = FakeClock()
    clock.now = 100.0
    timer = RequestTimer(m, clock)
    base = dict(request_id="r", arrival_time=100.0, first_scheduled_time=100.5)
    clock.now = 101.0
    timer.observe(RequestOutput(new_token_ids=[1], first_token_time=100.75, **base))
    clock.now = 101.2
    timer.observe(RequestOutput(new_token_ids=[2, 3], **base))
    clock.now = 101.6
    timer.observe(RequestOutput(new_token_ids=[4], finished=True, finish_reason=FinishReason.LENGTH, **base))
    timer.abort()  # after the end: ignored
    get = m.registry.get_sample_value
    labels = {"model_name": "m"}
    assert get("swaserve:request_queue_time_seconds_sum", labels) == pytest.approx(0.5)
    assert get("swaserve:time_to_first_token_seconds_sum", labels) == pytest.approx(0.75)
    assert get("swaserve:time_to_first_token_seconds_count", labels) == 1
    # gaps: 100.75 -> 101.2 over two tokens, then 101.2 -> 101.6
    assert get("swaserve:inter_token_latency_seconds_count", labels) == 3
    assert get("swaserve:inter_token_latency_seconds_sum", labels) == pytest.approx(0.45 + 0.4)
    assert get("swaserve:e2e_request_latency_seconds_sum", labels) == pytest.approx(1.6)
    assert get("swaserve:request_success_total", {"model_name": "m", "finished_reason": "length"}) == 1
    assert get("swaserve:request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 0
    assert get("swaserve:time_to_first_token_seconds_bucket", {**labels, "le": "0.75"}) == 1
    assert TTFT_BUCKETS[0] == 0.001 and ITL_BUCKETS[-1] == 80.0


def test_request_timer_abort_and_discard() -> None:
    m = ServerMetrics(_stats, "m")
    m.timer().abort()
    m.timer().discard()
    get = m.registry.get_sample_value
    assert get("swaserve:request_success_total", {"model_name": "m", "finished_reason": "abort"}) == 1
    assert get("swaserve:e2e_request_latency_seconds_count", {"model_name": "m"}) == 1


def test_a_negative_max_tokens_names_the_field_the_request_used_and_its_floor() -> None:
    err = refused(chat(max_completion_tokens=-1).sampling_params, 30, MAX_LEN)
    assert err.param == "max_completion_tokens" and str(err).startswith(
        "max_completion_tokens must be at least 1"
    )
    err = refused(chat(max_tokens=-1).sampling_params, 30, MAX_LEN)
    assert err.param == "max_tokens" and "at least 1" in str(err)
    err = refused(completion(max_tokens=-5, echo=True).sampling_params, 5, MAX_LEN)
    assert err.param == "max_tokens" and "at least 0, got -5" in str(err)
