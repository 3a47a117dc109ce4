"""The HTTP front's flags on a real uvicorn on 127.0.0.1 (inline engine, tiny model), driven by the
official ``openai`` client: ``--api-key`` (``api.auth``), ``--served-model-name``,
``--chat-template`` (``api.chat_template``) and ``--max-logprobs``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from swaserve.api.auth import ApiKeyAuth
from swaserve.api.chat_template import check_chat_template, load_chat_template, resolve_chat_template
from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client
from swaserve.engine.types import MAX_LOGPROBS as ENGINE_MAX_LOGPROBS
from swaserve.model.checkpoint import tiny_model_dir
from swaserve.procs import free_port

pytestmark = pytest.mark.anyio

KEY = "sk-test-5f0c2a61d9e84b7c"
NAME = "tiny-alias"
MAX_LOGPROBS = 3
MAX_BYTES = 4096
# a template nothing else renders like: the prompt ids show it was used
TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}>>{% endfor %}{% if add_generation_prompt %}=>{% endif %}"
CONFIG = EngineConfig(
    kv_cache_memory=4 << 20,
    max_num_seqs=4,
    max_num_batched_tokens=128,
    max_model_len=256,
    device="cpu",
    engine_process="inline",
)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Live:
    url: str
    engine: Any
    logs: list[str]
    clients: list[openai.AsyncOpenAI] = dataclasses.field(default_factory=list)

    def client(self, api_key: str = KEY) -> openai.AsyncOpenAI:
        """An openai client of the server (closed with the fixture, on this loop)."""
        c = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)
        self.clients.append(c)
        return c


class _Collect(logging.Handler):
    """The server side's log records (the clients' libraries left out)."""

    CLIENTS = ("openai", "httpx", "httpcore", "httpx2", "httpcore2")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] not in self.CLIENTS:
            self.lines.append(self.format(record))


@pytest.fixture(scope="module")
async def live() -> AsyncIterator[Live]:
    """``build_app`` with every front flag set, behind uvicorn (its own logging: every record,
    access lines included, reaches the root logger and the collector)."""
    engine = build_engine_client(str(tiny_model_dir()), CONFIG, NAME)
    app = build_app(
        engine,
        api_key=KEY,
        chat_template=TEMPLATE,
        max_logprobs=MAX_LOGPROBS,
        max_request_bytes=MAX_BYTES,
    )
    collect = _Collect()
    root = logging.getLogger()
    root.addHandler(collect)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    # an earlier uvicorn with its default log_config (dictConfig) left its loggers not propagating
    uv = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.access", "uvicorn.error")]
    old_propagate = [lg.propagate for lg in uv]
    for lg in uv:
        lg.propagate = True
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, log_level="debug", access_log=True)
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 60
    while not server.started:
        assert not task.done() and time.monotonic() < deadline, "uvicorn did not start"
        await asyncio.sleep(0.02)
    live = Live(f"http://127.0.0.1:{port}", engine, collect.lines)
    try:
        yield live
    finally:
        for c in live.clients:
            await c.close()
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        root.removeHandler(collect)
        root.setLevel(old_level)
        for lg, p in zip(uv, old_propagate, strict=True):
            lg.propagate = p


def _assert_auth_error(r: httpx.Response, message: str) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {"message": r.json()["error"]["message"], "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}
    }  # fmt: skip
    assert message in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- --api-key


async def test_the_right_key_serves_every_endpoint(live: Live) -> None:
    client = live.client()
    assert [m.id async for m in client.models.list()] == [NAME]
    assert (await client.models.retrieve(NAME)).id == NAME
    out = await client.completions.create(model=NAME, prompt="hello", max_tokens=2, temperature=0)
    assert out.model == NAME and out.usage is not None and out.usage.completion_tokens == 2
    chat = await client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
    )
    assert chat.model == NAME and chat.choices[0].finish_reason == "length"
    stream = await client.completions.create(model=NAME, prompt="hello", max_tokens=2, stream=True)
    assert [c async for c in stream]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=live.url, headers=headers, timeout=60) as h:
        r = await h.post("/tokenize", json={"prompt": "hello"})
        assert r.status_code == 200, r.text
        assert (await h.post("/detokenize", json={"tokens": r.json()["tokens"]})).json() == {
            "prompt": "hello"
        }
        r = await h.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})  # scheme: any case
        assert r.status_code == 200


async def test_a_wrong_or_missing_key_is_an_authentication_error(live: Live) -> None:
    for key in ("wrong", KEY + "x", KEY[:-1]):
        client = live.client(key)
        with pytest.raises(openai.AuthenticationError) as e:
            await client.completions.create(model=NAME, prompt="hello", max_tokens=2)
        assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
        assert e.value.type == "invalid_request_error" and e.value.param is None
        _assert_auth_error(e.value.response, "Incorrect API key")
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/no-such-path"),
            ("GET", "/health/"),  # only the exact open paths are open
        ):
            for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
                r = await h.request(method, path, json={"prompt": "x"}, headers=headers)
                _assert_auth_error(r, "You didn't provide an API key")
        # the key is checked before the body is read: a body past the size limit is a 401, not a 413
        big = {"prompt": "x" * 2 * MAX_BYTES}
        r = await h.post("/v1/completions", json=big, headers={"Authorization": "Bearer no"})
        _assert_auth_error(r, "Incorrect API key")
        r = await h.post("/v1/completions", json=big, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 413
    assert live.engine.stats().num_running == 0


async def test_health_and_metrics_stay_open(live: Live) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as h:
        assert (await h.get("/health")).json() == {"status": "ok"}
        r = await h.get("/metrics")
        assert r.status_code == 200 and "swaserve:num_requests_running" in r.text
        assert (await h.get("/health", headers={"Authorization": "Bearer wrong"})).status_code == 200


async def test_the_key_is_never_logged(live: Live) -> None:
    before = len(live.logs)
    await live.client().completions.create(model=NAME, prompt="log me", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        await live.client("sk-wrong-key-7e1d").models.list()
    lines = live.logs[before:]
    # the access log reached the collector, so the check below could see a key in it
    assert any("POST /v1/completions" in line for line in lines), lines
    assert any("GET /v1/models" in line and "401" in line for line in lines), lines
    text = "\n".join(live.logs)
    assert KEY not in text and "sk-wrong-key-7e1d" not in text


def test_the_middleware_refuses_an_empty_or_padded_key() -> None:
    for bad in ("", " key", "key\n"):
        with pytest.raises(ValueError, match="must not be empty"):
            ApiKeyAuth(app=None, api_key=bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- --served-model-name


async def test_the_served_name_is_the_only_model(live: Live) -> None:
    client = live.client()
    with pytest.raises(openai.NotFoundError) as e:
        await client.completions.create(model="mimo-v2-tiny-v2", prompt="hello", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    assert NAME in e.value.message


# ---------------------------------------------------------------------------- --chat-template


async def test_the_chat_template_replaces_the_tokenizers(live: Live) -> None:
    tok = live.engine.tokenizer
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    want = tok.encode("<<system|be brief>><<user|hi>>=>", add_special_tokens=False)
    assert want != tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))
    async with httpx.AsyncClient(
        base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as h:
        r = await h.post("/tokenize", json={"messages": msgs})
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        info = await h.get("/tokenizer_info")  # what a remote tokenizer renders chats with
        assert info.status_code == 200 and info.json()["chat_template"] == TEMPLATE, info.text
    chat = await live.client().chat.completions.create(model=NAME, messages=msgs, max_tokens=1)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.usage.prompt_tokens == len(want)


def test_chat_template_values_read_as_vllm_reads_them(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    for value, why in (
        (str(tmp_path / "missing.jinja"), "looks like a file path"),
        (str(tmp_path), "looks like a file path"),  # a directory
    ):
        with pytest.raises(ValueError, match=why):
            load_chat_template(value)
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_chat_template(str(tmp_path / "empty.jinja"))
    (tmp_path / "bin.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_chat_template(str(tmp_path / "bin.jinja"))


def test_a_template_that_does_not_render_is_refused() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    check_chat_template(tok, TEMPLATE)
    for bad in (
        "{% for m in messages %}{{ m }}",
        "{{ messages | no_such_filter }}",
        "{{ raise_exception('no') }}",
    ):
        with pytest.raises(ValueError, match="does not render"):
            check_chat_template(tok, bad)
    assert resolve_chat_template(None, tiny_model_dir()) is None
    assert resolve_chat_template(TEMPLATE, tiny_model_dir()) == TEMPLATE


# ---------------------------------------------------------------------------- --max-logprobs


async def test_logprobs_past_max_logprobs_are_a_400_naming_the_field(live: Live) -> None:
    client = live.client()
    out = await client.completions.create(
        model=NAME, prompt="hello", max_tokens=1, logprobs=MAX_LOGPROBS, temperature=0
    )
    assert out.choices[0].logprobs is not None and out.choices[0].logprobs.top_logprobs is not None
    assert len(out.choices[0].logprobs.top_logprobs[0]) == MAX_LOGPROBS
    with pytest.raises(openai.BadRequestError) as e:
        await client.completions.create(model=NAME, prompt="hello", max_tokens=1, logprobs=MAX_LOGPROBS + 1)
    assert e.value.param == "logprobs" and f"[0, {MAX_LOGPROBS}]" in e.value.message
    msgs: Any = [{"role": "user", "content": "hi"}]
    chat = await client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=1, logprobs=True, top_logprobs=MAX_LOGPROBS
    )
    assert chat.choices[0].logprobs is not None and chat.choices[0].logprobs.content is not None
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == MAX_LOGPROBS
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(
            model=NAME, messages=msgs, max_tokens=1, logprobs=True, top_logprobs=MAX_LOGPROBS + 1
        )
    assert e.value.param == "top_logprobs" and f"[0, {MAX_LOGPROBS}]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # vLLM's prompt_logprobs: the same bound
        await client.completions.create(
            model=NAME, prompt="hello", max_tokens=1, extra_body={"prompt_logprobs": MAX_LOGPROBS + 1}
        )
    assert e.value.param == "prompt_logprobs"


async def test_max_logprobs_above_the_default_and_apps_keep_their_own(live: Live) -> None:
    """A second app over the same engine allows 5 while the live one still allows 3: the limit is
    per app, not per process; the default is 20, which is also the engine's bound."""
    wide = build_app(live.engine, manage_engine=False, max_logprobs=5)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=wide), base_url="http://w", timeout=60
    ) as h:
        r = await h.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 1, "logprobs": 5, "temperature": 0}
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 5
        r = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "logprobs": 26})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
        with pytest.raises(openai.BadRequestError):
            await live.client().completions.create(model=NAME, prompt="x", max_tokens=1, logprobs=5)
    default = build_app(live.engine, manage_engine=False)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=default), base_url="http://d") as h:
        r = await h.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "logprobs": 21})
        assert r.status_code == 400 and "[0, 20]" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="max_logprobs"):  # past the engine's own bound
        build_app(live.engine, manage_engine=False, max_logprobs=ENGINE_MAX_LOGPROBS + 1)
    assert ENGINE_MAX_LOGPROBS == 20
