"""KV transport: how a prefill worker's ``KVPayload`` reaches a decode worker.

``KVSender`` is the interface the worker uses; ``GrpcKVSender`` streams page messages over the
decode worker's ``KVTransfer.Push`` gRPC service (``protos/swaserve/v1/kv_transfer.proto``). A UCX
transport (GCache issue) implements the same interface; the receiving side stays ``KVStaging``.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from services.kv_convert import transfer_messages
from services.tls import Dialer
from swaserve.transfer.kv_transfer import KVPayload, TransferError
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc


class KVSender(Protocol):
    async def send(self, target: str, payload: KVPayload, timeout_s: float | None = None) -> int:
        """Deliver ``payload`` to the decode worker at ``target`` within ``timeout_s`` seconds
        (None: the sender's own limit); returns the K/V bytes it acknowledged. Raises
        TransferError (or the transport's own error) on failure."""
        ...

    async def close(self) -> None: ...


class GrpcKVSender:
    """Args: page_size: tokens per page. layers: layers per kind (``{"full": .., "swa": ..}``).
    timeout_s: deadline of one push (a hung decode worker fails the push, and the router retries
    elsewhere). dialer: plaintext or TLS to the decode workers (``services.tls``).

    A decode worker's refusal (staging full: RESOURCE_EXHAUSTED; more than its whole staging:
    OUT_OF_RANGE; draining: UNAVAILABLE; a refused page: DATA_LOSS) is the call's status, given
    after the last page (``services.kv_receiver``)."""

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

    async def send(self, target: str, payload: KVPayload, timeout_s: float | None = None) -> int:
        timeout = self.timeout_s if timeout_s is None else min(self.timeout_s, timeout_s)
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = self.dialer.aio_channel(
                target, options=[("grpc.max_send_message_length", self.max_message_bytes)]
            )
        ack = await kvgrpc.KVTransferStub(ch).Push(
            transfer_messages(payload, self.page_size, self.layers), timeout=timeout
        )
        expect = payload.nbytes()
        if ack.bytes_received != expect:
            raise TransferError(f"decode worker acknowledged {ack.bytes_received} of {expect} bytes")
        return expect

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
