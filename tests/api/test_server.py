"""The OpenAI-compatible server on a real engine with the tiny random MiMo-V2 checkpoint.

Most tests talk to the app in-process (httpx over ASGI); the disconnect tests run a real uvicorn
on 127.0.0.1, because only a real socket can go away mid-request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from swaserve.api.logprobs import TokenTexts
from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.async_engine import AsyncLLMEngine
from swaserve.engine.client import LocalEngineClient
from swaserve.engine.factory import build_engine_client
from swaserve.model.checkpoint import tiny_model_dir
from swaserve.procs import free_port

pytestmark = pytest.mark.anyio

# A short context keeps "generate to the end of the context" tests fast; the KV cache holds several
# full-length requests.
MAX_LEN = 320
ENGINE_CONFIG = EngineConfig(
    kv_cache_memory=8 * 1024 * 1024,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    max_model_len=MAX_LEN,
    dtype="float32",
    device="cpu",
)
# 2 MiB of fp32 KV: the SWA pool gets half and the full pool the rest (~2.7k tokens), less than the
# 4096-token context, so some requests fit the context but never the cache.
SMALL_KV_CONFIG = EngineConfig(
    kv_cache_memory=2 * 1024 * 1024, max_num_seqs=8, max_num_batched_tokens=256, dtype="float32", device="cpu"
)


@dataclass
class Served:
    engine: LocalEngineClient
    app: Any
    client: httpx.AsyncClient

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def metric(self, name: str, **labels: str) -> float:
        value = self.app.state.metrics.registry.get_sample_value(
            name, {"model_name": self.engine.model_name, **labels}
        )
        return 0.0 if value is None else value


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model_dir()


@pytest.fixture(scope="module", params=["inline", pytest.param("separate", marks=pytest.mark.cluster)])
async def served(model_dir: Path, request: pytest.FixtureRequest) -> AsyncIterator[Served]:
    """The app over the inline engine, and over the engine core in its own process."""
    engine = build_engine_client(
        str(model_dir), dataclasses.replace(ENGINE_CONFIG, engine_process=request.param)
    )
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://swaserve", timeout=120) as client:
            yield Served(engine, app, client)
    assert not engine.running


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (comments and blank lines dropped)."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


def assert_openai_error(
    r: httpx.Response, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


async def complete(s: Served, **body: Any) -> dict[str, Any]:
    r = await s.client.post("/v1/completions", json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ---------------------------------------------------------------------------- happy paths


async def test_completion_text_prompt(served: Served) -> None:
    prompt = "The agent opened the file and"
    body = await complete(served, prompt=prompt, max_tokens=12, ignore_eos=True, return_token_ids=True)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == served.engine.model_name and isinstance(body["created"], int)
    (choice,) = body["choices"]
    prompt_ids = served.tokenizer.encode(prompt)
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 12
    assert choice["text"] == served.tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_token_id_prompts_equal_text_prompt(served: Served) -> None:
    prompt = "Reading the config file"
    ids = served.tokenizer.encode(prompt)
    answers = [
        await complete(served, prompt=p, max_tokens=6, ignore_eos=True, return_token_ids=True)
        for p in (prompt, [prompt], ids, [ids])
    ]
    assert len({json.dumps(a["choices"][0]["token_ids"]) for a in answers}) == 1
    assert len({a["choices"][0]["text"] for a in answers}) == 1
    assert all(a["choices"][0]["prompt_token_ids"] == ids for a in answers)


async def test_optional_fields_are_absent_unless_asked(served: Served) -> None:
    body = await complete(served, prompt="hello", max_tokens=2, user="u1")
    assert "token_ids" not in body["choices"][0] and "prompt_token_ids" not in body["choices"][0]


async def test_chat_completion(served: Served) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
    ]
    r = await served.client.post(
        "/v1/chat/completions",
        json={
            "model": served.engine.model_name,
            "messages": messages,
            "max_completion_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    rendered = served.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered.endswith("<|im_start|>assistant\n")
    prompt_ids = served.tokenizer.encode(rendered, add_special_tokens=False)
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == served.tokenizer.decode(
        choice["token_ids"], skip_special_tokens=True
    )
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 10
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 10


async def test_chat_default_max_tokens_fill_the_context(served: Served) -> None:
    r = await served.client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (
        len(choice["prompt_token_ids"]) + len(choice["token_ids"]) == served.engine.max_model_len == MAX_LEN
    )


async def test_streaming_completion_matches_non_streaming(served: Served) -> None:
    req = {
        "prompt": "Running the tests now",
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = await complete(served, **req)
    r = await served.client.post(
        "/v1/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    *token_chunks, usage_chunk = chunks
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in token_chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert "".join(c["choices"][0]["text"] for c in token_chunks) == whole["choices"][0]["text"]
    ids = [t for c in token_chunks for t in c["choices"][0]["token_ids"]]
    assert ids == whole["choices"][0]["token_ids"]
    assert token_chunks[0]["choices"][0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in token_chunks[1:])
    assert [c["choices"][0]["finish_reason"] for c in token_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])


async def test_streaming_without_usage_has_no_usage_field(served: Served) -> None:
    r = await served.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "stream": True})
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    assert all("usage" not in json.loads(d) for d in data[:-1])


async def test_streaming_chat_matches_non_streaming(served: Served) -> None:
    req = {
        "messages": [{"role": "user", "content": "Show me the diff."}],
        "max_tokens": 15,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = await served.client.post("/v1/chat/completions", json=req)
    whole = r.json()["choices"][0]
    r = await served.client.post(
        "/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
    )
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    first, *rest, usage_chunk = chunks
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == whole["message"]["content"]
    assert [t for c in rest for t in c["choices"][0]["token_ids"]] == whole["token_ids"]
    assert rest[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 15


async def test_completion_logprobs_shape(served: Served) -> None:
    body = await complete(
        served, prompt="git status shows", max_tokens=8, logprobs=3, ignore_eos=True, return_token_ids=True
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(choice["token_ids"])
    assert n == 8 and all(
        len(lp[k]) == n for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    )
    texts = TokenTexts(served.tokenizer)
    assert lp["tokens"] == [texts.text(t) for t in choice["token_ids"]]
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and tok in top and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token
    # streamed logprobs concatenate to the same lists
    r = await served.client.post(
        "/v1/completions",
        json={
            "prompt": "git status shows",
            "max_tokens": 8,
            "logprobs": 3,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    )
    chunks = [json.loads(d) for d in sse_data(r.text)[:-1]]
    streamed = {k: [x for c in chunks for x in c["choices"][0]["logprobs"][k]] for k in lp}
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert streamed["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-5)


async def test_text_offsets_stay_inside_the_text_with_partial_utf8_tokens(served: Served) -> None:
    # tokens that are single bytes of a multi-byte character are shown as "bytes:\\x.." but add no
    # characters of their own: offsets must index the returned text, not those placeholders
    texts = TokenTexts(served.tokenizer)
    partial = [t for t in range(served.engine.model_config.vocab_size) if texts.text(t).startswith("bytes:")]
    assert partial, "the tiny tokenizer has byte tokens that are not UTF-8 on their own"
    body = await complete(served, prompt=[*partial[:6], 5, 6], max_tokens=12, logprobs=0, ignore_eos=True)
    text, offsets = body["choices"][0]["text"], body["choices"][0]["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)


async def test_chat_logprobs_shape(served: Served) -> None:
    r = await served.client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
            "return_token_ids": True,
        },
    )
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == len(choice["token_ids"]) == 5
    texts = TokenTexts(served.tokenizer)
    for entry, tid in zip(content, choice["token_ids"], strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == texts.text(tid)
        assert entry["bytes"] == list(texts.raw(tid))
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    r = await served.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True},
    )
    assert all(e["top_logprobs"] == [] for e in r.json()["choices"][0]["logprobs"]["content"])


async def test_stop_string_and_seed(served: Served) -> None:
    base = await complete(served, prompt="Then the build", max_tokens=30, ignore_eos=True)
    text = base["choices"][0]["text"]
    stop = next(text[i : i + 3] for i in range(3, len(text) - 3) if text[i : i + 3].strip())
    cut = await complete(served, prompt="Then the build", max_tokens=30, ignore_eos=True, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    a, b = [await complete(served, prompt="x", max_tokens=10, temperature=1.0, seed=7) for _ in range(2)]
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


async def test_models_health_metrics(served: Served) -> None:
    r = await served.client.get("/v1/models")
    assert r.status_code == 200
    (card,) = r.json()["data"]
    assert card["id"] == served.engine.model_name and card["object"] == "model"
    assert card["max_model_len"] == served.engine.max_model_len
    r = await served.client.get("/health")
    assert r.status_code == 200
    before = served.metric("swaserve:request_success_total", finished_reason="length")
    ttft_before = served.metric("swaserve:time_to_first_token_seconds_count")
    await complete(served, prompt="metrics", max_tokens=4, ignore_eos=True)
    r = await served.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "kv_cache_used_pages",
        "kv_cache_total_pages",
        "kv_cache_peak_used_pages",
        "kv_cache_used_bytes",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
    ):
        assert f"swaserve:{name}{{" in text, name
    model = served.engine.model_name
    total = served.engine.stats().pools["full"].total_pages
    assert f'swaserve:kv_cache_total_pages{{model_name="{model}",pool="full"}} {float(total)}' in text
    assert 'pool="swa"' in text
    cfg, page = served.engine.model_config, served.engine.engine_config.page_size
    full_tok = len(cfg.full_layers) * cfg.full.kv_bytes_per_token(4)  # float32, auto: no scales
    assert served.metric("swaserve:kv_cache_token_bytes", pool="full", format="auto") == full_tok
    assert served.engine.stats().pools["full"].page_bytes == page * full_tok
    assert served.metric("swaserve:request_success_total", finished_reason="length") == before + 1
    assert served.metric("swaserve:time_to_first_token_seconds_count") == ttft_before + 1
    stats = served.engine.stats()
    assert served.metric("swaserve:generation_tokens_total") == stats.generation_tokens_total > 0
    assert served.metric("swaserve:kv_cache_used_pages", pool="full") == stats.pools["full"].used_pages


# ---------------------------------------------------------------------------- bad requests

Case = tuple[str, str, Any, int, str | None, str | None]  # id, path, body, status, param, code


def bad_cases(vocab: int, max_len: int) -> list[Case]:
    chat_msgs = [{"role": "user", "content": "hi"}]
    return [
        ("malformed-json", "/v1/completions", b'{"prompt": "x", ', 400, None, None),
        ("lone-surrogate", "/v1/completions", b'{"prompt": "\\ud800abc"}', 400, "prompt", None),
        ("invalid-utf8", "/v1/completions", b'{"prompt": "a\xff\xfeb"}', 400, None, None),
        (
            "chat-lone-surrogate",
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
            400,
            "messages",
            None,
        ),
        ("json-array", "/v1/completions", b"[1, 2]", 400, None, None),
        ("not-json-content-type", "/v1/completions", None, 400, None, None),
        ("missing-prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt", None),
        ("string-max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", None),
        (
            "bool-temperature",
            "/v1/completions",
            {"prompt": "x", "temperature": True},
            400,
            "temperature",
            None,
        ),
        ("float-token-id", "/v1/completions", {"prompt": [1, 2.5]}, 400, "prompt", None),
        (
            "unknown-model",
            "/v1/completions",
            {"prompt": "x", "model": "gpt-5"},
            404,
            "model",
            "model_not_found",
        ),
        ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "prompt", None),
        ("empty-ids", "/v1/completions", {"prompt": []}, 400, "prompt", None),
        ("batch-with-empty", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt", None),
        (
            "too-long",
            "/v1/completions",
            {"prompt": [5] * 10, "max_tokens": max_len},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        (  # refused before tokenizing: more characters than max_len tokens can stand for
            "huge-text-prompt",
            "/v1/completions",
            {"prompt": "hello world " * 100_000},
            400,
            "prompt",
            "context_length_exceeded",
        ),
        (
            "negative-temperature",
            "/v1/completions",
            {"prompt": "x", "temperature": -1},
            400,
            "temperature",
            None,
        ),
        ("top-p-zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
        ("top-k-zero", "/v1/completions", {"prompt": "x", "top_k": 0}, 400, "top_k", None),
        ("zero-max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
        ("logprobs-21", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs", None),
        ("five-stops", "/v1/completions", {"prompt": "x", "stop": list("abcde")}, 400, "stop", None),
        ("id-out-of-vocab", "/v1/completions", {"prompt": [1, vocab]}, 400, "prompt", None),
        ("negative-id", "/v1/completions", {"prompt": [-3]}, 400, "prompt", None),
        (
            "stop-id-out-of-vocab",
            "/v1/completions",
            {"prompt": "x", "stop_token_ids": [vocab + 5]},
            400,
            "stop_token_ids",
            None,
        ),
        ("n-65", "/v1/completions", {"prompt": "x", "n": 65}, 400, "n", None),
        ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
        ("unknown-field", "/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", None),
        (
            "bias-out-of-vocab",
            "/v1/completions",
            {"prompt": "x", "logit_bias": {str(vocab): 1}},
            400,
            "logit_bias",
            None,
        ),
        ("batch-id-out-of-vocab", "/v1/completions", {"prompt": [[1], [vocab]]}, 400, "prompt", None),
        (
            "stream-bad-value",
            "/v1/completions",
            {"prompt": "x", "stream": True, "top_p": 2},
            400,
            "top_p",
            None,
        ),
        ("chat-no-messages", "/v1/chat/completions", {"messages": []}, 400, "messages", None),
        ("chat-missing-messages", "/v1/chat/completions", {"prompt": "x"}, 400, "messages", None),
        (
            "chat-bad-role",
            "/v1/chat/completions",
            {"messages": [{"role": "bot", "content": "x"}]},
            400,
            "messages",
            None,
        ),
        (
            "chat-image",
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            },
            400,
            "messages",
            None,
        ),
        (
            "chat-unknown-model",
            "/v1/chat/completions",
            {"messages": chat_msgs, "model": "m"},
            404,
            "model",
            "model_not_found",
        ),
        (
            "chat-too-long",
            "/v1/chat/completions",
            {"messages": chat_msgs, "max_completion_tokens": max_len},
            400,
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        (
            "chat-huge-message",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hello world " * 100_000}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            "chat-top-logprobs-alone",
            "/v1/chat/completions",
            {"messages": chat_msgs, "top_logprobs": 2},
            400,
            "top_logprobs",
            None,
        ),
        (
            "chat-stream-bad",
            "/v1/chat/completions",
            {"messages": chat_msgs, "stream": True, "n": 0},
            400,
            "n",
            None,
        ),
        ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, None, None),
    ]


async def test_bad_requests_get_openai_errors_and_server_keeps_serving(served: Served) -> None:
    max_len = served.engine.max_model_len
    cases = bad_cases(served.engine.model_config.vocab_size, max_len)
    failures = []
    for case_id, path, body, status, param, code in cases:
        if isinstance(body, bytes):
            r = await served.client.post(path, content=body, headers={"content-type": "application/json"})
        elif body is None:
            r = await served.client.post(
                path, content=b'{"prompt": "x"}', headers={"content-type": "text/plain"}
            )
        else:
            r = await served.client.post(path, json=body)
        try:
            err = assert_openai_error(r, status, param, code)
            assert r.headers["content-type"].startswith("application/json")
            if case_id in ("too-long", "chat-too-long"):
                assert str(max_len) in err["message"]
            ok = await complete(served, prompt="still alive", max_tokens=2)
            assert ok["usage"]["completion_tokens"] >= 1
        except AssertionError as e:
            failures.append(f"{case_id}: {e}")
    assert not failures, "\n".join(failures)
    r = await served.client.get("/v1/completions")
    assert_openai_error(r, 405)
    final = served.engine.stats()
    assert final.num_running == 0 and final.num_waiting == 0
    assert final.pools["full"].request_pages == 0


async def test_engine_refusal_is_a_400_and_health_follows_the_engine(model_dir: Path) -> None:
    """A KV cache smaller than the model's context lowers max_model_len; longer requests get a 400."""
    engine = AsyncLLMEngine.from_model_dir(str(model_dir), replace(SMALL_KV_CONFIG, kv_cache_memory=1 << 20))
    kv_tokens = engine.engine.limits.max_fit_tokens  # what one request can hold (full and SWA pages)
    assert kv_tokens == engine.max_model_len < engine.model_config.max_position_embeddings
    assert kv_tokens <= engine.stats().pools["full"].total_pages * SMALL_KV_CONFIG.page_size
    app = build_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://swaserve", timeout=60) as client:
        # before the lifespan starts the engine: not healthy, and generation is refused with a 503
        assert_openai_error(await client.get("/health"), 503, code="engine_not_running")
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_openai_error(r, 503, code="engine_not_running")
    async with app.router.lifespan_context(app):
        assert engine.running
        async with httpx.AsyncClient(transport=transport, base_url="http://swaserve", timeout=60) as client:
            assert (await client.get("/health")).status_code == 200
            for stream in (False, True):
                r = await client.post(
                    "/v1/completions", json={"prompt": [5] * 10, "max_tokens": kv_tokens, "stream": stream}
                )
                err = assert_openai_error(r, 400)
                assert str(kv_tokens) in err["message"]
                r = await client.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": 4})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
            assert engine.stats().pools["full"].request_pages == 0
    assert not engine.running


