"""Chat requests with images, video and audio through ``swaserve serve``'s app: greedy output equal to
transformers over ``inputs_embeds`` with the encoders' outputs at the placeholders, usage counting
the expanded prompt, a prefix hit on a repeated image, the official openai client, and every kind
of bad media a 400 that leaves the server serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from base64 import b64decode
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from swaserve.api.errors import ProtocolError
from swaserve.api.media import MediaFront, MediaOptions
from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.encoder.runner import MediaEncoder
from swaserve.engine.factory import build_engine_client
from swaserve.media.placeholders import split_embeds
from swaserve.model.multimodal import MultimodalConfig
from tests.helpers.media import data_url, png, reference_greedy, wav
from tests.media.media_samples import make_png, make_video

ENGINE = EngineConfig(
    kv_cache_memory=8 << 20, max_num_seqs=8, max_num_batched_tokens=32, dtype="float32", device="cpu"
)
NEW = 8


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@asynccontextmanager
async def _serving(tiny_dir: Path, process: str) -> AsyncIterator[httpx.AsyncClient]:
    engine = build_engine_client(str(tiny_dir), dataclasses.replace(ENGINE, engine_process=process))
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://swaserve", timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
async def client(tiny_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app over the inline engine (the separate core: ``test_the_separate_core_takes_media_too``)."""
    async with _serving(tiny_dir, "inline") as c:
        yield c


def _body(parts: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    return {
        "model": "mimo-v2-tiny-v2",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": NEW,
        "temperature": 0,
        "return_token_ids": True,
        **kw,
    }


def _reference(
    tiny_dir: Path, hf: Any, tok: Any, prompt_ids: list[int], media: list[tuple[str, bytes]]
) -> list[int]:
    """The request's prompt laid out independently of the server, encoded by ``MediaEncoder``, run
    through transformers; asserts the server's prompt ids are the same."""
    mm = MultimodalConfig.from_pretrained(tiny_dir)
    assert mm is not None
    front = MediaFront(mm, tok)
    markers = {m: front.markers[m] for m, _ in media}
    text = tok.apply_chat_template(
        [{"role": "user", "content": "\n".join([markers[m] for m, _ in media] + ["Look:"])}],
        tokenize=False,
        add_generation_prompt=True,
    )
    mp = front.expand(tok.encode(text, add_special_tokens=False), media)
    assert mp.ids == prompt_ids
    embeds = MediaEncoder(tiny_dir).encode(mp.items)
    return reference_greedy(hf, mp.ids, mp.spans, split_embeds(mp.spans, mp.item_spans, embeds), NEW)


MEDIA = {
    "image": ("image_url", lambda: {"url": data_url("image/png", png(70, 50, 1))}),
    "video": ("video_url", lambda: {"url": data_url("video/mp4", make_video(frames=16, fps=4))}),
    "audio": (
        "input_audio",
        lambda: {"data": data_url("audio/wav", wav(1.3)).split(",", 1)[1], "format": "wav"},
    ),
}


@pytest.mark.anyio
@pytest.mark.parametrize("modalities", [("image",), ("video",), ("audio",), ("image", "audio", "image")])
async def test_media_chat_equals_transformers_inputs_embeds(
    client: httpx.AsyncClient, tiny_dir: Path, hf_tiny: Any, modalities: tuple[str, ...]
) -> None:
    parts, media = [], []
    for m in modalities:
        ptype, value = MEDIA[m]
        v = value()
        parts.append({"type": ptype, ptype: v})

        raw = v["data"] if m == "audio" else v["url"].split(",", 1)[1]
        media.append((m, b64decode(raw)))
    r = await client.post("/v1/chat/completions", json=_body([*parts, {"type": "text", "text": "Look:"}]))
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = body["choices"][0]["prompt_token_ids"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) > 20
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert body["choices"][0]["token_ids"] == _reference(tiny_dir, hf_tiny, tok, prompt_ids, media)


@pytest.mark.anyio
@pytest.mark.cluster  # the engine core in its own process
async def test_the_separate_core_takes_media_too(tiny_dir: Path, hf_tiny: Any) -> None:
    async with _serving(tiny_dir, "separate") as c:
        await test_media_chat_equals_transformers_inputs_embeds(
            c, tiny_dir, hf_tiny, ("image", "audio", "image")
        )


@pytest.mark.anyio
async def test_a_repeated_image_hits_and_another_image_does_not(client: httpx.AsyncClient) -> None:
    a, b = data_url("image/png", png(64, 64, 7)), data_url("image/png", png(64, 64, 8))
    parts = [{"type": "text", "text": "Describe this picture in detail please:"}]

    async def ask(url: str) -> dict[str, Any]:
        r = await client.post(
            "/v1/chat/completions",
            json=_body([*parts, {"type": "image_url", "image_url": {"url": url}}, *parts]),
        )
        assert r.status_code == 200, r.text
        return r.json()

    first = await ask(a)
    again = await ask(a)
    other = await ask(b)
    ids = first["choices"][0]["prompt_token_ids"]
    span_end = max(i for i, t in enumerate(ids) if t >= 1 << 30) + 1
    span_start = min(i for i, t in enumerate(ids) if t >= 1 << 30)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= span_end
    assert other["choices"][0]["prompt_token_ids"][:span_start] == ids[:span_start]
    assert other["choices"][0]["prompt_token_ids"][span_start] != ids[span_start]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= span_start


@pytest.mark.anyio
async def test_the_official_openai_client_sends_an_image(client: httpx.AsyncClient) -> None:
    oc = openai.AsyncOpenAI(base_url="http://swaserve/v1", api_key="x", http_client=client, max_retries=0)
    r = await oc.chat.completions.create(
        model="mimo-v2-tiny-v2",
        max_tokens=4,
        temperature=0,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in the image?"},
                    {
                        "type": "image_url",
                        "image_url": {"url": data_url("image/png", png(40, 90, 3)), "detail": "auto"},
                    },
                ],
            }
        ],
    )
    assert r.usage is not None and r.usage.prompt_tokens > 10 and r.usage.completion_tokens == 4


