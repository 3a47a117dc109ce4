"""KV transport: how a prefill worker's ``KVPayload`` reaches a decode worker.

``KVSender`` is the interface the worker uses; ``GrpcKVSender`` streams page messages over the
decode worker's ``KVTransfer.Transfer`` gRPC service (``protos/swaserve/v1/kv_transfer.proto``):
the header, the decode worker's accepted ack, then the pages. A UCX transport (GCache issue)
implements the same interface; the receiving side stays ``KVStaging``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Protocol

import grpc

from services.kv_convert import transfer_messages
from services.tls import Dialer
from swaserve.transfer.kv_transfer import KVPayload, TransferError
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

log = logging.getLogger("prefill")
PUSH_ONLY_RECHECK_S = 300.0


class KVSender(Protocol):
    async def send(self, target: str, payload: KVPayload, timeout_s: float | None = None) -> int:
        """Deliver ``payload`` to the decode worker at ``target`` within ``timeout_s`` seconds
        (None: the sender's own limit); returns the K/V bytes it acknowledged. Raises
        TransferError (or the transport's own error) on failure."""
        ...

    async def close(self) -> None: ...


class GrpcKVSender:
    """Args: page_size: tokens per page. layers: layers per kind (``{"full": .., "swa": ..}``).
    timeout_s: deadline of one transfer (a hung decode worker fails it, and the router retries
    elsewhere). dialer: plaintext or TLS to the decode workers (``services.tls``).

    A decode worker's refusal (staging full: RESOURCE_EXHAUSTED; draining: UNAVAILABLE; aborted
    request: DATA_LOSS) arrives as the call's status before any page is sent. A decode worker of
    an earlier release (no ``Transfer``) gets the same pages over ``Push``."""

    def __init__(
        self,
        page_size: int,
        layers: dict[str, int],
        max_message_bytes: int = 64 << 20,
        timeout_s: float = 60.0,
        dialer: Dialer | None = None,
    ) -> None:
        self.page_size, self.layers, self.timeout_s = page_size, layers, timeout_s
        self.dialer = dialer or Dialer()
        self.max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        # decode workers of an earlier release (no Transfer) -> when seen; asked again after
        # PUSH_ONLY_RECHECK_S (upgraded in place)
        self._push_only: dict[str, float] = {}

    async def send(self, target: str, payload: KVPayload, timeout_s: float | None = None) -> int:
        timeout = self.timeout_s if timeout_s is None else min(self.timeout_s, timeout_s)
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = self.dialer.aio_channel(
                target, options=[("grpc.max_send_message_length", self.max_message_bytes)]
            )
        ack, seen_old = None, self._push_only.get(target)
        if seen_old is None or time.monotonic() - seen_old >= PUSH_ONLY_RECHECK_S:
            ack = await self._transfer(
                target, ch, transfer_messages(payload, self.page_size, self.layers), timeout
            )
        if ack is None:
            messages = transfer_messages(payload, self.page_size, self.layers)
            ack = await kvgrpc.KVTransferStub(ch).Push(messages, timeout=timeout)
        expect = payload.nbytes()
        if ack.bytes_received != expect:
            raise TransferError(f"decode worker acknowledged {ack.bytes_received} of {expect} bytes")
        return expect

    async def _transfer(
        self, target: str, ch: grpc.aio.Channel, messages: Iterator[kvpb.TransferMessage], timeout: float
    ) -> kvpb.TransferAck | None:
        """Header, wait for the accepted ack (a refusal is the call's status, raised as
        ``grpc.aio.AioRpcError``), pages, final ack; None: ``target`` may have no ``Transfer``."""
        call = kvgrpc.KVTransferStub(ch).Transfer(timeout=timeout)
        try:
            try:
                try:
                    await call.write(next(messages))
                except asyncio.InvalidStateError:
                    raise await _status(call) from None
                accepted = await call.read()
            except grpc.aio.AioRpcError as e:
                # UNIMPLEMENTED: an earlier release. grpc.aio reports that as INTERNAL when the
                # header's write lost the race with it (grpc/grpc#36066): Push this once (a real
                # fault fails Push as well)
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("decode worker %s has no KVTransfer.Transfer: using Push", target)
                    self._push_only[target] = time.monotonic()
                    return None
                if e.code() == grpc.StatusCode.INTERNAL:
                    return None
                raise
            if accepted is grpc.aio.EOF or not accepted.accepted:
                raise TransferError("decode worker did not accept the transfer's header")
            try:
                for m in messages:
                    await call.write(m)
                await call.done_writing()
            except asyncio.InvalidStateError:
                raise await _status(call) from None
            ack = await call.read()
        except BaseException:
            call.cancel()  # failed or cancelled here: the decode worker drops the transfer
            raise
        if ack is grpc.aio.EOF:
            raise TransferError("decode worker ended the transfer without its ack")
        return ack

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


async def _status(call: grpc.aio.StreamStreamCall) -> grpc.aio.AioRpcError:
    """The status of a call that ended while we wrote to it (grpc.aio's write then raises
    InvalidStateError), as the error a read would raise."""
    return grpc.aio.AioRpcError(
        await call.code(), await call.initial_metadata(), await call.trailing_metadata(), await call.details()
    )
