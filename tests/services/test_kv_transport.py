"""The prefill -> decode KV transfer over real gRPC (``GrpcKVSender`` into ``KVTransferService``,
in-process ``grpc.aio`` server on 127.0.0.1, small shapes): every refusal reaches the sender as its
own status, after its last message (a grpc.aio sender still writing pages when a status arrives
sees INTERNAL "Internal error from Core" instead, grpc/grpc#36066: the flaky CI failure this
guards); a page refused midway is DATA_LOSS, any other failure INTERNAL with its reason; a push
ends before the request's deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

import services.transport
from services.kv_convert import PAGES_PER_MESSAGE
from services.kv_receiver import KVTransferService
from services.transport import GrpcKVSender
from services.worker_metrics import WorkerMetrics
from swaserve.config import FULL, SWA
from swaserve.transfer.kv_transfer import KVPayload, KVStaging, LayerShape, expected_pages
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

LAYERS = {FULL: 2, SWA: 3}
SHAPE = LayerShape(2, 16, 16)
WINDOW, PAGE = 8, 4
ROW = 2 * 16 * 2 * 4  # K and V bytes of one token in one layer (float32)


def payload(rid: str, n: int) -> KVPayload:
    p = KVPayload(rid, n, WINDOW)
    g = torch.Generator().manual_seed(n)
    for kind, layers in LAYERS.items():
        lo, hi = p.token_range(kind)
        p.kv[kind] = [
            (torch.randn(hi - lo, 2, 16, generator=g), torch.randn(hi - lo, 2, 16, generator=g))
            for _ in range(layers)
        ]
    return p


def messages(n: int) -> int:
    """Messages of a transfer of ``n`` tokens: the header and the page messages."""
    return 1 + expected_pages(n, WINDOW, PAGE, LAYERS, PAGES_PER_MESSAGE)


def size(n: int) -> int:
    return (LAYERS[FULL] * n + LAYERS[SWA] * min(n, WINDOW)) * ROW


def staging(max_bytes: int) -> KVStaging:
    return KVStaging(LAYERS, {FULL: SHAPE, SWA: SHAPE}, WINDOW, PAGE, torch.float32, max_bytes)


async def serve(svc: KVTransferService) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    kvgrpc.add_KVTransferServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def pulled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Messages the sender took from each transfer's message stream (header and pages)."""
    counts: list[int] = []
    real = services.transport.transfer_messages

    def counting(*args: Any, **kw: Any) -> Iterator[kvpb.TransferMessage]:
        counts.append(0)
        for m in real(*args, **kw):
            counts[-1] += 1
            yield m

    monkeypatch.setattr(services.transport, "transfer_messages", counting)
    return counts


def run(body: Callable[[GrpcKVSender, str, KVTransferService], object], svc: KVTransferService) -> None:
    async def main() -> None:
        server, addr = await serve(svc)
        sender = GrpcKVSender(PAGE, LAYERS, timeout_s=30)
        try:
            await body(sender, addr, svc)  # type: ignore[misc]
        finally:
            await sender.close()
            await server.stop(None)

    asyncio.run(main())


def test_staging_full_is_resource_exhausted_every_time(pulled: list[int]) -> None:
    big = 400  # 40 page messages: the sender is still writing when the header is refused
    svc = KVTransferService(staging(size(big) + size(40) - 1), WorkerMetrics(), {})

    async def body(sender: GrpcKVSender, addr: str, svc: KVTransferService) -> None:
        assert await sender.send(addr, payload("small", 40)) == size(40)  # staged, not claimed
        for i in range(20):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await sender.send(addr, payload(f"big-{i}", big))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (i, e.value.details())
            assert "staging full" in (e.value.details() or "")
        assert svc.staging.open_ids() == ["small"] and svc.staging.staged_bytes == size(40)
        assert pulled == [messages(40)] + [messages(big)] * 20  # refused after the last page
        got = svc.staging.claim("small")
        want = payload("small", 40)
        for kind in LAYERS:
            for (k, v), (wk, wv) in zip(got.kv[kind], want.kv[kind], strict=True):
                assert torch.equal(k, wk) and torch.equal(v, wv)
        assert await sender.send(addr, payload("big", big)) == size(big)  # room again

        # larger than the whole staging: never here, said as such (the router then gives a 400)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await sender.send(addr, payload("huge", 2 * big))
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "larger than this decode worker's whole KV staging" in (e.value.details() or "")
        assert pulled[-1] == messages(2 * big)

    run(body, svc)


