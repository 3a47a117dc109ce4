"""EPD through ``swaserve up``'s ``Cluster``: router + 2 encoders + 1 prefill + 1 decode worker on the
tiny checkpoint. Image, video and audio chat requests equal ``swaserve serve``'s app (itself equal to
transformers over ``inputs_embeds``: tests/api/test_media_api.py) token for token; a repeated image
is a prefix hit that fetches nothing; a killed encoder costs a retry on the other one.

Tests run in file order on one cluster; the fault test comes last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swaserve.api.server import build_app
from swaserve.config import EngineConfig
from swaserve.engine.factory import build_engine_client
from swaserve.launcher import Cluster
from tests.helpers.cluster import WORKER_ARGS, scrape
from tests.helpers.media import data_url, png, wav
from tests.media.media_samples import make_video

pytestmark = pytest.mark.cluster  # starts the router, encoders and workers as child processes

MODEL = "mimo-v2-tiny-v2"
NEW = 8


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path) -> Iterator[Cluster]:
    c = Cluster(
        tiny_dir, prefill=1, decode=1, redis=False, worker_args=WORKER_ARGS, encoders=2,
        router_args=["--request-timeout", "60", "--poll-interval", "0.2", "--max-retries", "3"],
        prefill_args=["--media-fetch-timeout", "5"], encoder_args=["--max-wait-ms", "1500"],
    )  # fmt: skip
    try:
        c.start(timeout_s=300)
        yield c
    finally:
        c.stop()


def _body(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}],
        "max_tokens": NEW,
        "temperature": 0,
        "return_token_ids": True,
    }


REQUESTS = {
    "image": [{"type": "image_url", "image_url": {"url": data_url("image/png", png(70, 50, 11))}}],
    "video": [
        {"type": "video_url", "video_url": {"url": data_url("video/mp4", make_video(frames=16, fps=4))}}
    ],
    "audio": [
        {
            "type": "input_audio",
            "input_audio": {"data": data_url("audio/wav", wav(1.1)).split(",")[1], "format": "wav"},
        }
    ],
    "mixed": [
        {"type": "image_url", "image_url": {"url": data_url("image/png", png(64, 96, 12)), "detail": "low"}},
        {
            "type": "input_audio",
            "input_audio": {"data": data_url("audio/wav", wav(0.7, 300)).split(",")[1], "format": "wav"},
        },
        {"type": "image_url", "image_url": {"url": data_url("image/png", png(40, 40, 13))}},
    ],
}


async def _serve_answers(tiny_dir: Path) -> dict[str, dict[str, Any]]:
    """The same requests through ``swaserve serve``'s app (in process)."""
    cfg = EngineConfig(
        max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4, dtype="float32", device="cpu"
    )
    engine = build_engine_client(str(tiny_dir), dataclasses.replace(cfg, engine_process="inline"))
    app = build_app(engine)
    out = {}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=120) as c:
            for name, parts in REQUESTS.items():
                r = await c.post("/v1/chat/completions", json=_body(parts))
                assert r.status_code == 200, r.text
                out[name] = r.json()
    return out


def _total(cluster: Cluster, name: str, **labels: str) -> float:
    """A metric summed over both encoders and over the labels not given."""
    out = 0.0
    for i in range(2):
        try:
            samples = scrape(cluster.metrics_urls[f"encoder-{i}"].removesuffix("/metrics"))
        except httpx.HTTPError:  # killed
            continue
        out += sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))
    return out


async def _ask(url: str, parts: list[dict[str, Any]]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=120) as c:
        return await c.post(f"{url}/v1/chat/completions", json=_body(parts))


def test_media_requests_equal_serve(cluster: Cluster, tiny_dir: Path) -> None:
    want = asyncio.run(_serve_answers(tiny_dir))

    async def all_at_once() -> list[httpx.Response]:
        return await asyncio.gather(*(_ask(cluster.url, parts) for parts in REQUESTS.values()))

    for name, r in zip(REQUESTS, asyncio.run(all_at_once()), strict=True):
        assert r.status_code == 200, (name, r.text)
        got, ref = r.json()["choices"][0], want[name]["choices"][0]
        assert got["prompt_token_ids"] == ref["prompt_token_ids"], name
        assert got["token_ids"] == ref["token_ids"], name
        assert r.json()["usage"]["prompt_tokens"] == want[name]["usage"]["prompt_tokens"]
    assert _total(cluster, "swaserve:encoder_items_total", outcome="encoded") == 6  # each distinct item once
    listing = httpx.get(f"{cluster.url}/workers", timeout=10).json()
    assert sorted(e["url"] for e in listing["encoders"]) == sorted(cluster.encoder_addresses)
    assert all(e["state"] == "up" for e in listing["encoders"])
    samples = scrape(cluster.url)
    submitted = sum(v for (n, _), v in samples.items() if n == "swaserve:router_encoder_items_total")
    assert (
        submitted == 6 and sum(v for (n, _), v in samples.items() if n == "swaserve:router_encoder_up") == 2
    )


