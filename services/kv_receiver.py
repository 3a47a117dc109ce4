"""Decode side of the KV transfer: ``KVTransferService`` (gRPC ``KVTransfer.Push``) receives a
prefill worker's pages into verified host staging (``KVStaging``, built by ``staging_for``), where they wait for the request's decode
``Generate`` (``services.worker``).

Design notes: docs/DESIGN.md#servicesworkerpy"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, NoReturn

import grpc

from services.convert import WORKER_DRAINING
from services.kv_convert import hidden_from_header, page_from_proto
from swaserve.config import FULL, SWA, kv_config
from swaserve.engine.client import LocalEngineClient
from swaserve.kvformat import engine_formats, residual_layers
from swaserve.transfer.kv_transfer import (
    KVPayload,
    KVStaging,
    LayerShape,
    StagingFull,
    StagingTooSmall,
    TransferError,
)
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

if TYPE_CHECKING:
    from services.worker_metrics import WorkerMetrics

DRAINING_KV = f"{WORKER_DRAINING} (shutting down): it takes no new KV"
log = logging.getLogger("decode")


def transfer_layers(engine: LocalEngineClient) -> dict[str, int]:
    """Layers per kind in a KV transfer: the model's, and with MTP on its MTP layers as SWA ones
    and KIVI's residuals (``config.kv_config``); a prefill and a decode worker must agree on it."""
    cfg, ecfg = engine.model_config, engine.engine_config
    kcfg = kv_config(cfg, ecfg.speculative_num_steps, residual_layers(engine_formats(ecfg, cfg), cfg))
    return {FULL: len(kcfg.full_layers), SWA: len(kcfg.swa_layers)}


def staging_for(engine: LocalEngineClient, max_bytes: int) -> KVStaging:
    cfg, ecfg = engine.model_config, engine.engine_config
    return KVStaging(
        transfer_layers(engine),
        {
            FULL: LayerShape(cfg.full.num_kv_heads, cfg.full.head_dim, cfg.full.v_head_dim),
            SWA: LayerShape(cfg.swa.num_kv_heads, cfg.swa.head_dim, cfg.swa.v_head_dim),
        },
        cfg.window if ecfg.kv_layout == "hybrid" else 1 << 40,
        ecfg.page_size,
        engine.kv_dtype,
        max_bytes,
        engine_formats(ecfg, cfg),
    )


class _Inbound:
    """One transfer arriving: its header reserves staging (``KVStaging.begin``), its pages are
    verified into it; ``close`` drops whatever did not finish. It only ever touches its own
    ``begin``: a newer transfer of the same id (a retry supersedes) is not this one's."""

    def __init__(self, svc: KVTransferService) -> None:
        self.svc = svc
        self.rid: str | None = None
        self.transfer: KVPayload | None = None
        self.num_pages = self.received = self.pages = 0
        self.done = False

    def take(self, m: kvpb.TransferMessage) -> None:
        """Raises: TransferError (StagingFull at the header) for a message it refuses."""
        kind = m.WhichOneof("kind")
        if kind == "header":
            if self.rid is not None:
                raise TransferError("second header in one transfer")
            h = m.header
            if h.request_id in self.svc.aborted:
                raise TransferError(f"request {h.request_id!r} was aborted")
            staging = self.svc.staging
            staging.discard(h.request_id)  # a retry supersedes an earlier transfer of the id
            self.transfer = staging.begin(
                h.request_id, h.num_tokens, h.sampler_state, list(h.spec_drafts), hidden_from_header(h)
            )
            self.rid, self.num_pages = h.request_id, h.num_pages
            self.received += len(h.mtp_hidden)  # payload bytes (KVPayload.nbytes): the hidden states too
            self.svc.staged_at[self.rid] = time.monotonic()
        elif kind == "page":
            if self.rid is None or m.page.request_id != self.rid:
                raise TransferError("page before its transfer's header")
            self.svc.staging.add(page_from_proto(m.page), self.transfer)
            self.received += len(m.page.k) + len(m.page.v)
            self.pages += 1

    def finish(self) -> kvpb.TransferAck:
        """After the sender's last message. Raises: TransferError (missing pages, aborted)."""
        if self.rid is None:
            raise TransferError("empty transfer")
        if self.pages != self.num_pages:
            raise TransferError(f"header announced {self.num_pages} pages, got {self.pages}")
        if self.rid in self.svc.aborted:
            raise TransferError(f"request {self.rid!r} was aborted during its transfer")
        self.svc.staging.finish(self.rid, self.transfer)
        self.done = True
        self.svc.metrics.kv_received.inc(self.received)
        return kvpb.TransferAck(request_id=self.rid, bytes_received=self.received, pages=self.pages)

    def close(self) -> None:
        """Failed, refused or cancelled: nothing of this transfer stays staged (once)."""
        if not self.done and self.rid is not None and self.svc.staging.discard(self.rid, self.transfer):
            self.svc.staged_at.pop(self.rid, None)
        self.done = True


