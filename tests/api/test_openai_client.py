"""The official ``openai`` client (async, in-process over ASGI) against the server on the tiny
random checkpoint: echo and prompt logprobs against transformers, n, batched prompts, logit_bias,
max_tokens 0, chat template options, the developer role, and lm-eval's exact requests."""

from __future__ import annotations

import math
import platform
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client
from tests.helpers.engine import reference_logits

pytestmark = pytest.mark.anyio
platform.processor()  # the openai client's headers ask for it; it runs `uname -p` once, here
TOL = 1e-4
CONFIG = EngineConfig(
    kv_cache_memory=8 << 20,
    max_num_seqs=16,
    max_num_batched_tokens=64,
    max_model_len=320,
    page_size=4,
    enable_prefix_caching=True,
    dtype="float32",
    device="cpu",
    engine_process="inline",
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served(tiny_dir: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Any]]:
    engine = build_engine_client(str(tiny_dir), CONFIG)
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://swaserve", timeout=120
        )
        client = openai.AsyncOpenAI(
            base_url="http://swaserve/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield client, engine
        await client.close()


async def test_echo_logprobs_equal_transformers_log_softmax(served, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    ids = engine.tokenizer.encode("The agent opened the file and read every line of it")
    ref = torch.log_softmax(reference_logits(hf_tiny, ids), dim=-1)
    for max_tokens in (0, 1):
        r = await client.completions.create(
            model=engine.model_name, prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0
        )
        (choice,) = r.choices
        assert "prompt_logprobs" not in (choice.model_extra or {})  # not asked for: not sent
        lp = choice.logprobs
        assert lp is not None and len(lp.token_logprobs) == len(ids) + max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for q in range(1, len(ids)):
            assert abs(lp.token_logprobs[q] - ref[q - 1, ids[q]].item()) <= TOL
            assert max(lp.top_logprobs[q].values()) == pytest.approx(ref[q - 1].max().item(), abs=TOL)
        assert choice.text.startswith(engine.tokenizer.decode(ids))
        assert r.usage is not None and r.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.finish_reason == "length" and choice.text == engine.tokenizer.decode(ids)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


async def test_vllm_prompt_logprobs(served, hf_tiny) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    ids = [5, 9, 14, 200, 33, 7]
    ref = torch.log_softmax(reference_logits(hf_tiny, ids), dim=-1)
    r = await client.completions.create(
        model=engine.model_name, prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert plp[0] is None and len(plp) == len(ids)
    for q in range(1, len(ids)):
        entry = plp[q]
        assert abs(entry[str(ids[q])]["logprob"] - ref[q - 1, ids[q]].item()) <= TOL
        top3 = ref[q - 1].topk(3).indices.tolist()
        assert [int(t) for t, e in sorted(entry.items(), key=lambda kv: kv[1]["rank"])][:3] == top3
        own = entry[str(ids[q])]["rank"]  # the prompt token's rank over the whole vocabulary
        row, mine = ref[q - 1], ref[q - 1, ids[q]]
        assert (row > mine + TOL).sum().item() + 1 <= own <= (row > mine - TOL).sum().item() + 1
    chat = await client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None


async def test_n_greedy_choices_are_identical_share_the_prompt_and_equal_one_request(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    prompt = "Reading the configuration file line by line, the agent found"
    before = engine.stats().prefix_cache.hits_device
    many = await client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=10, temperature=0, n=3
    )
    after = engine.stats().prefix_cache.hits_device
    n_prompt = len(engine.tokenizer.encode(prompt))
    # choices 1 and 2 start after choice 0 computed the prompt: they reuse its full pages
    assert after - before >= 2 * ((n_prompt - 1) // CONFIG.page_size * CONFIG.page_size)
    one = await client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=10, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert {c.text for c in many.choices} == {one.choices[0].text}
    assert many.usage is not None and one.usage is not None
    assert many.usage.prompt_tokens == one.usage.prompt_tokens  # counted once per prompt
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens


async def test_seeded_sampled_choices_differ_and_repeat(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    kw: dict[str, Any] = dict(
        model=engine.model_name, prompt="once upon", max_tokens=12, temperature=1.0, seed=7, n=3
    )
    a, b = await client.completions.create(**kw), await client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1
    single = await client.completions.create(**{**kw, "n": 1})
    assert single.choices[0].text == a.choices[0].text  # choice 0 uses the request's own seed


async def test_batched_prompts_number_choices_as_openai(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    prompts = ["alpha beta", "gamma", "delta epsilon zeta"]
    singles = [
        (await client.completions.create(model=engine.model_name, prompt=p, max_tokens=5, temperature=0))
        .choices[0]
        .text
        for p in prompts
    ]
    r = await client.completions.create(
        model=engine.model_name, prompt=prompts, max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in singles for _ in range(2)]
    streamed: dict[int, str] = {}
    stream = await client.completions.create(
        model=engine.model_name, prompt=prompts, max_tokens=5, temperature=0, stream=True
    )
    async for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == singles


async def test_logit_bias_forces_its_token(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    token = 42
    r = await client.completions.create(
        model=engine.model_name, prompt=[7, 8, 9], max_tokens=5, temperature=0,
        logit_bias={str(token): 100}, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert r.choices[0].model_extra["token_ids"] == [token] * 5  # type: ignore[index]
    chat = await client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0.8,
        logit_bias={str(token): 100}, seed=1, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].model_extra["token_ids"] == [token] * 3  # type: ignore[index]


async def test_chat_n_stream_developer_role_and_template_options(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    tok = engine.tokenizer
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    r = await client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=4, temperature=0, n=2,  # type: ignore[arg-type]
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    want = tok.encode(
        tok.apply_chat_template(as_system, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )
    assert r.choices[0].model_extra["prompt_token_ids"] == want  # type: ignore[index]
    assert r.choices[0].message.content == r.choices[1].message.content
    text: dict[int, str] = {0: "", 1: ""}
    stream = await client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=4, temperature=0, n=2, stream=True,  # type: ignore[arg-type]
    )  # fmt: skip
    async for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert text[0] == text[1] == r.choices[0].message.content
    cont = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "The answer is"}]
    r = await client.chat.completions.create(
        model=engine.model_name, messages=cont, max_tokens=2, temperature=0,  # type: ignore[arg-type]
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True},
    )  # fmt: skip
    ids = r.choices[0].model_extra["prompt_token_ids"]  # type: ignore[index]
    assert tok.decode(ids).endswith("The answer is")
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        await client.chat.completions.create(
            model=engine.model_name, messages=cont, max_tokens=2,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True},
        )  # fmt: skip


async def test_lm_eval_local_completions_requests(served) -> None:  # type: ignore[no-untyped-def]
    """The bodies lm-eval's ``local-completions`` sends (lm_eval/models/openai_completions.py):
    loglikelihood = token-id prompts in a batch, echo, logprobs 1, max_tokens 1, temperature 0;
    generate_until = a batch of prompts with stop strings. Parsed as lm-eval parses them."""
    client, engine = served
    http = client._client  # the same transport, raw JSON as lm-eval posts it
    ctx = [engine.tokenizer.encode("Question: what is two plus two? Answer:"), [5, 6, 7, 8]]
    cont = [engine.tokenizer.encode(" four"), [9, 10]]
    body = {
        "model": engine.model_name, "prompt": [c + k for c, k in zip(ctx, cont, strict=True)],
        "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True,
    }  # fmt: skip
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    for choice, c in zip(sorted(out["choices"], key=lambda x: x["index"]), ctx, strict=True):
        ctxlen = len(c)
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(lps) == len(cont[ctx.index(c)]) and all(math.isfinite(v) and v <= 0 for v in lps)
        assert all(
            isinstance(t, dict) and max(t.values()) >= v - 1e-6 for t, v in zip(tops, lps, strict=True)
        )
    gen = {
        "model": engine.model_name, "prompt": ["Q: hi\nA:", "Q: bye\nA:"], "max_tokens": 8,
        "temperature": 0, "stop": ["\n\n", "Q:"], "seed": 1234,
    }  # fmt: skip
    r = await http.post("/v1/completions", json=gen)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]


async def test_lm_eval_local_chat_completions_request(served) -> None:  # type: ignore[no-untyped-def]
    """lm-eval's ``local-chat-completions`` body (generate_until; it has no loglikelihood)."""
    client, engine = served
    body = {
        "messages": [{"role": "user", "content": "What is 2+2?"}], "model": engine.model_name,
        "max_tokens": 16, "temperature": 0, "stop": ["<|endoftext|>"], "seed": 1234,
    }  # fmt: skip
    r = await client._client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


async def test_stream_options_as_clients_send_them(served) -> None:  # type: ignore[no-untyped-def]
    """guidellm sends vLLM's continuous_usage_stats; the openai client types include_obfuscation."""
    client, engine = served
    stream = await client.completions.create(
        model=engine.model_name, prompt="a b c", max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    usages = [c.usage async for c in stream]
    counts = [u.completion_tokens for u in usages if u is not None]
    assert len(counts) == len(usages) and counts == sorted(counts) and counts[-1] == 4
    ok = await client.chat.completions.create(
        model=engine.model_name,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert [c async for c in ok]
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        await client.completions.create(
            model=engine.model_name, prompt="x", max_tokens=2, stream_options={"include_usage": True}
        )
    with pytest.raises(openai.BadRequestError, match="choices per request"):
        await client.completions.create(model=engine.model_name, prompt=["x"] * 64, max_tokens=1, n=17)