# ---------------------------------------------------------------------------- greedy parity with transformers


async def test_concurrent_greedy_outputs_equal_transformers_generate(served: Served, model_dir: Path) -> None:
    import torch
    from transformers import MiMoV2FlashForCausalLM

    tok = served.tokenizer
    texts = [
        "The agent reads the repository layout and then",
        "Fix the failing test in the parser module",
        "ls -la",
        "cat README",
    ]
    prompts = [tok.encode(t) for t in texts]
    lengths = sorted({len(p) for p in prompts})
    assert len(lengths) >= 2 and max(lengths) > served.engine.model_config.sliding_window
    new_tokens = 64

    async def one(ids: list[int]) -> list[int]:
        body = await complete(
            served, prompt=ids, max_tokens=new_tokens, ignore_eos=True, return_token_ids=True
        )
        return body["choices"][0]["token_ids"]

    got = await asyncio.gather(*(one(p) for p in prompts))

    model = MiMoV2FlashForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected: dict[int, list[int]] = {}
    for length in lengths:  # batch prompts of equal length: no padding needed
        group = [i for i, p in enumerate(prompts) if len(p) == length]
        ids = torch.tensor([prompts[i] for i in group])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        for row, i in enumerate(group):
            expected[i] = out[row, length:].tolist()
    for i, ids in enumerate(got):
        assert len(ids) == new_tokens
        assert ids == expected[i], (
            f"prompt {i} diverges at {next(j for j, (a, b) in enumerate(zip(ids, expected[i], strict=True)) if a != b)}"
        )