def _img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


BAD = [
    ([_img("data:image/png;base64,@@@not base64@@@")], "base64"),
    ([_img("data:image/png," + "abc")], "base64"),
    ([_img(data_url("text/plain", b"hello"))], "image/"),
    ([_img(data_url("image/png", make_png()[:40]))], "image 0"),
    ([_img(data_url("image/png", b"\x89PNG\r\n\x1a\n" + b"\0" * 64))], "image 0"),
    ([_img("http://127.0.0.1:9/cat.png")], "allowed-media-domains"),
    ([_img("file:///etc/passwd")], "allowed-local-media-path"),
    ([_img(data_url("image/png", png(8, 8, 1)))] * 9, "At most 8 image"),
    (
        [{"type": "video_url", "video_url": {"url": data_url("video/mp4", make_video(frames=16)[:600])}}],
        "video 0",
    ),
    ([{"type": "video_url", "video_url": {"url": data_url("video/mp4", make_png())}}], "video 0"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}], "audio 0"),
    (
        [
            {
                "type": "image_url",
                "image_url": {"url": data_url("image/png", png(8, 8, 1)), "detail": "medium"},
            }
        ],
        "detail",
    ),
    ([{"type": "image_file", "image_file": {"file_id": "x"}}], "type"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "xyz"}}], "input_audio.format"),
    # raw PCM has no header to probe: refused by name rather than failing as unreadable
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "pcm16"}}], "input_audio.format"),
    (
        [_img(data_url("image/png", png(8, 8, 1))), {"type": "text", "text": "<|image_pad|>"}],
        "may not contain",
    ),
    ([_img(data_url("image/png", png(3000, 30, 1)))], "too thin for this model"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("parts, msg", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
async def test_bad_media_is_a_400_and_the_server_keeps_serving(
    client: httpx.AsyncClient, parts: list[Any], msg: str
) -> None:
    r = await client.post("/v1/chat/completions", json=_body([*parts, {"type": "text", "text": "hi"}]))
    assert r.status_code == 400, r.text
    assert msg in r.text
    ok = await client.post("/v1/chat/completions", json=_body([{"type": "text", "text": "hi"}]))
    assert ok.status_code == 200


@pytest.mark.anyio
async def test_media_outside_user_messages_and_in_tokenize_is_refused(client: httpx.AsyncClient) -> None:
    img = _img(data_url("image/png", png(8, 8, 1)))
    body = _body([{"type": "text", "text": "hi"}])
    body["messages"] = [{"role": "system", "content": [img]}, {"role": "user", "content": "hi"}]
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "only user messages" in r.text
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [img]}]})
    assert r.status_code == 400 and "tokenize" in r.text
    r = await client.post("/v1/chat/completions", json=_body([img], prompt_logprobs=1))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_low_detail_images_are_smaller_and_encode_consistently(tiny_dir: Path, tmp_path: Path) -> None:
    """``detail: low`` caps the resized area at 512x512 pixels (OpenAI's low-resolution image): fewer
    placeholder tokens, another content key, and the encoder resizes to the same size."""
    import json
    import shutil

    from transformers import AutoTokenizer

    d = tmp_path / "big"
    shutil.copytree(tiny_dir, d)
    proc = json.loads((d / "processor_config.json").read_text())
    proc["image_max_pixels"] = 1024 * 32 * 32  # room above the low-detail cap
    (d / "processor_config.json").write_text(json.dumps(proc))
    mm = MultimodalConfig.from_pretrained(d)
    assert mm is not None
    tok = AutoTokenizer.from_pretrained(str(d))
    front = MediaFront(mm, tok)
    ids = tok.encode(front.markers["image"], add_special_tokens=False)
    data = png(1000, 800, 5)
    auto, low = (front.expand(ids, [("image", data)], [detail]) for detail in (None, "low"))
    assert low.items[0].num_tokens <= 256 < auto.items[0].num_tokens
    assert low.items[0].key != auto.items[0].key and low.items[0].size is not None
    enc = MediaEncoder(d).encode([auto.items[0], low.items[0]])  # row counts checked inside
    assert [e.shape[0] for e in enc] == [auto.items[0].num_tokens, low.items[0].num_tokens]


