"""Decode side of the KV transfer: ``KVTransferService`` (gRPC ``KVTransfer.Push``) receives a
prefill worker's pages into verified host staging (``KVStaging``, built by ``staging_for``), where
they wait for the request's decode ``Generate`` (``services.worker``).

Design notes: docs/DESIGN.md#servicesworkerpy"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from services.convert import WORKER_DRAINING
from services.kv_convert import hidden_from_header, page_from_proto
from swaserve.config import FULL, SWA, kv_config
from swaserve.engine.client import LocalEngineClient
from swaserve.kvformat import engine_formats, residual_layers
from swaserve.transfer.kv_transfer import KVStaging, LayerShape, StagingFull, TransferError
from swaserve.v1 import kv_transfer_pb2 as kvpb
from swaserve.v1 import kv_transfer_pb2_grpc as kvgrpc

if TYPE_CHECKING:
    from services.worker_metrics import WorkerMetrics


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


class KVTransferService(kvgrpc.KVTransferServicer):
    """Decode side of the KV transfer: pages into ``KVStaging``. ``staged_at`` records when each
    transfer began (for expiry); a transfer for an id in ``aborted`` is refused or dropped; a
    transfer that fails or is cancelled midway is dropped at once. While ``draining()`` new
    transfers are refused (UNAVAILABLE); ``active`` counts the ones in progress."""

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
        if self.draining():
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"{WORKER_DRAINING} (shutting down): it takes no new KV"
            )
        self.active += 1
        try:
            return await self._receive(request_iterator, context)
        finally:
            self.active -= 1

    async def _receive(
        self, request_iterator: AsyncIterator[kvpb.TransferMessage], context: grpc.aio.ServicerContext
    ) -> kvpb.TransferAck:
        rid: str | None = None
        num_pages = received = pages = 0
        done = False
        try:
            async for m in request_iterator:
                kind = m.WhichOneof("kind")
                if kind == "header":
                    if rid is not None:
                        raise TransferError("second header in one transfer")
                    if m.header.request_id in self.aborted:
                        raise TransferError(f"request {m.header.request_id!r} was aborted")
                    if m.header.request_id in self.staging.open_ids():  # a retry supersedes it
                        self.staging.discard(m.header.request_id)
                    h = m.header
                    self.staging.begin(
                        h.request_id,
                        h.num_tokens,
                        h.sampler_state,
                        list(h.spec_drafts),
                        hidden_from_header(h),
                    )
                    rid, num_pages = m.header.request_id, m.header.num_pages
                    received += len(h.mtp_hidden)  # payload bytes (KVPayload.nbytes): the hidden states too
                    self.staged_at[rid] = time.monotonic()
                elif kind == "page":
                    if rid is None or m.page.request_id != rid:
                        raise TransferError("page before its transfer's header")
                    self.staging.add(page_from_proto(m.page))
                    received += len(m.page.k) + len(m.page.v)
                    pages += 1
            if rid is None:
                raise TransferError("empty transfer")
            if pages != num_pages:
                raise TransferError(f"header announced {num_pages} pages, got {pages}")
            if rid in self.aborted:
                raise TransferError(f"request {rid!r} was aborted during its transfer")
            self.staging.finish(rid)
            done = True
        except StagingFull as e:  # no room now: the router tries another decode worker
            self.metrics.kv_failed.inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except TransferError as e:
            self.metrics.kv_failed.inc()
            await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
        finally:
            if not done and rid is not None:  # failed, refused or cancelled: nothing stays staged
                self.staging.discard(rid)
                self.staged_at.pop(rid, None)
        assert rid is not None
        self.metrics.kv_received.inc(received)
        return kvpb.TransferAck(request_id=rid, bytes_received=received, pages=pages)
