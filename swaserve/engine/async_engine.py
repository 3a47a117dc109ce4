"""The inline engine client: ``LLMEngine`` stepped by one task on the caller's event loop.

Adds and aborts from request handlers are queued and applied between steps; the loop yields
1 ms to handlers after each step. A step blocks the loop while it runs (HTTP, gRPC and probes
wait behind it): ``engine.mp_client`` runs the core in its own process instead. An engine
failure ends every open stream with an error and the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from swaserve.config import EngineConfig
from swaserve.engine.client import LocalEngineClient, queue_stream
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.kvcache.block_events import BlockEvent
from swaserve.transfer.kv_transfer import KVPayload

log = logging.getLogger(__name__)
_YIELD_S = 0.001  # event-loop time given to request handlers after each step


class AsyncLLMEngine(LocalEngineClient):
    """Serves many concurrent ``generate`` streams from one engine loop (``EngineClient``)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.engine_config = engine.config
        self.kv_dtype = engine.core.dtype
        self.max_model_len = engine.max_model_len
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list[tuple[str, Any]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, engine_config: EngineConfig | None = None, model_name: str | None = None
    ) -> AsyncLLMEngine:
        engine = LLMEngine(model_dir, engine_config)
        return cls(engine, model_name or Path(model_dir).name)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if self.running:
            return
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name="swaserve-engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    async def flush_cache(self) -> None:
        self.engine.kv.flush_cache()  # on the loop thread: never during a step

    async def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        return self.engine.drain_cache_events(resync)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv: bool = False,
        prefilled: tuple[int, KVPayload] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``EngineClient.generate``."""
        if not self.running:
            raise RuntimeError("engine loop is not running (call start())")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.validate(prompt_token_ids, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        extra = {"export_kv": export_kv, "prefilled": prefilled}
        self._submit("add", (request_id, list(prompt_token_ids), params, self.engine.core.clock(), extra))
        async with contextlib.aclosing(
            queue_stream(queue, lambda ended: self._closed(request_id, ended))
        ) as s:
            async for out in s:
                yield out

    def _closed(self, request_id: str, ended: bool) -> None:
        self._queues.pop(request_id, None)
        if not ended:
            self._submit("abort", request_id)

    async def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def _submit(self, op: str, arg: Any) -> None:
        self._pending.append((op, arg))
        if self._wake is not None:
            self._wake.set()

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for op, arg in pending:
            if op == "add":
                rid, prompt, params, arrival, extra = arg
                if rid not in self._queues:  # consumer already gone
                    continue
                try:
                    if extra["prefilled"] is not None:
                        first, payload = extra["prefilled"]
                        self.engine.add_prefilled(rid, prompt, first, params, payload, arrival_time=arrival)
                    else:
                        self.engine.add_request(
                            rid, prompt, params, arrival_time=arrival, export_kv=extra["export_kv"]
                        )
                except ValueError as e:
                    self._queues[rid].put_nowait(e)
            else:
                out = self.engine.abort_request(arg)
                q = self._queues.get(arg)
                if out is not None and q is not None:
                    q.put_nowait(out)

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    self._wake.clear()
                    if not self._pending and not self._stopping:
                        await self._wake.wait()
                    continue
                outputs = self.engine.step()
            except Exception as e:  # an engine bug: fail the requests in flight, keep serving
                log.exception("engine loop failed")
                self._fail_all(f"engine failed: {e}")
                continue
            for o in outputs:
                q = self._queues.get(o.request_id)
                if q is not None:
                    q.put_nowait(o)
                elif not o.finished:
                    self._pending.append(("abort", o.request_id))
            await asyncio.sleep(_YIELD_S)  # let handlers run: a timer, so chains of callbacks finish
        self._fail_all("engine stopped")

    def _fail_all(self, message: str) -> None:
        """Abort every engine request and end every open stream with an error (never a hang)."""
        for rid in self.engine.core.abort_all():
            self.engine.processor.remove(rid)
        for q in self._queues.values():
            q.put_nowait(RuntimeError(message))