# ---------------------------------------------------------------------------- client disconnects


@pytest.fixture
async def live_url(served: Served) -> AsyncIterator[str]:
    """The same app behind a real uvicorn socket (the engine is already running)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(served.app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 20
    while not server.started:
        assert not task.done() and time.monotonic() < deadline, "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)


async def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def long_request(s: Served, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": "tail -f build.log",
        "max_tokens": MAX_LEN - 32,
        "ignore_eos": True,
        "temperature": 0,
        **extra,
    }


async def test_streaming_disconnect_aborts_and_frees_pages(served: Served, live_url: str) -> None:
    engine = served.engine
    aborts = served.metric("swaserve:request_success_total", finished_reason="abort")
    async with (
        httpx.AsyncClient(base_url=live_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=long_request(served, stream=True)) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        assert engine.stats().num_running == 1
        assert engine.stats().pools["full"].request_pages > 0
    # leaving the block closed the connection mid-stream
    await wait_until(
        lambda: engine.stats().pools["full"].request_pages == 0 and engine.stats().num_running == 0
    )
    assert engine.stats().pools["swa"].request_pages == 0
    await wait_until(
        lambda: served.metric("swaserve:request_success_total", finished_reason="abort") == aborts + 1
    )
    assert engine.stats().generation_tokens_total > 0
    body = await complete(served, prompt="after the disconnect", max_tokens=3)
    assert body["usage"]["completion_tokens"] >= 1


async def test_streaming_disconnect_of_n_choices_aborts_them_all(served: Served, live_url: str) -> None:
    """n > 1: every choice is read by its own task; a client leaving mid-stream must stop them all
    (closing an engine stream another task is reading fails, so the readers go first)."""
    engine = served.engine
    aborts = served.metric("swaserve:request_success_total", finished_reason="abort")
    generated = engine.stats().generation_tokens_total
    async with (
        httpx.AsyncClient(base_url=live_url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=long_request(served, stream=True, n=3)) as r,
    ):
        assert r.status_code == 200
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 6:
                break
        assert engine.stats().num_running == 3
    await wait_until(
        lambda: engine.stats().pools["full"].request_pages == 0 and engine.stats().num_running == 0
    )
    await wait_until(
        lambda: served.metric("swaserve:request_success_total", finished_reason="abort") == aborts + 3
    )
    assert engine.stats().generation_tokens_total < generated + 3 * (MAX_LEN - 32)  # none ran to the end
    body = await complete(served, prompt="after the disconnect", max_tokens=3)
    assert body["usage"]["completion_tokens"] >= 1


async def test_non_streaming_disconnect_aborts_and_frees_pages(served: Served, live_url: str) -> None:
    engine = served.engine
    aborts = served.metric("swaserve:request_success_total", finished_reason="abort")
    generated = engine.stats().generation_tokens_total
    async with httpx.AsyncClient(base_url=live_url, timeout=60) as client:
        task = asyncio.create_task(client.post("/v1/completions", json=long_request(served)))
        await wait_until(lambda: engine.stats().generation_tokens_total > generated + 5)
        assert engine.stats().num_running == 1 and engine.stats().pools["full"].request_pages > 0
        task.cancel()  # httpx drops the connection
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_until(
        lambda: engine.stats().pools["full"].request_pages == 0 and engine.stats().num_running == 0
    )
    await wait_until(
        lambda: served.metric("swaserve:request_success_total", finished_reason="abort") == aborts + 1
    )
    assert engine.stats().generation_tokens_total < generated + MAX_LEN - 32  # it did not run to the end
    body = await complete(served, prompt="after the disconnect", max_tokens=3)
    assert body["usage"]["completion_tokens"] >= 1


async def test_a_body_past_max_request_bytes_is_a_413_and_the_server_keeps_serving(served: Served) -> None:
    app = build_app(served.engine, manage_engine=False, max_request_bytes=2048)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://swaserve", timeout=120) as client:
        big = {"prompt": "x" * 4096, "max_tokens": 1}
        r = await client.post("/v1/completions", json=big)  # refused from its Content-Length
        assert "2048" in assert_openai_error(r, 413)["message"]

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(8):
                yield b"x" * 512
            yield b'", "max_tokens": 1}'

        r = await client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert "2048" in assert_openai_error(r, 413)["message"]
        r = await client.post(
            "/v1/completions", json={"prompt": "x" * 100, "max_tokens": 2, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


async def test_a_large_body_decodes_off_the_event_loop(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from swaserve.api import offloop

    threads: list[threading.Thread] = []
    real = json.loads

    def loads(raw: bytes) -> Any:
        threads.append(threading.current_thread())
        return real(raw)

    monkeypatch.setattr(offloop, "_decode", loads)
    loop_thread = threading.current_thread()
    small = await complete(served, prompt=[5, 6, 7], max_tokens=1)
    assert threads == [loop_thread]  # inline: a thread hop costs more than a small body
    # past OFF_LOOP_BYTES: decoded in a worker thread, then validated and answered as before
    pad = " " * offloop.OFF_LOOP_BYTES
    r = await served.client.post(
        "/v1/completions",
        content=b'{"prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0' + pad.encode() + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert len(threads) == 2 and threads[1] is not loop_thread
    assert r.json()["choices"][0]["text"] == small["choices"][0]["text"]
    bad = b'{"prompt": [5, 6, 7], "max_tokens": 1' + pad.encode()  # cut short: the same 400 as inline
    r = await served.client.post("/v1/completions", content=bad, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


async def test_oversized_lists_are_refused_before_validation(served: Served) -> None:
    from swaserve.api.protocol import MAX_CHOICES, MAX_MESSAGES, MAX_TOOLS

    c, max_len = served.client, served.engine.max_model_len
    msgs = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    err = assert_openai_error(await c.post("/v1/chat/completions", json={"messages": msgs}), 400, "messages")
    assert str(MAX_MESSAGES) in err["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]
    body = {"messages": msgs[:1], "tools": tools}
    assert_openai_error(await c.post("/v1/chat/completions", json=body), 400, "tools")
    choices = [f"c{i}" for i in range(MAX_CHOICES + 1)]
    body = {"prompt": "a", "max_tokens": 1, "guided_choice": choices}
    assert_openai_error(await c.post("/v1/completions", json=body), 400, "guided_choice")
    long_ids = [5] * (max_len + 1)  # one token id too many, alone and in a batch
    for prompt in (long_ids, [[5, 6], long_ids]):
        r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert_openai_error(r, 400, "prompt", "context_length_exceeded")
    assert_openai_error(await c.post("/detokenize", json={"tokens": long_ids}), 400, "tokens")
    assert_openai_error(await c.post("/tokenize", json={"messages": msgs}), 400, "messages")
    assert (await complete(served, prompt=[5] * 8, max_tokens=1))["usage"]["prompt_tokens"] == 8


async def test_chat_messages_take_only_their_roles_fields(served: Served) -> None:
    c = served.client
    bad = [
        {"role": "user", "content": "a", "baz": 1},  # unknown field
        {"role": "user", "content": None},  # only an assistant message may have no content
        {"role": "user", "content": "a", "tool_calls": []},
        {"role": "tool", "content": "42"},  # no tool_call_id
        {"role": "user", "content": "a", "tool_call_id": "c1"},
        {"role": "assistant", "content": "a", "refusal": "no"},  # refusal: only null
    ]
    for m in bad:
        r = await c.post("/v1/chat/completions", json={"messages": [m], "max_tokens": 1})
        assert_openai_error(r, 400)
    # an assistant message replayed as the openai client serializes a response's message
    replay = {"role": "assistant", "content": None, "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip
    msgs = [
        {"role": "user", "content": "hi"},
        replay,
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 200, r.text


async def test_tokenize_detokenize_and_the_model_card(served: Served) -> None:
    c, tok = served.client, served.engine.tokenizer
    name, max_len = served.engine.model_name, served.engine.max_model_len
    r = await c.post("/tokenize", json={"prompt": "hello world"})
    assert r.status_code == 200, r.text
    ids = tok.encode("hello world")
    assert r.json() == {"count": len(ids), "max_model_len": max_len, "tokens": ids}
    msgs = [{"role": "user", "content": "hi there"}]
    r = await c.post("/tokenize", json={"model": name, "messages": msgs})
    chat_ids = tok.encode(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert r.status_code == 200 and r.json()["tokens"] == chat_ids, r.text
    r = await c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(chat_ids)  # what /v1/chat/completions sees
    r = await c.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "hello world"}
    assert_openai_error(await c.post("/tokenize", json={"prompt": "x", "foo": 1}), 400)  # unknown field
    assert_openai_error(await c.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(
        await c.post("/tokenize", json={"model": "gpt-5", "prompt": "x"}), 404, "model", "model_not_found"
    )
    r = await c.get(f"/v1/models/{name}")
    assert r.status_code == 200 and r.json()["id"] == name and r.json()["max_model_len"] == max_len
    # vLLM's /tokenizer_info, as lm-eval's remote tokenizer reads it: special tokens that
    # /tokenize maps to the tokenizer's ids, and the template the server renders chats with
    info = (await c.get("/tokenizer_info")).json()
    assert info["model_max_length"] == max_len and info["chat_template"] == tok.chat_template
    assert info["eos_token"] == tok.eos_token and info["tokenizer_class"] == type(tok).__name__
    r = await c.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert r.json()["tokens"] == [tok.eos_token_id]
    assert_openai_error(await c.get("/v1/models/gpt-5"), 404, "model", "model_not_found")
