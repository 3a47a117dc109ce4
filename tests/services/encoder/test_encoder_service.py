"""The encoder service in this process (gRPC on a local port, the tiny checkpoint's towers):
fetched embeddings equal a direct encode, items of different requests fuse into one forward,
identical and cached items cost no forward, a bad item fails only itself, and each refusal has
its status."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from services.encoder.cli import model_fingerprint
from services.encoder.client import EncoderClient, to_proto
from services.encoder.servicer import EncodeScheduler, RpcFailure
from services.tls import Dialer, read_pem, server_credentials
from swaserve.encoder.cache import EmbeddingCache
from swaserve.encoder.items import EncodeItem
from swaserve.encoder.runner import MediaEncoder
from tests.helpers.tls import CA
from tests.services.encoder.helpers import Counting, audio, image, sample, serving, video


@pytest.fixture(scope="module")
def enc(tiny_dir: Path) -> MediaEncoder:
    return MediaEncoder(tiny_dir)


@pytest.fixture(scope="module")
def fp(tiny_dir: Path) -> str:
    return model_fingerprint(tiny_dir)


def _code(e: pytest.ExceptionInfo[grpc.aio.AioRpcError]) -> grpc.StatusCode:
    return e.value.code()


def test_fetched_embeddings_equal_a_direct_encode_bitwise(enc: MediaEncoder, fp: str) -> None:
    items = [image(enc, 0), video(enc), audio(enc)]
    alone = [enc.encode([it])[0] for it in items]

    async def go() -> None:
        async with serving(Counting(enc), fp) as (server, client):
            assert await client.submit(items, fp) == [True, True, True]
            got = await asyncio.gather(*(client.fetch(it.key, timeout_s=20) for it in items))
            for it, want, g in zip(items, alone, got, strict=True):
                assert g.dtype == torch.float32 and g.shape == (it.num_tokens, enc.hidden_size)
                assert torch.equal(g, want), it.modality
            load = await client.load()
            assert (load.cache_entries, load.queued_items, load.model_fingerprint) == (3, 0, fp)
            assert load.boot_id and not load.draining
            rows = sum(it.num_tokens for it in items) * enc.hidden_size * 4
            assert sample(server, "swaserve:encoder_fetch_bytes_total") == rows
            for m in ("image", "video", "audio"):
                assert sample(server, "swaserve:encoder_items_total", modality=m, outcome="encoded") == 1

    asyncio.run(go())


def test_concurrent_requests_fuse_into_one_forward_and_split_back(enc: MediaEncoder, fp: str) -> None:
    items = [image(enc, 10), image(enc, 11, 96, 64), image(enc, 12, 40, 40)]  # 4, 6 and 4 rows
    counting = Counting(enc)

    async def go() -> None:
        async with serving(counting, fp, max_wait_s=0.5) as (server, client):
            # three requests, three calls at once: one forward within the wait window
            await asyncio.gather(*(client.submit([it], fp) for it in items))
            got = await asyncio.gather(*(client.fetch(it.key, timeout_s=20) for it in items))
            assert len(counting.calls) == 1 and sorted(counting.calls[0]) == sorted(it.key for it in items)
            assert sample(server, "swaserve:encoder_batch_items_count") == 1
            assert sample(server, "swaserve:encoder_batch_items_sum") == 3
            order = {k: i for i, k in enumerate(counting.calls[0])}
            fused = enc.encode(sorted(items, key=lambda it: order[it.key]))
            for it, g in zip(items, got, strict=True):
                assert torch.equal(g, fused[order[it.key]])  # the split gives each item its rows
                # and they are the rows the item gets alone (BLAS may order a sum differently)
                torch.testing.assert_close(g, enc.encode([it])[0], rtol=0, atol=1e-5)

    asyncio.run(go())


def test_identical_items_are_encoded_once_and_a_cached_one_costs_no_forward(
    enc: MediaEncoder, fp: str
) -> None:
    it = image(enc, 20)
    counting = Counting(enc)

    async def go() -> None:
        async with serving(counting, fp, max_wait_s=0.2) as (server, client):
            await asyncio.gather(client.submit([it], fp), client.submit([it, it], fp))  # three requests
            a, b = await asyncio.gather(client.fetch(it.key), client.fetch(it.key))
            assert counting.calls == [[it.key]]
            assert torch.equal(a, b) and torch.equal(a, enc.encode([it])[0])
            assert await client.submit([it], fp) == [True]  # cached now
            assert torch.equal(await client.fetch(it.key), a)
            assert counting.calls == [[it.key]]
            assert sample(server, "swaserve:encoder_items_total", modality="image", outcome="encoded") == 1
            assert sample(server, "swaserve:encoder_items_total", modality="image", outcome="cached") == 3
            assert sample(server, "swaserve:encoder_cache_hits_total", tier="memory") == 1
            assert sample(server, "swaserve:encoder_cache_misses_total") == 1

    asyncio.run(go())


def test_a_corrupt_image_fails_only_itself(enc: MediaEncoder, fp: str) -> None:
    good = image(enc, 30)
    bad = EncodeItem(b"\x01" * 16, "image", b"\x89PNG\r\n\x1a\nnot really", 4)
    counting = Counting(enc)

    async def go() -> None:
        async with serving(counting, fp, max_wait_s=0.2) as (server, client):
            assert await client.submit([bad, good], fp) == [True, True]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.fetch(bad.key)
            assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a readable image" in (e.value.details() or "")
            assert torch.equal(await client.fetch(good.key), enc.encode([good])[0])
            assert counting.calls == [[bad.key, good.key], [bad.key], [good.key]]  # fused, then alone
            assert sample(server, "swaserve:encoder_items_total", modality="image", outcome="failed") == 1
            # a new submit of the failed key tries it again; the error stays
            await client.submit([bad], fp)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.fetch(bad.key)
            assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT and len(counting.calls) == 4

    asyncio.run(go())


def test_refusals_carry_their_status_and_lose_nothing_else(enc: MediaEncoder, fp: str) -> None:
    good = image(enc, 40)

    async def go() -> None:
        async with serving(enc, fp) as (_, client):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.fetch(b"\x07" * 16)
            assert _code(e) == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.submit([good], "0123456789abcdef")
            assert _code(e) == grpc.StatusCode.FAILED_PRECONDITION and fp in (e.value.details() or "")
            short_key = EncodeItem(b"\x02" * 15, "image", good.data, good.num_tokens)
            no_rows = EncodeItem(b"\x03" * 16, "image", good.data, 0)
            no_plan = EncodeItem(b"\x04" * 16, "video", good.data, 8)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.submit([short_key, good, no_rows, no_plan], fp)
            assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
            msg = e.value.details() or ""
            assert "item 0: a key has 16 bytes, got 15" in msg and "item 2: num_tokens 0" in msg
            assert "item 3: a video item needs its sampled frame times" in msg
            assert torch.equal(await client.fetch(good.key), enc.encode([good])[0])  # still served

    asyncio.run(go())


def test_a_model_without_the_modality_refuses_it(enc: MediaEncoder, fp: str) -> None:
    sched = EncodeScheduler(enc, fp, {"image", "video"}, EmbeddingCache(1 << 20))
    with pytest.raises(RpcFailure) as e:
        sched.submit([to_proto(audio(enc))], fp)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "does not take audio" in e.value.message
    assert len(sched.batcher) == 0


def test_the_queue_bound_the_fetch_deadline_and_a_drain(enc: MediaEncoder, fp: str) -> None:
    gate = threading.Event()
    counting = Counting(enc, gate)
    a, b, c, d = (image(enc, 50 + i) for i in range(4))

    async def go() -> None:
        async with serving(counting, fp, max_batch_items=1, max_queued_items=2, max_wait_s=0.0) as (
            server,
            client,
        ):
            try:
                await client.submit([a], fp)
                for _ in range(500):  # until the loop holds a in its (gated) forward
                    if (await client.load()).running_items == 1:
                        break
                    await asyncio.sleep(0.01)
                assert await client.submit([b, c], fp) == [True, True]
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.submit([d], fp)
                assert _code(e) == grpc.StatusCode.RESOURCE_EXHAUSTED
                load = await client.load()
                assert (load.running_items, load.queued_items) == (1, 2)
                assert await client.submit([a, b], fp) == [True, True]  # in flight: no room needed
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.fetch(c.key, timeout_s=0.2)
                assert _code(e) == grpc.StatusCode.DEADLINE_EXCEEDED
            finally:
                gate.set()
            waiting = asyncio.ensure_future(client.fetch(c.key, timeout_s=20))
            assert await server.drain()  # the queue is encoded before it returns
            assert torch.equal(await waiting, enc.encode([c])[0])
            assert [len(k) for k in counting.calls] == [1, 1, 1]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.submit([d], fp)
            assert _code(e) == grpc.StatusCode.UNAVAILABLE
            assert (await client.load()).draining

    asyncio.run(go())


def test_two_encoders_of_one_machine_share_the_shared_memory_tier(enc: MediaEncoder, fp: str) -> None:
    it = image(enc, 60)
    name = f"swaserve-test-enc-{uuid.uuid4().hex[:8]}"
    first, second = Counting(enc), Counting(enc)

    async def go() -> None:
        async with (
            serving(first, fp, shm_cache=name) as (s1, c1),
            serving(second, fp, shm_cache=name) as (s2, c2),
        ):
            assert s1.shm is not None and s2.shm is not None
            try:
                await c1.submit([it], fp)
                want = await c1.fetch(it.key)
                for _ in range(200):  # the shared put follows the answer
                    if it.key in s2.shm:
                        break
                    await asyncio.sleep(0.01)
                assert await c2.submit([it], fp) == [True]
                assert torch.equal(await c2.fetch(it.key), want)
                assert (len(first.calls), len(second.calls)) == (1, 0)
                assert sample(s2, "swaserve:encoder_cache_hits_total", tier="shm") == 1
                assert sample(s2, "swaserve:encoder_shm_cache_bytes") > 0
            finally:
                s1.shm.unlink()

    asyncio.run(go())


def test_tls_serves_a_trusting_client_and_refuses_plaintext(
    enc: MediaEncoder, fp: str, tmp_path: Path
) -> None:
    ca = CA(tmp_path)
    cert = ca.issue("encoder", ips=("127.0.0.1",))
    it = image(enc, 80)

    async def go() -> None:
        creds, dialer = server_credentials(cert.cert, cert.key), Dialer(read_pem(ca.cert, "ca"))
        async with serving(enc, fp, credentials=creds, dialer=dialer) as (server, client):
            assert await client.submit([it], fp) == [True]
            assert torch.equal(await client.fetch(it.key), enc.encode([it])[0])
            plain = EncoderClient(f"127.0.0.1:{server.port}", timeout_s=2.0)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await plain.load()
                assert _code(e) == grpc.StatusCode.UNAVAILABLE
            finally:
                await plain.close()

    asyncio.run(go())


def test_a_client_reaches_an_encoder_that_starts_after_it(enc: MediaEncoder, fp: str) -> None:
    """A router dials encoders by name before their pods exist (the chart's StatefulSet): the
    client's channel retries within a couple of seconds, not after gRPC's default backoff."""
    from services.encoder.cli import EncoderOptions, EncoderServer
    from services.encoder.servicer import Limits
    from swaserve.procs import free_port

    port = free_port()

    async def go() -> float:
        client = EncoderClient(f"127.0.0.1:{port}", timeout_s=1.0)
        server = None
        try:
            for _ in range(3):  # nothing there: refused a few times, so the channel backs off
                with pytest.raises(grpc.aio.AioRpcError):
                    await client.load()
            opts = EncoderOptions(port=port, limits=Limits(), grace_s=1.0)
            server = EncoderServer(opts, encoder=enc, fingerprint=fp, modalities=frozenset({"image"}))
            await server.start()
            t0 = asyncio.get_running_loop().time()
            while True:
                try:
                    await client.load()
                    return asyncio.get_running_loop().time() - t0
                except grpc.aio.AioRpcError:
                    assert asyncio.get_running_loop().time() - t0 < 10, "not reconnected in 10 s"
                    await asyncio.sleep(0.1)
        finally:
            await client.close()
            if server is not None:
                await server.stop()

    asyncio.run(go())
