"""Every field of the official ``openai`` client's request types is either honored (200) or
answered 400 naming it, as docs/API.md says: no field is accepted and ignored unless documented so.

The test walks ``openai``'s TypedDicts, so a field a new client version adds fails here until it
gets a sample value below and a row in docs/API.md."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client

pytestmark = pytest.mark.anyio
DOC = Path(__file__).resolve().parents[2] / "docs" / "API.md"
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}

# field -> body additions that exercise it (valid by OpenAI's types)
SAMPLES: dict[str, dict[str, Any]] = {
    "best_of": {"best_of": 3},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "presence_penalty": {"presence_penalty": 0.5},
    "logit_bias": {"logit_bias": {"5": 1.0}},
    "logprobs": {"logprobs": 1},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "n": {"n": 2},
    "seed": {"seed": 1},
    "stop": {"stop": ["\n"]},
    "stream_options": {
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
    },
    "suffix": {"suffix": "x"},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "user": {"user": "u-1"},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "response_format": {"response_format": {"type": "json_object"}, "max_tokens": 8},
    "tools": {"tools": [TOOL]},
    "tool_choice": {"tools": [TOOL], "tool_choice": "none"},
    "parallel_tool_calls": {"tools": [TOOL], "parallel_tool_calls": False},
    "audio": {"audio": {"voice": "alloy", "format": "wav"}},
    "modalities": {"modalities": ["text"]},
    "prediction": {"prediction": {"type": "content", "content": "x"}},
    "web_search_options": {"web_search_options": {}},
    "functions": {"functions": [{"name": "f"}]},
    "function_call": {"function_call": "auto"},
    "metadata": {"metadata": {"k": "v"}},
    "store": {"store": False},
    "service_tier": {"service_tier": "auto"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "verbosity": {"verbosity": "low"},
    "moderation": {"moderation": {}},
    "prompt_cache_key": {"prompt_cache_key": "k"},
    "prompt_cache_options": {"prompt_cache_options": {}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "safety_identifier": {"safety_identifier": "s"},
}
CHAT_SAMPLES = {"logprobs": {"logprobs": True}}  # chat's logprobs is a flag
BASE = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 2,
        "temperature": 0,
    },
}
FIELDS = {
    "/v1/completions": sorted(completion_params.CompletionCreateParamsBase.__annotations__),
    "/v1/chat/completions": sorted(chat_params.CompletionCreateParamsBase.__annotations__),
}
SECTIONS = {
    "/v1/completions": "## `POST /v1/completions`",
    "/v1/chat/completions": "## `POST /v1/chat/completions`",
}


def documented(path: str) -> dict[str, str]:
    """field -> status column of docs/API.md's table for ``path`` (a row may name several fields)."""
    text = DOC.read_text()
    section = text.split(SECTIONS[path], 1)[1].split("\n## ", 1)[0]
    out: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([a-z_.]+)`", cells[0]):
                out[name.split(".")[0]] = cells[1]
    return out


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def client(tiny_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    cfg = EngineConfig(
        kv_cache_memory=8 << 20, max_model_len=256, dtype="float32", device="cpu", engine_process="inline"
    )
    app = build_app(build_engine_client(str(tiny_dir), cfg))
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x", timeout=120) as c,
    ):
        yield c


@pytest.mark.parametrize("path", list(FIELDS))
async def test_every_openai_field_is_honored_or_refused_as_documented(
    client: httpx.AsyncClient, path: str
) -> None:
    docs = documented(path)
    fields = [f for f in FIELDS[path] if f not in ("model", "prompt", "messages")]
    undocumented = [f for f in fields if f not in docs]
    no_sample = [f for f in fields if f not in SAMPLES]
    assert not undocumented, f"fields of the openai client missing from docs/API.md: {undocumented}"
    assert not no_sample, f"fields without a sample value here: {no_sample}"
    wrong = []
    for field in fields:
        want_ok = not docs[field].startswith("400")
        sample = CHAT_SAMPLES.get(field, SAMPLES[field]) if "chat" in path else SAMPLES[field]
        r = await client.post(path, json={**BASE[path], **sample})
        if (want_ok and r.status_code != 200) or (
            not want_ok and (r.status_code != 400 or r.json()["error"]["param"] != field)
        ):
            wrong.append(f"{field}: documented {docs[field]!r}, got {r.status_code} {r.text[:200]}")
    assert not wrong, "\n".join(wrong)


async def test_openapi_documents_the_errors_sent(client: httpx.AsyncClient) -> None:
    """The schema lists OpenAI-envelope 400s (what the server sends), never FastAPI's 422."""
    schema = (await client.get("/openapi.json")).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith("/ErrorResponse")
    r = await client.post("/v1/completions", json={"prompt": 3})
    assert r.status_code == 400 and set(r.json()["error"]) == set(
        schema["components"]["schemas"]["ErrorDetail"]["properties"]
    )
