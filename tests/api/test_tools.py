"""Tool calling with the official ``openai`` client on the tiny random checkpoint: a named or
required ``tool_choice`` is enforced (arguments parse and validate), ``auto`` parses the model's
``<tool_call>`` blocks (forced here with ``guided_regex``, since random weights never write one),
streamed deltas assemble to the same calls, and bad tool requests are 400s."""

from __future__ import annotations

import json
import platform
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from swaserve.api.server import build_app
from swaserve.api.tools import ToolCallParser
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client

pytestmark = pytest.mark.anyio
platform.processor()  # the openai client's headers ask for it; it runs `uname -p` once, here
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS: list[Any] = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def served(tiny_dir: Path) -> AsyncIterator[tuple[openai.AsyncOpenAI, Any]]:
    cfg = EngineConfig(
        kv_cache_memory=8 << 20, max_model_len=512, dtype="float32", device="cpu", engine_process="inline"
    )
    engine = build_engine_client(str(tiny_dir), cfg)
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=120)
        client = openai.AsyncOpenAI(base_url="http://x/v1", api_key="unused", http_client=http, max_retries=0)
        yield client, engine
        await client.close()


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


async def assemble(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    content, calls, reason = "", {}, None
    async for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            reason = ch.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_named_tool_choice_returns_a_call_whose_arguments_validate(served, temperature: float) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = await client.chat.completions.create(
        model=engine.model_name, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=64,  # type: ignore[arg-type]
        temperature=temperature, seed=5,
    )  # fmt: skip
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    check_calls(msg.tool_calls, {"get_weather"})
    stream = await client.chat.completions.create(
        model=engine.model_name, messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=64,  # type: ignore[arg-type]
        temperature=temperature, seed=5, stream=True,
    )  # fmt: skip
    content, calls, reason = await assemble(stream)
    assert content == "" and reason == "tool_calls" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert calls[0]["arguments"] == msg.tool_calls[0].function.arguments  # type: ignore[index]


async def test_a_named_call_cut_by_max_tokens_is_the_same_partial_call_streamed_or_not(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw: Any = {"model": engine.model_name, "messages": MSGS, "tools": TOOLS, "tool_choice": choice,
               "max_tokens": 3, "temperature": 0}  # fmt: skip
    r = await client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    partial = msg.tool_calls[0].function.arguments  # type: ignore[union-attr]
    content, calls, reason = await assemble(await client.chat.completions.create(**kw, stream=True))
    assert content == "" and reason == "length" and calls[0]["arguments"] == partial


async def test_required_tool_choice_calls_some_tool(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    kw: dict[str, Any] = dict(
        model=engine.model_name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS, tool_choice="required", temperature=0, parallel_tool_calls=False, max_tokens=96,
    )  # fmt: skip
    r = await client.chat.completions.create(**kw)
    calls = r.choices[0].message.tool_calls
    check_calls(calls, set(SCHEMAS))
    assert calls is not None and len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    _, streamed, reason = await assemble(await client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and [c["name"] for c in streamed.values()] == [calls[0].function.name]
    assert json.loads(streamed[0]["arguments"]) == json.loads(calls[0].function.arguments)
    # parallel calls: random weights keep adding calls until max_tokens; a cut list is raw text
    r = await client.chat.completions.create(**{**kw, "parallel_tool_calls": True, "max_tokens": 48})
    choice = r.choices[0]
    if choice.finish_reason == "length":
        assert choice.message.tool_calls is None and (choice.message.content or "").startswith("[{")
    else:
        check_calls(choice.message.tool_calls, set(SCHEMAS))


async def test_auto_parses_the_models_tool_call_blocks(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    forced = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Lima", "days": 2\}\}</tool_call>'
    )
    kw: dict[str, Any] = dict(
        model=engine.model_name, messages=MSGS, tools=TOOLS, max_tokens=80, temperature=0,
        extra_body={"guided_regex": forced},
    )  # fmt: skip
    r = await client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.content == "Sure." and r.choices[0].finish_reason == "tool_calls"
    check_calls(msg.tool_calls, {"get_weather"})
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Lima", "days": 2}  # type: ignore[index]
    content, calls, reason = await assemble(await client.chat.completions.create(**kw, stream=True))
    assert content.strip() == "Sure." and reason == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Lima",
        "days": 2,
    }


async def test_tools_reach_the_template_unless_choice_is_none(served) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    tok = engine.tokenizer

    async def prompt_ids(**kw: Any) -> list[int]:
        r = await client.chat.completions.create(
            model=engine.model_name, messages=MSGS, max_tokens=1, extra_body={"return_token_ids": True}, **kw
        )
        return r.choices[0].model_extra["prompt_token_ids"]  # type: ignore[index]

    with_tools = tok.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert await prompt_ids(tools=TOOLS) == tok.encode(with_tools, add_special_tokens=False)
    assert await prompt_ids(tools=TOOLS, tool_choice="none") == await prompt_ids()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        (  # a parameters schema llguidance cannot compile
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
async def test_bad_tool_requests_are_400s_and_the_server_keeps_serving(
    served, extra: dict[str, Any], param: str
) -> None:  # type: ignore[no-untyped-def]
    client, engine = served
    r = await client._client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = await client.chat.completions.create(model=engine.model_name, messages=MSGS, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


def test_parser_streams_like_the_whole_text() -> None:
    text = 'a <tool_ca b <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> c <tool_call>bad</tool_call>'
    whole = ToolCallParser()
    content_w, calls_w = whole.feed(text)
    content_w += whole.finish()
    piece = ToolCallParser()
    content_p, calls_p = "", []
    for ch in text:
        c, calls = piece.feed(ch)
        content_p, calls_p = content_p + c, calls_p + calls
    content_p += piece.finish()
    assert content_p == content_w == "a <tool_ca b  c <tool_call>bad</tool_call>"
    assert [c.function.arguments for c in calls_p] == [c.function.arguments for c in calls_w] == ['{"x": 1}']