def _front(tiny_dir: Path, **options: Any) -> MediaFront:
    mm = MultimodalConfig.from_pretrained(tiny_dir)
    assert mm is not None
    return MediaFront(mm, None, MediaOptions(**options))


@pytest.mark.anyio
async def test_a_local_fifo_or_device_is_refused_without_blocking(tiny_dir: Path, tmp_path: Path) -> None:
    """A FIFO under --allowed-local-media-path would block its reader (the whole server, when read
    on the event loop) until someone writes to it: only regular files are read."""
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "ok.png").write_bytes(make_png())
    front = _front(tiny_dir, allowed_local_path=str(tmp_path))
    with pytest.raises(ProtocolError, match="not a regular file"):
        await asyncio.wait_for(front.load(f"file://{tmp_path}/fifo.png", "image"), 10)
    assert await front.load(f"file://{tmp_path}/ok.png", "image") == make_png()


@pytest.mark.anyio
async def test_a_url_that_trickles_bytes_is_cut_at_the_fetch_timeout(tiny_dir: Path) -> None:
    """The fetch timeout bounds the whole fetch, not each read: a server sending a byte every
    0.2 s never lets a per-read timeout fire."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(1000):
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.2)

    server = await asyncio.start_server(trickle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    front = _front(tiny_dir, allowed_domains=("127.0.0.1",), fetch_timeout_s=1.0)
    try:
        with pytest.raises(ProtocolError, match="timed out after 1 s"):
            await asyncio.wait_for(front.load(f"http://127.0.0.1:{port}/cat.png", "image"), 20)
    finally:
        server.close()
