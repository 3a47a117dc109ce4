"""Trace replay client: request planning, stream accounting, failure handling, and a real server."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from swaserve.replay import format_report, parse_kv_pages, run_replay, send_one
from swaserve.replay_plan import (
    PlannedRequest,
    ReplayOptions,
    RequestResult,
    parse_id_ranges,
    plan_requests,
    token_space_from_model_dir,
)
from swaserve.traces import MooncakeRequest, TokenBlocks, read_mooncake


def test_parse_id_ranges() -> None:
    assert parse_id_ranges("0-2, 7,10-11") == (0, 1, 2, 7, 10, 11)
    assert parse_id_ranges("") == ()
    for bad in ("3-1", "a", "1-"):
        with pytest.raises(ValueError, match="bad token id range"):
            parse_id_ranges(bad)


def test_plan_requests_times_lengths_and_clipping() -> None:
    trace = [
        MooncakeRequest(1000, 512, 50, (0,)),
        MooncakeRequest(3000, 1024, 5, (0, 1)),
        MooncakeRequest(5000, 2048, 40, (0, 1, 2, 3)),
    ]
    opts = ReplayOptions(
        url="http://x", time_scale=2.0, block_tokens=16, max_output_tokens=20, max_model_len=70
    )
    plan = plan_requests(trace, opts)
    assert [p.send_at_s for p in plan] == [0.0, 1.0, 2.0]  # (ts - first) / 1000 / time_scale
    assert [p.max_tokens for p in plan] == [20, 5, 20]
    assert [len(p.prompt_token_ids) for p in plan] == [16, 32, 50]  # 64 + 20 > 70: prompt cut to 50
    assert [p.clipped for p in plan] == [False, False, True]
    blocks = TokenBlocks(16, opts.vocab_size, opts.reserved_ids, opts.seed)
    assert plan[2].prompt_token_ids == blocks.prompt(trace[2])[:50]
    assert plan_requests(trace, ReplayOptions(url="http://x", max_output_tokens=None))[0].max_tokens == 50
    with pytest.raises(ValueError):
        ReplayOptions(url="http://x", time_scale=0)


METRICS_TEXT = """\
# HELP swaserve:kv_cache_total_pages KV pages in the pool.
# TYPE swaserve:kv_cache_total_pages gauge
swaserve:kv_cache_total_pages{model_name="m",pool="full"} 100.0
swaserve:kv_cache_total_pages{model_name="m",pool="swa"} 40.0
# HELP swaserve:kv_cache_peak_used_pages Most KV pages held at once since start.
# TYPE swaserve:kv_cache_peak_used_pages gauge
swaserve:kv_cache_peak_used_pages{model_name="m",pool="full"} 25.0
swaserve:kv_cache_peak_used_pages{model_name="m",pool="swa"} 10.0
# HELP swaserve:num_requests_running Requests running.
# TYPE swaserve:num_requests_running gauge
swaserve:num_requests_running{model_name="m"} 0.0
"""


def test_parse_kv_pages() -> None:
    assert parse_kv_pages(METRICS_TEXT) == {
        "full": {"total_pages": 100.0, "peak_used_pages": 25.0, "peak_fraction": 0.25},
        "swa": {"total_pages": 40.0, "peak_used_pages": 10.0, "peak_fraction": 0.25},
    }
    assert parse_kv_pages("") == {}


def test_parse_kv_pages_of_a_router() -> None:
    text = """\