def test_a_repeated_image_is_a_prefix_hit_that_fetches_nothing(cluster: Cluster) -> None:
    parts = REQUESTS["image"]
    before = _total(cluster, "swaserve:encoder_fetch_bytes_total")
    r = asyncio.run(_ask(cluster.url, parts))
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["prompt_token_ids"]
    span_end = max(i for i, t in enumerate(ids) if t >= 1 << 30) + 1
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= span_end
    assert _total(cluster, "swaserve:encoder_fetch_bytes_total") == before


def test_a_bad_image_is_a_400_and_others_are_served(cluster: Cluster) -> None:
    bad = [
        {"type": "image_url", "image_url": {"url": data_url("image/png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40)}}
    ]
    r = asyncio.run(_ask(cluster.url, bad))
    assert r.status_code == 400, r.text
    assert asyncio.run(_ask(cluster.url, REQUESTS["audio"])).status_code == 200
    # a header the router reads fine over a body the encoder cannot decode: its refusal is the
    # client's error too (a 400 with the encoder's reason, not retried into a 503)
    whole = png(256, 144, 3)
    cut = [{"type": "image_url", "image_url": {"url": data_url("image/png", whole[: len(whole) // 2])}}]

    def retries() -> float:
        return sum(v for (n, _), v in scrape(cluster.url).items() if n == "swaserve:router_retries_total")

    before = retries()
    r = asyncio.run(_ask(cluster.url, cut))
    assert r.status_code == 400 and "corrupt or truncated" in r.text, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert retries() == before
    assert asyncio.run(_ask(cluster.url, REQUESTS["audio"])).status_code == 200


def test_a_killed_encoder_costs_a_retry_on_the_other(cluster: Cluster, tiny_dir: Path) -> None:
    """Images that rendezvous hashing places on encoder 0, killed while they wait in its batch
    window (``--max-wait-ms`` 1500): the prefill worker's fetch fails, the router retries with the
    items resubmitted to encoder 1, and every request completes."""
    from transformers import AutoTokenizer

    from swaserve.api.media import MediaFront
    from swaserve.encoder.placement import rank
    from swaserve.media.placeholders import item_key
    from swaserve.model.multimodal import MultimodalConfig

    mm = MultimodalConfig.from_pretrained(tiny_dir)
    assert mm is not None
    front = MediaFront(mm, AutoTokenizer.from_pretrained(str(tiny_dir)))
    first, datas = cluster.encoder_addresses[0], []
    seed = 300
    while len(datas) < 3:
        data = png(64, 64, seed)
        seed += 1
        if (
            rank(item_key(front.digest, "image", front._params("image"), data), cluster.encoder_addresses)[0]
            == first
        ):
            datas.append(data)

    async def run() -> list[httpx.Response]:
        tasks = [
            asyncio.create_task(
                _ask(cluster.url, [{"type": "image_url", "image_url": {"url": data_url("image/png", d)}}])
            )
            for d in datas
        ]
        await asyncio.sleep(0.6)  # submitted, waiting in encoder 0's batch window
        cluster.services["encoder-0"].proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
        return await asyncio.gather(*tasks)

    codes = [r.status_code for r in asyncio.run(run())]
    assert codes == [200] * len(datas)
    samples = scrape(cluster.url)
    assert sum(v for (n, _), v in samples.items() if n == "swaserve:router_retries_total") >= 1
    more = asyncio.run(
        _ask(
            cluster.url,
            [{"type": "image_url", "image_url": {"url": data_url("image/png", png(48, 48, 200))}}],
        )
    )
    assert more.status_code == 200, more.text
    # no encoder left: a clear 503, and text requests are still served
    cluster.services["encoder-1"].proc.send_signal(signal.SIGKILL)  # type: ignore[attr-defined]
    img = [{"type": "image_url", "image_url": {"url": data_url("image/png", png(48, 48, 201))}}]
    gone = asyncio.run(_ask(cluster.url, img))
    assert gone.status_code == 503 and "encoder" in gone.text, gone.text
    assert asyncio.run(_ask(cluster.url, [])).status_code == 200