def test_a_page_refused_midway_is_data_loss_and_nothing_stays_staged() -> None:
    svc = KVTransferService(staging(1 << 30), WorkerMetrics(), {})

    async def body(sender: GrpcKVSender, addr: str, svc: KVTransferService) -> None:
        p = payload("corrupt", 200)
        p.kv[FULL][1] = (p.kv[FULL][1][0][:, :1], p.kv[FULL][1][1])  # one layer's K of 1 head
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await sender.send(addr, p)
        assert e.value.code() == grpc.StatusCode.DATA_LOSS, (e.value.code(), e.value.details())
        assert not svc.staging.open_ids() and svc.staging.staged_bytes == 0
        assert await sender.send(addr, payload("after", 30)) == size(30)

    run(body, svc)


def test_a_draining_decode_worker_refuses_with_its_reason(pulled: list[int]) -> None:
    svc = KVTransferService(staging(1 << 30), WorkerMetrics(), {}, draining=lambda: True)

    async def body(sender: GrpcKVSender, addr: str, svc: KVTransferService) -> None:
        for i in range(10):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await sender.send(addr, payload(f"d-{i}", 300))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert (e.value.details() or "").startswith("worker is draining")
        assert svc.active == 0 and pulled == [messages(300)] * 10

    run(body, svc)


def test_an_unexpected_failure_midway_is_internal_after_the_senders_last_page(
    pulled: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception on a page (not only a refused one) waits for the sender's last message: the
    sender gets the decode worker's INTERNAL with its reason, never grpc.aio's stand-in; nothing
    stays staged."""
    import services.kv_receiver

    real, seen = services.kv_receiver.page_from_proto, [0]

    def failing(m: kvpb.KVPage) -> Any:
        seen[0] += 1
        if seen[0] == 5:
            raise RuntimeError("boom")
        return real(m)

    monkeypatch.setattr(services.kv_receiver, "page_from_proto", failing)
    svc = KVTransferService(staging(1 << 30), WorkerMetrics(), {})

    async def body(sender: GrpcKVSender, addr: str, svc: KVTransferService) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await sender.send(addr, payload("midway", 300))
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "decode worker failed on the KV transfer: RuntimeError('boom')" in (e.value.details() or "")
        assert pulled == [messages(300)] and seen[0] == 5  # all sent; the rest read and dropped
        assert not svc.staging.open_ids() and svc.active == 0

    run(body, svc)


class _Stalled(KVTransferService):
    """A decode worker that takes the header and then hangs (as one stopped mid-transfer)."""

    async def Push(self, request_iterator: Any, context: Any) -> Any:
        await anext(aiter(request_iterator))
        await asyncio.sleep(60)
        return kvpb.TransferAck()


def test_a_prefill_workers_push_ends_before_the_requests_deadline() -> None:
    """``Worker._push`` bounds the push by the Generate call's deadline (less a margin), so a hung
    decode worker fails the push, which the router blames on that decode worker, before the
    router's own deadline would fail the prefill worker's call (and blame it)."""
    import time
    from types import SimpleNamespace

    from services.worker import WorkerService
    from swaserve.transfer.kv_transfer import TransferError

    svc = _Stalled(staging(1 << 30), WorkerMetrics(), {})

    async def body(sender: GrpcKVSender, addr: str, svc: KVTransferService) -> None:
        worker = SimpleNamespace(sender=sender, metrics=WorkerMetrics())
        deadline = time.monotonic() + 5.0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await WorkerService._push(worker, addr, payload("hung", 40), deadline)  # type: ignore[arg-type]
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() < deadline  # the push's own deadline came first
        with pytest.raises(TransferError, match="no time left"):
            await WorkerService._push(worker, addr, payload("late", 40), time.monotonic() - 1)  # type: ignore[arg-type]

    run(body, svc)
