"""The inline engine client: ``LLMEngine`` stepped by one task on the caller's event loop, each
step's forward on one step thread, so HTTP, gRPC (``GetLoad``, ``Abort``, cancellations) and
probes are answered while it runs.

Adds and aborts are queued and applied between steps; the loop yields 1 ms to handlers after each
step. An engine failure ends every open stream with an error and the loop keeps serving; a step
that runs past ``engine_step_timeout`` marks the engine dead (``EngineDead``, ``on_dead``).
Design notes: docs/DESIGN.md#engineasync_enginepy
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from swaserve.config import EngineConfig
from swaserve.engine.client import EngineDead, LocalEngineClient, queue_stream
from swaserve.engine.llm_engine import LLMEngine
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.kvcache.block_events import BlockEvent
from swaserve.media.placeholders import MediaInputs
from swaserve.transfer.kv_transfer import KVPayload

log = logging.getLogger(__name__)
_YIELD_S = 0.001  # event-loop time given to request handlers after each step
T = TypeVar("T")


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.cancelled():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class StepThread:
    """One daemon thread that runs the engine's steps, one at a time, in order. Daemon: a hung
    step must not keep the process from exiting (``concurrent.futures`` threads are joined at
    exit). It sets torch's thread count of the loop thread (``num_threads``) for its own ops."""

    def __init__(self, num_threads: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=self._run, args=(num_threads,), name="swaserve-engine-step", daemon=True
        )
        self._thread.start()

    def _run(self, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            result, error = None, None
            try:
                result = fn()
            except BaseException as e:  # delivered to the awaiting loop
                error = e
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                fut.get_loop().call_soon_threadsafe(_settle, fut, result, error)

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the step thread (after the jobs before it)."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._jobs.put((fn, fut))
        return await fut

    def close(self) -> None:
        """The thread ends after its current job (if that ever returns)."""
        self._jobs.put(None)


class AsyncLLMEngine(LocalEngineClient):
    """Serves many concurrent ``generate`` streams from one engine loop (``EngineClient``).
    ``on_dead``: called once with a message if a step hangs (runs past ``engine_step_timeout``)."""

    def __init__(
        self, engine: LLMEngine, model_name: str, on_dead: Callable[[str], None] | None = None
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.on_dead = on_dead
        self.tokenizer = engine.tokenizer
        self.model_config = engine.model_config
        self.media_config = engine.media_config
        self.model_dir = engine.model_dir
        self.engine_config = engine.config
        self.kv_dtype = engine.core.dtype
        self.max_model_len = engine.max_model_len
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._pending: list[tuple[str, Any]] = []
        self._wake: asyncio.Event | None = None
        self._core: asyncio.Lock | None = None  # held while the core is in use off the loop thread
        self._stepper: StepThread | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False
        self._step_since: float | None = None  # when the step in progress began (monotonic)
        self._snapshot = EngineStats(num_running=0, num_waiting=0)  # stats as that step began
        self._dead: EngineDead | None = None

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        engine_config: EngineConfig | None = None,
        model_name: str | None = None,
        on_dead: Callable[[str], None] | None = None,
    ) -> AsyncLLMEngine:
        engine = LLMEngine(model_dir, engine_config)
        return cls(engine, model_name or Path(model_dir).name, on_dead)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done() and self._dead is None

    def unavailable(self) -> EngineDead | None:
        return self._dead

    async def start(self) -> None:
        if self.running or self._dead is not None:
            return
        self._wake = asyncio.Event()
        self._core = asyncio.Lock()
        self._stopping = False
        self._stepper = StepThread(torch.get_num_threads())
        self._task = asyncio.create_task(self._loop(), name="swaserve-engine-loop")
        self._watch = asyncio.create_task(self._watchdog(), name="swaserve-engine-watchdog")

    async def stop(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None
        if self._task is not None:
            if self._dead is not None:  # its step never returns: leave it to its thread
                self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._stepper is not None:
            self._stepper.close()
            self._stepper = None

    def stats(self) -> EngineStats:
        """The live stats between steps; during a step (or after one hung), those of its start
        (never waits for the step)."""
        if self._step_since is not None or self._dead is not None:
            return self._snapshot
        return self.engine.stats()

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

    async def _between_steps(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop thread while no step runs (the core is not thread-safe)."""
        if self._dead is not None:
            raise self._dead
        if self._core is None:  # not started: nothing steps
            return fn()
        async with self._core:
            return fn()

    async def flush_cache(self) -> None:
        await self._between_steps(self.engine.kv.flush_cache)

    async def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        if self._dead is not None:  # the worker goes down: nothing more to publish
            return []
        return await self._between_steps(lambda: self.engine.drain_cache_events(resync))

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv: bool = False,
        prefilled: tuple[int, KVPayload] | None = None,
        media: MediaInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """``EngineClient.generate``."""
        if not self.running:
            raise self._dead or RuntimeError("engine loop is not running (call start())")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.engine.validate(prompt_token_ids, params, media)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        extra = {"export_kv": export_kv, "prefilled": prefilled, "media": media}
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

    async def supply_media(self, request_id: str, index: int, embeds: torch.Tensor) -> None:
        """``LocalEngineClient.supply_media``: applied between steps."""
        self._submit("media", (request_id, index, embeds))

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
                        self.engine.add_prefilled(
                            rid, prompt, first, params, payload, arrival, extra["media"]
                        )
                    else:
                        self.engine.add_request(
                            rid, prompt, params, arrival, extra["export_kv"], extra["media"]
                        )
                except ValueError as e:
                    self._queues[rid].put_nowait(e)
            elif op == "media":
                rid, index, embeds = arg
                try:
                    self.engine.core.supply_media(rid, index, embeds)
                except ValueError as e:  # the request fails alone
                    out = self.engine.abort_request(rid)
                    q = self._queues.get(rid)
                    if q is not None:
                        q.put_nowait(e)
            else:
                out = self.engine.abort_request(arg)
                q = self._queues.get(arg)
                if out is not None and q is not None:
                    q.put_nowait(out)

    async def _step(self) -> list[RequestOutput] | None:
        """Apply what is pending, then one step on the step thread (None: no work)."""
        assert self._core is not None and self._stepper is not None
        async with self._core:
            self._apply_pending()
            if not self.engine.has_unfinished():
                return None
            self._snapshot = self.engine.stats()
            self._step_since = time.monotonic()
            try:
                return await self._stepper.run(self.engine.step)
            finally:
                self._step_since = None

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                outputs = await self._step()
                if outputs is None:
                    self._wake.clear()
                    if not self._pending and not self._stopping:
                        await self._wake.wait()
                    continue
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

    async def _watchdog(self) -> None:
        """Mark the engine dead when one step runs past ``engine_step_timeout`` seconds."""
        timeout = self.engine_config.engine_step_timeout
        if timeout <= 0:
            return
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            since = self._step_since
            if since is not None and time.monotonic() - since > timeout:
                self._hung(time.monotonic() - since, timeout)
                return

    def _hung(self, ran_s: float, timeout: float) -> None:
        """The step in progress hangs: the engine is not used again (its thread owns the core)."""
        self._dead = EngineDead(
            f"an engine step has run for {ran_s:.0f} s with {len(self._queues)} requests open "
            f"(engine_step_timeout {timeout:g} s): the engine is hung"
        )
        log.error("%s", self._dead)
        for q in self._queues.values():
            q.put_nowait(self._dead)
        if self.on_dead is not None:
            self.on_dead(str(self._dead))

    def _fail_all(self, message: str) -> None:
        """Abort every engine request and end every open stream with an error (never a hang)."""
        for rid in self.engine.core.abort_all():
            self.engine.processor.remove(rid)
        for q in self._queues.values():
            q.put_nowait(RuntimeError(message))
