"""Structured output through the HTTP API, driven by the official ``openai`` client (in-process over
ASGI; the tiny random checkpoint): ``response_format`` json_schema / json_object and vLLM's
``guided_*`` fields always produce text that parses and validates, greedy and seeded, streamed
and not; bad constraints are 400s naming the field, and the server keeps serving. One test runs
the engine core in its own process (``--engine-process separate``)."""

from __future__ import annotations

import dataclasses
import json
import platform
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx2
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client
from tests.engine.test_structured import NESTED, PERSON

pytestmark = pytest.mark.anyio
# the openai client reports the platform in its headers; Python's first platform() call runs
# `uname -p` (a child process, which tests not marked cluster must not start), later ones are cached
platform.platform()

ENGINE_CONFIG = EngineConfig(
    kv_cache_memory=8 << 20, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512, device="cpu"
)
MODEL = "mimo-v2-tiny-v2"
COLORS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4}
CODE = {"type": "string", "pattern": "^[A-Z][a-z]{1,5}-[0-9]{2}$"}
SCHEMAS = {"person": PERSON, "nested": NESTED, "colors": COLORS, "code": CODE}
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a pet as JSON."}]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def client(tiny_dir: Path) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official async client over the app on the inline engine (in-process, no socket)."""
    engine = build_engine_client(str(tiny_dir), dataclasses.replace(ENGINE_CONFIG, engine_process="inline"))
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://swaserve")
        async with openai.AsyncOpenAI(
            api_key="none", base_url="http://swaserve/v1", http_client=http, max_retries=0
        ) as c:
            yield c


def schema_format(name: str) -> Any:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def chat_text(client: openai.AsyncOpenAI, stream: bool, **kw: Any) -> tuple[str, str | None]:
    """(content, finish_reason) of one chat completion, streamed or not."""
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, **kw}
    if not stream:
        r = await client.chat.completions.create(**kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"]
)
async def test_json_schema_output_always_validates(
    client: openai.AsyncOpenAI, name: str, stream: bool, sampling: dict[str, Any]
) -> None:
    text, reason = await chat_text(client, stream, response_format=schema_format(name), **sampling)
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMAS[name])
    if stream and "seed" in sampling:  # seeded and greedy are reproducible, streamed or not
        assert (await chat_text(client, False, response_format=schema_format(name), **sampling))[0] == text


async def test_the_clients_parse_helper_gets_its_pydantic_model(client: openai.AsyncOpenAI) -> None:
    class Pet(BaseModel):
        name: Annotated[str, Field(max_length=6)]
        kind: Literal["cat", "dog", "fish"]
        age: Annotated[int, Field(ge=0, le=30)]

    for seed in range(3):
        r = await client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=100, temperature=1.0, seed=seed
        )
        pet = r.choices[0].message.parsed
        assert isinstance(pet, Pet) and len(pet.name) <= 6 and 0 <= pet.age <= 30


async def test_completions_take_response_format_and_guided_json(client: openai.AsyncOpenAI) -> None:
    for extra in (
        {"response_format": schema_format("person")},
        {"guided_json": PERSON},
        {"guided_json": json.dumps(NESTED)},  # vLLM also takes the schema as a string
    ):
        schema = NESTED if isinstance(extra.get("guided_json"), str) else PERSON
        r = await client.completions.create(
            model=MODEL, prompt="pet:", max_tokens=200, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)


async def test_json_object_is_an_object(client: openai.AsyncOpenAI) -> None:
    for stream in (False, True):
        text, reason = await chat_text(  # a prompt the tiny random model closes its object on
            client,
            stream,
            messages=[{"role": "user", "content": "Describe a pet as JSON!"}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=400,
        )
        assert reason == "stop" and isinstance(json.loads(text), dict), text
    text, _ = await chat_text(client, False, response_format={"type": "text"}, temperature=0, max_tokens=8)
    assert text  # "text" is no constraint


async def test_guided_regex_choice_and_grammar(client: openai.AsyncOpenAI) -> None:
    regex = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    choices = ["positive", "negative", "neutral"]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        for stream in (False, True):
            text, reason = await chat_text(client, stream, extra_body={"guided_regex": regex}, **sampling)
            assert re.fullmatch(regex, text) and reason == "stop", text
            text, _ = await chat_text(client, stream, extra_body={"guided_choice": choices}, **sampling)
            assert text in choices
    grammar = 'start: "(" NUM " " OP " " NUM ")"\nNUM: /[0-9]{1,3}/\nOP: "+" | "-"'
    r = await client.completions.create(
        model=MODEL, prompt="sum:", max_tokens=30, temperature=0, extra_body={"guided_grammar": grammar}
    )
    assert re.fullmatch(r"\([0-9]{1,3} [+-] [0-9]{1,3}\)", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "response_format", "foo"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}},
         "guided_json", "nope"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one structured"),
    ],
)  # fmt: skip
async def test_bad_constraints_are_400s_and_the_server_keeps_serving(
    client: openai.AsyncOpenAI, extra: dict[str, Any], param: str, needle: str
) -> None:
    for call in (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra),
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            await call
        assert e.value.status_code == 400 and e.value.param == param
        assert needle in e.value.message
    r = await client.completions.create(model=MODEL, prompt="still there", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.cluster  # the engine core in its own process
async def test_structured_output_through_the_engine_process(tiny_dir: Path) -> None:
    engine = build_engine_client(str(tiny_dir), dataclasses.replace(ENGINE_CONFIG, engine_process="separate"))
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://swaserve")
        async with openai.AsyncOpenAI(api_key="none", base_url="http://swaserve/v1", http_client=http) as c:
            for stream in (False, True):
                text, reason = await chat_text(
                    c, stream, response_format=schema_format("person"), temperature=0
                )
                assert reason == "stop"
                jsonschema.validate(json.loads(text), PERSON)
            text, _ = await chat_text(
                c, False, extra_body={"guided_choice": ["yes", "no"]}, temperature=1.0, seed=1
            )
            assert text in ("yes", "no")
            with pytest.raises(openai.BadRequestError):
                await c.completions.create(
                    model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(("}
                )
