"""The encoder's scheduling loop (``EncodeScheduler``) and its gRPC service (``EncoderServicer``).

Submit (answered at once): each item is checked (16-byte key, a modality this model has, data and
row-count bounds, a video's sampling plan); then a key already in the memory or shared-memory
cache, or in flight, is not queued again; the others go to the ``EncodeBatcher`` (cost: rows)
under ``max_queued_items`` (over it: RESOURCE_EXHAUSTED, nothing of that call queued). A wrong
model fingerprint is FAILED_PRECONDITION; a bad item INVALID_ARGUMENT naming it (the call's good
items stay queued); while draining, UNAVAILABLE.

The loop takes ``next_batch`` and runs ``MediaEncoder.encode`` on one worker thread (one forward at
a time; the event loop keeps serving), caches each item's rows and resolves its waiters. A batch
that fails is retried item by item, so one bad item fails only itself: its error (a ``MediaError``
-> INVALID_ARGUMENT, anything else INTERNAL) is kept in a bounded LRU for its Fetch callers; a
new Submit of the key tries it again.

Fetch: cached -> streamed at once (``wire.chunks``); in flight -> waits up to ``timeout_s``
(DEADLINE_EXCEEDED after); failed -> its error; unknown -> NOT_FOUND (the prefill worker fails
the request over and the router submits again)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NoReturn, Protocol, cast

import grpc
import torch

from services.encoder.limits import CHUNK_BYTES
from services.encoder.metrics import EncoderMetrics
from services.encoder.wire import chunks
from swaserve.encoder.batcher import EncodeBatcher, Modality, PendingItem
from swaserve.encoder.cache import Embedding, EmbeddingCache, InFlight
from swaserve.encoder.items import EncodeItem
from swaserve.encoder.shm_cache import ShmEmbeddingCache
from swaserve.media import MediaError
from swaserve.media.placeholders import KEY_BYTES, MODALITIES
from swaserve.v1 import encoder_pb2 as pb
from swaserve.v1 import encoder_pb2_grpc as egrpc

log = logging.getLogger("swaserve.encoder")
SERVICE = pb.DESCRIPTOR.services_by_name["Encoder"].full_name
FAILED_KEYS = 4096  # failed items whose error a Fetch still reports (LRU)
FETCH_OUTCOME = {grpc.StatusCode.NOT_FOUND: "not_found", grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}


class Encoder(Protocol):
    """What the loop runs: ``MediaEncoder`` (tests pass counting or blocking stand-ins)."""

    def encode(self, items: Sequence[EncodeItem]) -> list[torch.Tensor]: ...


class RpcFailure(Exception):
    """A call's or an item's error as a gRPC status (``code``, ``message``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Limits:
    """Scheduler bounds: batches (items, summed rows, oldest item's wait in s), the queue (items),
    one item (raw bytes, rows), the default Fetch wait (s)."""

    max_batch_items: int = 16
    max_batch_tokens: int = 16384
    max_wait_s: float = 0.005
    max_queued_items: int = 1024
    max_item_bytes: int = 64 << 20
    max_item_tokens: int = 1 << 18
    fetch_timeout_s: float = 60.0


class EncodeScheduler:
    """Caches, in-flight dedupe, the batcher and the loop over one encoder (module docstring).
    ``start`` in the serving event loop; ``close`` to stop. Not thread-safe: one loop drives it."""

    def __init__(
        self,
        encoder: Encoder,
        fingerprint: str,
        modalities: Collection[str],
        memory: EmbeddingCache,
        shm: ShmEmbeddingCache | None = None,
        limits: Limits | None = None,
        metrics: EncoderMetrics | None = None,
    ) -> None:
        self.encoder, self.fingerprint, self.modalities = encoder, fingerprint, frozenset(modalities)
        self.memory, self.shm = memory, shm
        self.limits = lim = limits or Limits()
        self.metrics = metrics or EncoderMetrics()
        self.batcher = EncodeBatcher(
            lim.max_batch_items, lim.max_batch_tokens, lim.max_wait_s, time.monotonic
        )
        self.inflight = InFlight()
        self.failed: OrderedDict[bytes, RpcFailure] = OrderedDict()
        self.boot_id = uuid.uuid4().hex
        self.draining = False
        self.running = 0  # items in the forward now
        self._current: list[PendingItem] = []  # the batch in the forward now
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="encoder-forward")
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.metrics.watch(self)

    # -- Submit -----------------------------------------------------------------------------------
    def submit(self, items: Sequence[pb.MediaItem], fingerprint: str) -> list[bool]:
        """Queue the items not cached or in flight; returns one True per item.

        Raises:
            RpcFailure: UNAVAILABLE (draining), FAILED_PRECONDITION (another model's fingerprint),
                RESOURCE_EXHAUSTED (the queue bound; nothing queued), INVALID_ARGUMENT (bad items,
                named; the good ones are queued).
        """
        if self.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "the encoder is shutting down")
        if fingerprint != self.fingerprint:
            raise RpcFailure(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model fingerprint {fingerprint!r} is not this encoder's ({self.fingerprint})",
            )
        bad: list[str] = []
        new: dict[bytes, EncodeItem] = {}
        for i, m in enumerate(items):
            try:
                item = self._check(m)
            except MediaError as e:
                bad.append(f"item {i}: {e}")
                continue
            if item.key in new:  # twice in one call: the second joins the first
                self.metrics.items.labels(item.modality, "cached").inc()
            elif not self._known(item):
                new[item.key] = item
        queued = len(self.batcher)
        if queued + len(new) > self.limits.max_queued_items:
            raise RpcFailure(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"encoder queue full: {queued} items queued, {len(new)} more asked, bound "
                f"{self.limits.max_queued_items}",
            )
        for key, item in new.items():
            self.metrics.cache_misses.inc()
            self.failed.pop(key, None)  # a new submit tries a failed key again
            self.inflight.claim(key)
            modality = cast(Modality, item.modality)  # checked in _check
            self.batcher.submit(PendingItem(key, modality, item.num_tokens, item.num_tokens, item))
        if new:
            self._wake.set()
        if bad:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(bad))
        return [True] * len(items)

    def _check(self, m: pb.MediaItem) -> EncodeItem:
        """``m`` as an ``EncodeItem``; raises MediaError naming what is wrong."""
        lim = self.limits
        if len(m.key) != KEY_BYTES:
            raise MediaError(f"a key has {KEY_BYTES} bytes, got {len(m.key)}")
        if m.modality not in MODALITIES:
            raise MediaError(f"unknown modality {m.modality!r} (known: {', '.join(MODALITIES)})")
        if m.modality not in self.modalities:
            raise MediaError(f"this model does not take {m.modality} input")
        if not 0 < len(m.data) <= lim.max_item_bytes:
            raise MediaError(f"{len(m.data)} bytes of media: need 1 to {lim.max_item_bytes}")
        if not 0 < m.num_tokens <= lim.max_item_tokens:
            raise MediaError(f"num_tokens {m.num_tokens}: need 1 to {lim.max_item_tokens}")
        times: tuple[float, ...] = ()
        size: tuple[int, int] | None = None
        if m.modality == "video":
            times = tuple(float(t) for t in m.times)
            if not times or not all(math.isfinite(t) and t >= 0 for t in times):
                raise MediaError("a video item needs its sampled frame times (finite, >= 0 s)")
            if m.height < 1 or m.width < 1:
                raise MediaError(f"a video item needs its frame size, got {m.height}x{m.width}")
            size = (m.height, m.width)
        elif m.height or m.width:  # an image resized to a size of its own (``detail: low``)
            if m.height < 1 or m.width < 1:
                raise MediaError(f"an image size needs both sides, got {m.height}x{m.width}")
            size = (m.height, m.width)
        return EncodeItem(bytes(m.key), m.modality, bytes(m.data), m.num_tokens, times, size)

    def _known(self, item: EncodeItem) -> bool:
        """Whether ``item`` needs no forward: cached in a tier, or in flight (counted)."""
        key, tier = item.key, None
        if key in self.memory:
            tier = "memory"
        elif key in self.inflight:
            pass  # joins the computation under way
        elif self.shm is not None and key in self.shm:
            tier = "shm"
        else:
            return False
        if tier is not None:
            self.metrics.cache_hits.labels(tier).inc()
        self.metrics.items.labels(item.modality, "cached").inc()
        return True

    # -- Fetch ------------------------------------------------------------------------------------
    async def fetch(self, key: bytes, timeout_s: float = 0.0) -> Embedding:
        """The item's embeddings, waiting up to ``timeout_s`` (0: the default) while it is queued
        or encoding.

        Raises:
            RpcFailure: INVALID_ARGUMENT (a bad key, or the item's media failed), INTERNAL (the
                encoder failed on it), DEADLINE_EXCEEDED (still encoding), NOT_FOUND (unknown).
        """
        if len(key) != KEY_BYTES:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"a key has {KEY_BYTES} bytes, got {len(key)}")
        emb = self.memory.get(key)
        if emb is None and self.shm is not None:
            emb = await asyncio.to_thread(self.shm.get, key)
            if emb is not None:
                self.memory.put(key, emb)
        if emb is not None:
            return emb
        if key in self.inflight:
            wait = timeout_s if timeout_s > 0 else self.limits.fetch_timeout_s
            fut: asyncio.Future[Embedding] = asyncio.get_running_loop().create_future()
            self.inflight.wait(key, fut)
            try:
                return await asyncio.wait_for(fut, wait)
            except TimeoutError:
                raise RpcFailure(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"item {key.hex()} still encoding after {wait:g} s"
                ) from None
        failure = self.failed.get(key)
        if failure is not None:
            raise failure
        raise RpcFailure(
            grpc.StatusCode.NOT_FOUND, f"item {key.hex()} is not cached, queued or encoding here"
        )

    # -- the loop ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop task in the running event loop."""
        self._task = asyncio.create_task(self._run(), name="encoder-loop")

    async def _run(self) -> None:
        while True:
            batch = self.batcher.next_batch()
            if batch is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.batcher.time_to_next())
                continue
            try:
                await self._encode_batch(batch)
            except Exception:  # never leave waiters hanging on a bug: fail the batch's keys
                log.exception("encoder loop: batch of %d failed unexpectedly", len(batch))
                for p in batch:
                    if p.key in self.inflight:
                        self._fail(p, RpcFailure(grpc.StatusCode.INTERNAL, "the encoder loop failed"))

    def _forward(self, items: list[EncodeItem]) -> list[torch.Tensor]:
        """One encoder call, on the worker thread; each output in its own contiguous storage."""
        t0 = time.perf_counter()
        try:
            return [o.detach().cpu().contiguous().clone() for o in self.encoder.encode(items)]
        finally:
            self.metrics.batch_items.observe(len(items))
            self.metrics.encode_seconds.labels(items[0].modality).observe(time.perf_counter() - t0)

    async def _encode_batch(self, batch: list[PendingItem]) -> None:
        loop = asyncio.get_running_loop()
        items: list[EncodeItem] = [p.payload for p in batch]
        self._current, self.running = batch, len(batch)
        results: list[torch.Tensor | BaseException] = []
        try:
            try:
                results = list(await loop.run_in_executor(self._pool, self._forward, items))
            except Exception as e:
                if len(items) == 1:
                    results = [e]
                else:  # one bad item must not fail the others: each alone
                    log.info("a batch of %d failed (%s): encoding each alone", len(items), e)
                    for it in items:
                        try:
                            results.extend(await loop.run_in_executor(self._pool, self._forward, [it]))
                        except Exception as e1:
                            results.append(e1)
        finally:
            self._current, self.running = [], 0
        done: list[tuple[bytes, Embedding]] = []
        for p, r in zip(batch, results, strict=True):
            if isinstance(r, BaseException):
                self._fail(p, r)
            elif r.dim() != 2 or r.shape[0] != p.num_tokens:
                self._fail(p, MediaError(f"the encoder gave {tuple(r.shape)} for {p.num_tokens} rows"))
            else:
                done.append((p.key, self._finish(p, r)))
        if self.shm is not None and done:
            await loop.run_in_executor(self._pool, self._shm_put, done)

    def _finish(self, p: PendingItem, data: torch.Tensor) -> Embedding:
        emb = Embedding(data, {"modality": p.modality})
        if not self.memory.put(p.key, emb):
            log.warning(
                "item %s (%d bytes) is larger than the whole cache: not cached", p.key.hex(), emb.nbytes
            )
        self.metrics.items.labels(p.modality, "encoded").inc()
        for fut in self.inflight.finish(p.key):
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_result(emb)
        return emb

    def _fail(self, p: PendingItem, error: BaseException) -> None:
        failure = error if isinstance(error, RpcFailure) else None
        if failure is None:
            media = isinstance(error, MediaError)
            if not media:
                log.error("encoding %s %s failed: %r", p.modality, p.key.hex(), error)
            code = grpc.StatusCode.INVALID_ARGUMENT if media else grpc.StatusCode.INTERNAL
            failure = RpcFailure(code, f"{p.modality} {p.key.hex()}: {error}")
        self.failed[p.key] = failure
        self.failed.move_to_end(p.key)
        while len(self.failed) > FAILED_KEYS:
            self.failed.popitem(last=False)
        self.metrics.items.labels(p.modality, "failed").inc()
        for fut in self.inflight.fail(p.key, failure):
            if isinstance(fut, asyncio.Future) and not fut.done():
                fut.set_exception(failure)

    def _shm_put(self, done: list[tuple[bytes, Embedding]]) -> None:
        for key, emb in done:
            try:
                assert self.shm is not None and self.shm.put(key, emb), "larger than the whole tier"
            except (AssertionError, ValueError, OSError) as e:
                log.warning("item %s not put in the shared cache: %s", key.hex(), e)

    # -- state ------------------------------------------------------------------------------------
    def idle(self) -> bool:
        """Nothing queued, encoding or waited for."""
        return not len(self.batcher) and not self.running and not len(self.inflight)

    def load(self) -> pb.EncoderLoad:
        m = self.memory
        return pb.EncoderLoad(
            queued_items=len(self.batcher),
            running_items=self.running,
            cache_bytes=m.bytes,
            cache_capacity_bytes=m.capacity,
            cache_entries=len(m),
            model_fingerprint=self.fingerprint,
            draining=self.draining,
            boot_id=self.boot_id,
        )

    async def drain(self, grace_s: float) -> bool:
        """Refuse submits; wait up to ``grace_s`` for the queue to be encoded. Returns whether it was."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while not self.idle() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return self.idle()

    async def close(self) -> None:
        """Stop the loop (a forward under way finishes on its thread) and fail what waits."""
        self.draining = True
        pending = list(self._current)  # before the cancel clears it
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while (batch := self.batcher.next_batch(math.inf)) is not None:
            pending.extend(batch)
        gone = RpcFailure(grpc.StatusCode.UNAVAILABLE, "the encoder stopped")
        for p in pending:
            if p.key in self.inflight:
                for fut in self.inflight.fail(p.key, gone):
                    if isinstance(fut, asyncio.Future) and not fut.done():
                        fut.set_exception(gone)
        self._pool.shutdown(wait=False, cancel_futures=True)


class EncoderServicer(egrpc.EncoderServicer):
    """``Encoder`` over a scheduler; Fetch messages stay under ``chunk_bytes``."""

    def __init__(self, scheduler: EncodeScheduler, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.scheduler, self.chunk_bytes = scheduler, chunk_bytes
        self.open_fetches = 0

    async def _abort(self, context: grpc.aio.ServicerContext, e: RpcFailure) -> NoReturn:
        await context.abort(e.code, e.message)
        raise AssertionError("unreachable: abort raises")

    async def Submit(self, request: pb.SubmitRequest, context: grpc.aio.ServicerContext) -> pb.SubmitReply:
        try:
            return pb.SubmitReply(accepted=self.scheduler.submit(request.items, request.model_fingerprint))
        except RpcFailure as e:
            await self._abort(context, e)

    async def Fetch(
        self, request: pb.FetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EmbeddingChunk]:
        metrics = self.scheduler.metrics
        self.open_fetches += 1
        try:
            try:
                emb = await self.scheduler.fetch(bytes(request.key), request.timeout_s)
            except RpcFailure as e:
                metrics.fetches.labels(FETCH_OUTCOME.get(e.code, "failed")).inc()
                await self._abort(context, e)
            metrics.fetches.labels("served").inc()
            for chunk in chunks(emb.data, self.chunk_bytes):
                yield chunk
                metrics.fetch_bytes.inc(len(chunk.data))
        finally:
            self.open_fetches -= 1

    async def GetLoad(
        self, request: pb.EncoderLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.EncoderLoad:
        return self.scheduler.load()