# TYPE swaserve:kv_cache_total_pages gauge
swaserve:kv_cache_total_pages{model_name="m",pool="full",role="decode",worker="127.0.0.1:5001"} 80.0
# TYPE swaserve:kv_cache_peak_used_pages gauge
swaserve:kv_cache_peak_used_pages{model_name="m",pool="full",role="decode",worker="127.0.0.1:5001"} 20.0
"""
    assert parse_kv_pages(text) == {
        "decode@127.0.0.1:5001/full": {"total_pages": 80.0, "peak_used_pages": 20.0, "peak_fraction": 0.25}
    }


# ---------------------------------------------------------------------------------------------
# Failure handling against a raw TCP server that misbehaves on purpose (fault injection).

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
REQ = PlannedRequest(index=0, send_at_s=0.0, prompt_token_ids=[5, 6, 7], max_tokens=3)


async def _read_request(reader: asyncio.StreamReader) -> dict[str, object]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return json.loads(await reader.readexactly(length))


def _sse_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"


def _data(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _chunk(ids: list[int], finish: str | None = None) -> dict[str, object]:
    return {"choices": [{"text": "x", "token_ids": ids, "finish_reason": finish}]}


async def _with_server(
    handler: Handler, timeout_s: float = 5.0
) -> tuple[RequestResult, list[dict[str, object]]]:
    bodies: list[dict[str, object]] = []

    async def wrapped(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        bodies.append(await _read_request(reader))
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(wrapped, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, httpx.AsyncClient() as client:
        result = await send_one(client, f"http://127.0.0.1:{port}", "m", REQ, timeout_s, time.perf_counter())
    return result, bodies


def test_send_one_good_stream_ttft_itl_and_usage() -> None:
    async def good(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_sse_head())
        for payload in (_chunk([11]), _chunk([12, 13], "length")):
            await asyncio.sleep(0.05)
            w.write(_data(payload))
            await w.drain()
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}
        w.write(_data({"choices": [], "usage": usage}) + _data(b"[DONE]"))
        await w.drain()

    r, bodies = asyncio.run(_with_server(good))
    assert r.ok and r.error is None
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens) == (3, 3, 2)
    assert r.ttft_s is not None and 0.04 < r.ttft_s < 1.0
    assert len(r.itls_s) == 2 and r.itls_s[0] == r.itls_s[1]
    assert 0.015 < r.itls_s[0] < 0.5  # one 50 ms gap split over 2 tokens
    body = bodies[0]
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 3 and body["stream"] is True
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("name", "script", "message"),
    [
        (
            "http_error",
            [
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 38\r\n\r\n"
                b'{"error": {"message": "prompt bad!!"}}'
            ],
            "HTTP 400: prompt bad!!",
        ),
        (
            "error_event",
            [_sse_head(), _data(_chunk([1])), _data({"error": {"message": "engine died"}})],
            "error event: engine died",
        ),
        ("cut_stream", [_sse_head(), _data(_chunk([1]))], "stream ended before [DONE]"),
        ("no_finish", [_sse_head(), _data(_chunk([1])), _data(b"[DONE]")], "without a finish_reason"),
        ("garbage", [_sse_head(), b"data: {nope\n\n"], "Expecting property name"),
    ],
)
def test_send_one_failures(name: str, script: list[bytes], message: str) -> None:
    async def bad(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for part in script:
            w.write(part)
            await w.drain()

    r, _ = asyncio.run(_with_server(bad))
    assert not r.ok
    assert r.error is not None and message in r.error, name


def test_send_one_times_out_instead_of_hanging() -> None:
    async def stall(_: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_sse_head() + _data(_chunk([1])))
        await w.drain()
        await asyncio.sleep(30)

    start = time.perf_counter()
    r, _ = asyncio.run(_with_server(stall, timeout_s=0.5))
    assert not r.ok and r.error == "timed out after 0.5 s"
    assert time.perf_counter() - start < 5


def test_send_one_connection_refused() -> None:
    async def go() -> RequestResult:
        async with httpx.AsyncClient() as client:
            return await send_one(client, "http://127.0.0.1:9", "m", REQ, 5.0, time.perf_counter())

    r = asyncio.run(go())
    assert not r.ok and r.error


# ---------------------------------------------------------------------------------------------
# Against a real `swaserve serve` on the tiny model.


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    from swaserve.model.checkpoint import tiny_model_dir

    return Path(tiny_model_dir())


@pytest.fixture(scope="module")
def live_server(tiny_dir: Path) -> Iterator[str]:
    from swaserve.procs import free_port
    from swaserve.run_demo import ServerProcess

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(["--model", str(tiny_dir), "--port", str(port), "--max-model-len", "1024"], url)
    server.start()
    try:
        server.wait_ready(300)
        yield url
    finally:
        server.stop()
    assert server.proc is not None and server.proc.poll() is not None


def test_token_space_of_tiny_model(tiny_dir: Path) -> None:
    vocab, reserved = token_space_from_model_dir(tiny_dir)
    assert vocab == 512
    assert reserved == tuple(range(12))  # <|endoftext|>, <|im_start|>, <|im_end|>, the 9 media markers


@pytest.mark.cluster  # a swaserve serve process
def test_replay_against_real_server(live_server: str, tiny_dir: Path, tmp_path: Path) -> None:
    vocab, reserved = token_space_from_model_dir(tiny_dir)
    trace = read_mooncake(limit=5)
    opts = ReplayOptions(
        url=live_server,
        time_scale=1000.0,
        block_tokens=4,
        max_output_tokens=4,
        vocab_size=vocab,
        reserved_ids=reserved,
        request_timeout_s=120,
        progress=False,
    )
    out = tmp_path / "report.json"
    rep = run_replay(trace, opts, out, trace_name="mooncake")
    assert rep["failed"] == 0 and rep["ok"] == 5, rep["errors"]
    assert rep["max_model_len"] == 1024  # read from /v1/models
    plan = plan_requests(trace, opts)
    assert rep["total_prompt_tokens"] == sum(len(p.prompt_token_ids) for p in plan)
    # ignore_eos: exactly max_tokens each (4 + 4 + 4 + 3 + 4; request 3 asks for 3)
    assert rep["total_output_tokens"] == sum(p.max_tokens for p in plan) == 19
    assert rep["short_outputs"] == 0 and rep["clipped"] == 0
    assert rep["ttft_s"]["p50"] > 0 and rep["itl_s"]["p99"] >= rep["itl_s"]["p50"] > 0
    assert rep["output_tokens_per_s"] > 0
    assert set(rep["kv_pages"]) == {"full", "swa"}
    for pool in rep["kv_pages"].values():
        assert 0 < pool["peak_used_pages"] <= pool["total_pages"]
    assert rep["block_scaling"]["block_tokens"] == 4
    assert json.loads(out.read_text()) == rep
    text = format_report(rep)
    assert "5 ok, 0 failed" in text and "KV pool full" in text and "512 trace tokens -> 4 tokens" in text


@pytest.mark.cluster  # a swaserve serve process
def test_replay_counts_server_refusals_as_failed(live_server: str) -> None:
    # vocab 4096 against the 512-token tiny model: every prompt has out-of-vocab ids -> HTTP 400
    trace = read_mooncake(limit=2)
    opts = ReplayOptions(
        url=live_server, block_tokens=4, max_output_tokens=2, time_scale=1000.0, progress=False
    )
    rep = run_replay(trace, opts)
    assert (rep["ok"], rep["failed"]) == (0, 2)
    assert all("HTTP 400" in e for e in rep["errors"])