class KVTransferService(kvgrpc.KVTransferServicer):
    """Decode side of the KV transfer: pages into ``KVStaging``. ``staged_at`` records when each
    transfer began (for expiry); a transfer for an id in ``aborted`` is refused or dropped; a
    transfer that fails or is cancelled midway is dropped at once. While ``draining()`` new
    transfers are refused (UNAVAILABLE); ``active`` counts the ones in progress.

    A refusal's status is sent only after the sender's last message (a refused transfer reads the
    rest and drops it): a status sent while the sender still writes reaches a ``grpc.aio`` sender
    as INTERNAL "Internal error from Core" instead (grpc/grpc#36066)."""

    def __init__(
        self,
        staging: KVStaging,
        metrics: WorkerMetrics,
        staged_at: dict[str, float],
        aborted: dict[str, float] | None = None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.staging, self.metrics, self.staged_at = staging, metrics, staged_at
        self.aborted = aborted if aborted is not None else {}
        self.draining = draining
        self.active = 0

    async def Push(
        self, request_iterator: AsyncIterator[kvpb.TransferMessage], context: grpc.aio.ServicerContext
    ) -> kvpb.TransferAck:
        self.active += 1
        inbound = _Inbound(self)
        try:
            if self.draining():  # after the sender's last message (class docstring)
                async for _ in request_iterator:
                    pass
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAINING_KV)
            return await self._rest(inbound, aiter(request_iterator), context)
        finally:
            inbound.close()
            self.active -= 1

    async def _rest(
        self,
        inbound: _Inbound,
        messages: AsyncIterator[kvpb.TransferMessage],
        context: grpc.aio.ServicerContext,
    ) -> kvpb.TransferAck:
        """Take the sender's messages to its last; the first refused one drops the transfer at once
        and the rest are read and dropped, then the refusal is the call's status."""
        error: Exception | None = None
        async for m in messages:
            if error is not None:
                continue
            try:
                inbound.take(m)
            except Exception as e:  # any failure: the status waits for the sender's last message
                error = e
                inbound.close()
        try:
            if error is not None:
                raise error
            return inbound.finish()
        except Exception as e:
            await self._refuse(context, e)

    async def _refuse(self, context: grpc.aio.ServicerContext, e: Exception) -> NoReturn:
        """The call's status for ``e``: staging full RESOURCE_EXHAUSTED (the router tries another
        decode worker), more than the whole staging OUT_OF_RANGE (never here: another decode worker,
        or a 400), a refused message DATA_LOSS, anything else INTERNAL (logged)."""
        self.metrics.kv_failed.inc()
        if isinstance(e, StagingFull):
            code, msg = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        elif isinstance(e, StagingTooSmall):
            code, msg = grpc.StatusCode.OUT_OF_RANGE, str(e)
        elif isinstance(e, TransferError):
            code, msg = grpc.StatusCode.DATA_LOSS, str(e)
        else:
            log.error("KV transfer failed", exc_info=e)
            code, msg = grpc.StatusCode.INTERNAL, f"decode worker failed on the KV transfer: {e!r}"
        await context.abort(code, msg)
        raise AssertionError("context.abort returned")
