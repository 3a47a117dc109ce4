"""``EncoderClient``: one encoder process over gRPC, for the router (Submit, GetLoad) and the
prefill workers (Fetch).

Errors: a gRPC status (the encoder down, NOT_FOUND, RESOURCE_EXHAUSTED, ...) surfaces as
``grpc.aio.AioRpcError`` for the caller to retry elsewhere or fail over; a stream that does not
check out (CRC, row order, size, dtype) as ``wire.WireError``. Create it in the event loop that
uses it (``close`` when done)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.encoder.limits import MAX_EMBEDDING_BYTES, MAX_SUBMIT_BYTES
from services.tls import Dialer
from swaserve.encoder.items import EncodeItem
from swaserve.v1 import encoder_pb2 as pb
from swaserve.v1 import encoder_pb2_grpc as egrpc

if TYPE_CHECKING:  # the router submits without torch (a process start ~2 s faster)
    import torch

DEFAULT_FETCH_WAIT_S = 60.0  # the encoder's own default (--fetch-timeout-s)


def to_proto(item: EncodeItem) -> pb.MediaItem:
    """``item`` as a Submit ``MediaItem`` (a video's times and frame size included)."""
    h, w = item.size if item.size is not None else (0, 0)
    return pb.MediaItem(
        key=item.key,
        modality=item.modality,
        data=item.data,
        num_tokens=item.num_tokens,
        times=list(item.times),
        height=h,
        width=w,
    )


class EncoderClient:
    """Calls to the encoder at ``address`` (``host:port``).

    Args:
        dialer: plaintext or TLS (``services.tls``); default plaintext.
        timeout_s: deadline of Submit and GetLoad, and what a Fetch gets on top of its wait
            for the transfer (seconds).
        max_submit_bytes: the largest Submit sent (the items' media together, bytes).
    """

    def __init__(
        self,
        address: str,
        dialer: Dialer | None = None,
        timeout_s: float = 10.0,
        max_submit_bytes: int = MAX_SUBMIT_BYTES,
    ) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = (dialer or Dialer()).aio_channel(
            address,
            options=[
                ("grpc.max_send_message_length", max_submit_bytes),
                # an encoder pod re-created under its name (or one that starts after the router) is
                # dialed again within a second or two, not after gRPC's default backoff (up to 120 s)
                ("grpc.initial_reconnect_backoff_ms", 250),
                ("grpc.min_reconnect_backoff_ms", 250),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self._stub = egrpc.EncoderStub(self._channel)

    async def submit(self, items: Sequence[EncodeItem], fingerprint: str) -> list[bool]:
        """Hand ``items`` to the encoder (queued, or found cached or in flight there); returns
        its per-item acceptance. ``fingerprint``: the caller's model fingerprint.

        Raises:
            grpc.aio.AioRpcError: e.g. FAILED_PRECONDITION (another model), INVALID_ARGUMENT
                (a bad item, named), RESOURCE_EXHAUSTED (queue full), UNAVAILABLE (draining, down).
        """
        req = pb.SubmitRequest(items=[to_proto(it) for it in items], model_fingerprint=fingerprint)
        reply = await self._stub.Submit(req, timeout=self.timeout_s)
        return list(reply.accepted)

    async def fetch(
        self, key: bytes, timeout_s: float = DEFAULT_FETCH_WAIT_S, max_bytes: int = MAX_EMBEDDING_BYTES
    ) -> torch.Tensor:
        """The embeddings ``[num_tokens, hidden]`` of item ``key`` (CPU, the encoder's dtype),
        waiting up to ``timeout_s`` seconds while it encodes; ``max_bytes`` bounds their size.

        Raises:
            grpc.aio.AioRpcError: NOT_FOUND (unknown there), DEADLINE_EXCEEDED (still encoding),
                INVALID_ARGUMENT (its media failed to decode), UNAVAILABLE, ...
            WireError: a stream that does not check out.
        """
        from services.encoder.wire import Assembler

        req = pb.FetchRequest(key=key, timeout_s=timeout_s)
        call = self._stub.Fetch(req, timeout=timeout_s + self.timeout_s)
        asm = Assembler(max_bytes)
        try:
            async for chunk in call:
                asm.feed(chunk)
        except BaseException:
            call.cancel()
            raise
        return asm.finish()

    async def load(self) -> pb.EncoderLoad:
        """The encoder's ``EncoderLoad`` (queue, cache, fingerprint, draining, boot id).
        Raises grpc.aio.AioRpcError."""
        return await self._stub.GetLoad(pb.EncoderLoadRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        await self._channel.close()


class EncoderClients:
    """One ``EncoderClient`` per encoder address, made on first use (a router's placement, a prefill
    worker's fetches), all closed together."""

    def __init__(self, dialer: Dialer | None = None) -> None:
        self.dialer = dialer
        self._clients: dict[str, EncoderClient] = {}

    def get(self, address: str) -> EncoderClient:
        c = self._clients.get(address)
        if c is None:
            c = self._clients[address] = EncoderClient(address, dialer=self.dialer)
        return c

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            with contextlib.suppress(Exception):  # closing a channel whose peer died
                await c.close()
