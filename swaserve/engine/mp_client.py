"""The engine client with the engine core in its own process (``--engine-process separate``).

The front (this process) keeps HTTP/gRPC, validation, detokenization, stop strings and
streaming; the core (``engine.core_proc``, a child process) schedules, runs the model and
samples in a busy loop, so a long step never holds up a probe or another stream here. IPC: ZMQ
PUSH/PULL over Unix sockets, msgspec messages (``engine.ipc``). If the core dies, every open
stream ends with ``EngineDead`` (503 / error event), ``running`` turns False and ``on_dead`` is
called (the serve and worker shells exit non-zero, for their supervisor to restart them). A core
that holds work but sends nothing for ``engine_step_timeout`` seconds (a hung step: deadlock,
stuck kernel, SIGSTOP) is killed and handled as dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch
import zmq
import zmq.asyncio

from swaserve.config import EngineConfig, ModelConfig
from swaserve.engine.client import EngineDead, LocalEngineClient, queue_stream
from swaserve.engine.core_proc import CoreSpec
from swaserve.engine.ipc import (
    MAX_MESSAGE_BYTES,
    Abort,
    AddRequest,
    Call,
    Decoder,
    FromCore,
    MessageError,
    Outputs,
    Ready,
    Reply,
    StartupFailed,
    SupplyMedia,
    ToCore,
    Wake,
    encode,
)
from swaserve.engine.llm_engine import eos_token_ids
from swaserve.engine.output import OutputProcessor
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import EngineLimits, RequestOutput, SamplingParams
from swaserve.hf_tokenizer import load_tokenizer
from swaserve.kvcache.block_events import BlockEvent
from swaserve.media.placeholders import MediaInputs
from swaserve.model.multimodal import MultimodalConfig
from swaserve.transfer.kv_transfer import KVPayload

log = logging.getLogger(__name__)
_STOP_GRACE_S = 10.0  # seconds the core gets to exit after a shutdown call
_DIR_PREFIX = "swaserve-engine-"  # + the front's pid: the socket dir, gone once the core is ready


def _sweep_stale_dirs() -> None:
    """Remove socket dirs left by fronts that died before their core was ready (ours only)."""
    for d in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*-*"):
        try:
            pid = int(d.name[len(_DIR_PREFIX) :].split("-", 1)[0])
            if d.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, OSError):  # not ours, or its front lives
            continue


class MPEngineClient(LocalEngineClient):
    """Args:
    model_dir: checkpoint directory (the front loads only its tokenizer and config).
    engine_config: the core's knobs.
    model_name: served model name (default: the directory's name).
    on_dead: called once with a message if the core process dies while serving.
    num_threads: torch threads of the core process (default: torch's).
    max_message_bytes: inbound IPC messages above this are refused (both sides).
    ep_rank, ep_init: with ``engine_config.ep_size`` > 1, the core's rank and the group's
        rendezvous (``engine.ep_client.EPEngineClient`` starts one client per rank).
    """

    def __init__(
        self,
        model_dir: str | Path,
        engine_config: EngineConfig | None = None,
        model_name: str | None = None,
        on_dead: Callable[[str], None] | None = None,
        num_threads: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        ep_rank: int = 0,
        ep_init: str = "",
    ) -> None:
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.engine_config = engine_config or EngineConfig()
        self.tokenizer = load_tokenizer(model_dir)
        self.model_config = ModelConfig.from_pretrained(model_dir)
        self.media_config = MultimodalConfig.from_pretrained(model_dir)
        self.max_model_len = min(
            self.engine_config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )  # until the core says what its KV cache holds
        self.kv_dtype = getattr(torch, self.engine_config.dtype)
        self.on_dead, self.num_threads, self.max_message_bytes = on_dead, num_threads, max_message_bytes
        self.ep_rank, self.ep_init = ep_rank, ep_init
        self.launch: Callable[[CoreSpec], Awaitable[Any]] | None = None
        """Starts the core instead of a child process: returns a handle with ``pid``,
        ``returncode``, ``wait()`` and ``kill()`` (``engine.ray_ranks.RayCore``)."""
        self.processor = OutputProcessor(self.tokenizer)
        self.limits: EngineLimits | None = None
        self.pid: int | None = None  # the core process
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._calls: dict[int, tuple[str, asyncio.Future[Reply]]] = {}
        self._call_ids = itertools.count(1)
        self._events: list[BlockEvent] = []
        self._stats = EngineStats(num_running=0, num_waiting=0)
        self._decoder = Decoder(FromCore, max_message_bytes)
        self._dead: EngineDead | None = None
        self._stopping = False
        self._proc: Any = None  # asyncio.subprocess.Process, or what ``launch`` returned
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._to_core: Any = None
        self._from_core: Any = None
        self._dir: str | None = None
        self._in_core: set[str] = set()  # requests the core has not finished (the watchdog's work)
        self._heard = time.monotonic()  # last message from the core, or when work arrived at an idle one
        self._hung: str | None = None

    # -- life -----------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.limits is not None and self._dead is None and not self._stopping

    def unavailable(self) -> EngineDead | None:
        return self._dead

    async def start(self) -> None:
        """Start the core process and wait until it has loaded the model.

        Raises:
            RuntimeError: the core failed to start (its message) or exited before it was ready.
        """
        if self.running:
            return
        self._stopping, self._dead, self._hung = False, None, None
        self._in_core.clear()
        _sweep_stale_dirs()
        self._dir = tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # sends never block the loop
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._to_core.bind(in_addr)
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._from_core.bind(out_addr)
        spec = CoreSpec(
            str(self.model_dir), self.engine_config, sorted(eos_token_ids(self.tokenizer)), in_addr, out_addr,
            os.getpid(), self.max_message_bytes, self.num_threads, self.ep_rank, self.ep_init,
        )  # fmt: skip
        if self.launch is not None:  # e.g. a Ray actor (engine.ray_ranks): no parent to watch
            spec.parent_pid = 0
            self._proc = await self.launch(spec)
        else:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "swaserve.engine.core_proc", msgspec.json.encode(spec).decode()
            )
        log.info("engine core process %d starting", self._proc.pid)
        try:
            ready = await self._wait_ready()
        except BaseException:
            await self._close()
            raise
        self.limits, self.max_model_len, self.pid = ready.limits, ready.limits.max_model_len, ready.pid
        self.kv_dtype = getattr(torch, ready.kv_dtype)
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="swaserve-engine-outputs"),
            asyncio.create_task(self._watch(), name="swaserve-engine-watch"),
            asyncio.create_task(self._watchdog(), name="swaserve-engine-watchdog"),
        ]
        try:  # one round trip: both connections are up, so the socket files can go now (a killed
            await asyncio.wait_for(self._call("ping"), _STOP_GRACE_S)  # front leaves none behind)
        except BaseException:
            await self._close()
            raise
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir = None
        log.info("engine core process %d ready", self.pid)

    async def _wait_ready(self) -> Ready:
        assert self._proc is not None
        recv = asyncio.ensure_future(self._from_core.recv_multipart(copy=False))
        exited = asyncio.ensure_future(self._proc.wait())
        try:
            await asyncio.wait((recv, exited), return_when=asyncio.FIRST_COMPLETED)
            if not recv.done():
                raise RuntimeError(f"engine core exited with code {exited.result()} before it was ready")
            msg = self._decoder.decode(recv.result())
        finally:
            for f in (recv, exited):
                f.cancel()
        if isinstance(msg, StartupFailed):
            raise RuntimeError(f"engine core failed to start: {msg.message}")
        if not isinstance(msg, Ready):
            raise RuntimeError(f"engine core sent {type(msg).__name__} before it was ready")
        return msg

    async def stop(self) -> None:
        """Ask the core to exit (killed after a grace period); open streams end with an error."""
        if self._proc is None:
            return
        self._stopping = True
        if self._proc.returncode is None:
            self._send(Call(0, "shutdown"))
            try:
                await asyncio.wait_for(self._proc.wait(), _STOP_GRACE_S)
            except TimeoutError:
                log.warning("engine core did not exit in %.0f s: killed", _STOP_GRACE_S)
                self._proc.kill()
                await self._proc.wait()
        await self._close()
        self._fail_all(RuntimeError("engine stopped"))

    async def _close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()
        for s in (self._to_core, self._from_core):
            if s is not None:
                s.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._to_core = self._from_core = self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.limits = None

    async def _watch(self) -> None:
        assert self._proc is not None
        code = await self._proc.wait()
        if self._stopping:
            return
        self._dead = EngineDead(self._hung or f"the engine core process exited with code {code}")
        log.error("%s: failing %d open requests", self._dead, len(self._queues))
        self._fail_all(self._dead)
        if self.on_dead is not None:
            self.on_dead(str(self._dead))

    async def _watchdog(self) -> None:
        """Kill a core that has work but has sent nothing for ``engine_step_timeout`` seconds."""
        timeout = self.engine_config.engine_step_timeout
        if timeout <= 0:
            return
        while self._proc is not None and self._proc.returncode is None:
            await asyncio.sleep(min(1.0, timeout / 4))
            silent = time.monotonic() - self._heard
            if (self._in_core or self._calls) and silent > timeout and self._proc.returncode is None:
                self._hung = (
                    f"the engine core sent nothing for {silent:.0f} s with {len(self._in_core)} "
                    f"requests in it (engine_step_timeout {timeout:g} s): killed as hung"
                )
                log.error("%s", self._hung)
                self._proc.kill()
                return

    def _fail_all(self, error: BaseException) -> None:
        for rid, q in list(self._queues.items()):
            self.processor.remove(rid)
            q.put_nowait(error)
        for _, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(error)
        self._calls.clear()

    # -- requests -------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.processor.with_counters(self._stats)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._queues

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
        if not self.running or self.limits is None:
            raise self._dead or RuntimeError("engine core is not running (call start())")
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.limits.check(prompt_token_ids, params, media)
        if media is not None:
            media.check_embeds(self.model_config.hidden_size)
        first, payload = prefilled if prefilled is not None else (None, None)
        if prefilled is not None:
            self.limits.check_prefilled(request_id, prompt_token_ids, prefilled[0], prefilled[1])
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.processor.add(request_id, list(prompt_token_ids), params, first)
        arrival = time.monotonic()  # CLOCK_MONOTONIC: the core's clock too
        self._expect(arrival)
        self._in_core.add(request_id)
        msg = AddRequest(request_id, list(prompt_token_ids), params, arrival, export_kv, first, payload)
        if media is not None and media.spans:
            msg.media_spans = list(media.spans)
            msg.media_embeds = {i: e.contiguous() for i, e in media.embeds.items()}
        self._send(msg)
        async with contextlib.aclosing(
            queue_stream(queue, lambda ended: self._closed(request_id, ended))
        ) as s:
            async for out in s:
                yield out

    async def supply_media(self, request_id: str, index: int, embeds: torch.Tensor) -> None:
        """``LocalEngineClient.supply_media``: sent to the core (a bad shape: the core refuses it)."""
        if request_id in self._in_core:
            self._send(SupplyMedia(request_id, index, embeds.contiguous()))

    def _closed(self, request_id: str, ended: bool) -> None:
        self._queues.pop(request_id, None)
        self.processor.remove(request_id)
        if not ended:
            self._in_core.discard(request_id)
            self._send(Abort([request_id]))

    async def abort(self, request_id: str) -> None:
        self._in_core.discard(request_id)
        self._send(Abort([request_id]))

    async def flush_cache(self) -> None:
        await self._call("flush_cache")

    async def drain_cache_events(self, resync: bool = False) -> list[BlockEvent]:
        if resync:
            return (await self._call("snapshot_events")).events
        events, self._events = self._events, []
        return events

    async def _call(self, method: Literal["flush_cache", "snapshot_events", "ping"]) -> Reply:
        if not self.running:
            raise self._dead or RuntimeError("engine core is not running")
        call_id = next(self._call_ids)
        self._expect(time.monotonic())
        fut: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (method, fut)
        self._send(Call(call_id, method))
        reply = await fut
        if reply.error:
            raise RuntimeError(reply.error)
        return reply

    def _expect(self, now: float) -> None:
        """Work goes to the core: an idle core's silence so far does not count as a hung step."""
        if not self._in_core and not self._calls:
            self._heard = now

    def _send(self, msg: ToCore) -> None:
        """Queue ``msg`` for the core without blocking (dropped, with a log, if it cannot go)."""
        if self._to_core is None or self._dead is not None:
            return
        try:
            self._to_core.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            log.error("could not send %s to the engine core: %s", type(msg).__name__, e)

    def kill(self) -> None:
        """Kill the core process now (its watcher then fails the open requests and calls
        ``on_dead``): a peer rank of an expert-parallel instance died."""
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()

    def wake(self) -> None:
        """Expert parallelism: another rank got work; this core joins the group's steps now."""
        self._send(Wake())

    def send_raw(self, frames: list[bytes]) -> None:
        """Send ``frames`` as one message to the core as they are (tests of its refusals)."""
        self._to_core.send_multipart(frames, flags=zmq.NOBLOCK)

    # -- outputs --------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            frames = await self._from_core.recv_multipart(copy=False)
            self._heard = time.monotonic()
            try:
                msg = self._decoder.decode(frames)
            except MessageError as e:
                log.error("refused a message from the engine core: %s", e)
                continue
            try:
                if isinstance(msg, Outputs):
                    self._on_outputs(msg)
                elif isinstance(msg, Reply):
                    self._on_reply(msg)
            except Exception:  # a bug here must not stop the reader: log, go on
                log.exception("handling %s from the engine core failed", type(msg).__name__)

    def _on_reply(self, msg: Reply) -> None:
        method, fut = self._calls.pop(msg.call_id, ("", None))
        if method == "snapshot_events":  # it supersedes the events sent before it
            self._events.clear()
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _on_outputs(self, msg: Outputs) -> None:
        self._stats = msg.stats
        self._events.extend(msg.events)
        for r in msg.refused:
            self._in_core.discard(r.request_id)
            self.processor.remove(r.request_id)
            q = self._queues.get(r.request_id)
            if q is not None:
                q.put_nowait(ValueError(r.message))
        deltas, stopped = self.processor.process(msg.outputs)
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
        for o in msg.outputs:
            if o.finish_reason is not None:
                self._in_core.discard(o.request_id)
        if stopped:  # stop strings ended them here: the core stops computing them
            self._in_core.difference_update(stopped)
            self._send(Abort(stopped))
        for rid in msg.failed:
            self._in_core.discard(rid)
            self.processor.remove(rid)
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(RuntimeError(msg.failure or "engine failed"))
