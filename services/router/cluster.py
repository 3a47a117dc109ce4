"""The router's engine backend: the OpenAI server (``swaserve.api.server``) over prefill and decode
workers instead of a local engine.

``ClusterEngine`` has the interface ``build_app`` expects of ``AsyncLLMEngine`` (``generate``
yielding ``RequestOutput`` deltas, ``tokenizer``, ``model_config``, ``max_model_len``, ``stats``,
``start``/``stop``), so endpoints, validation and errors are the same as ``swaserve serve``.

One request: pick a prefill and a decode worker (least outstanding tokens dispatched by this
router, healthy ones only), ``Generate`` on the prefill worker with ``kv_target`` = the decode
worker (it streams the first token, pushes the KV, completes with ``handoff``), then ``Generate``
on the decode worker with ``first_token`` and relay its stream. A failure before the decode worker
produced anything (prefill worker down, KV transfer refused, decode worker down at the call) is
retried on other workers: the prefill runs again (a prefix-cache hit) and its first token must equal
the one already sent, else the client gets an error event. A failure after that ends the stream with
an error event. Closing the stream (client gone) cancels the calls and aborts on both workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from swaserve.config import ModelConfig
from swaserve.disagg.convert import finish_reason, output_from_chunk, params_to_proto
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.router")
_RETRYABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class DispatchError(RuntimeError):
    """A worker failed a request; ``worker`` is the one to avoid on a retry."""

    def __init__(self, message: str, worker: WorkerHandle | None) -> None:
        super().__init__(message)
        self.worker = worker


@dataclass(eq=False)
class WorkerHandle:
    """A worker as the router sees it."""

    address: str
    role: str
    stub: wgrpc.WorkerStub
    channel: grpc.aio.Channel
    outstanding: int = 0  # tokens of requests this router dispatched and that are not done
    healthy: bool = True
    load: pb.Load | None = field(default=None, repr=False)


class ClusterEngine:
    """Args:
    model_dir: checkpoint dir (tokenizer, config: the workers must serve the same one).
    prefill, decode: worker addresses ``host:port``.
    model_name: served model name. request_timeout_s: per-request deadline (seconds).
    max_retries: re-dispatches of a request that failed before its decode output started.
    poll_s: seconds between ``GetLoad`` polls (worker health and load).
    """

    def __init__(
        self,
        model_dir: str | Path,
        prefill: list[str],
        decode: list[str],
        model_name: str | None = None,
        request_timeout_s: float = 600.0,
        max_retries: int = 2,
        poll_s: float = 1.0,
    ) -> None:
        from transformers import AutoTokenizer

        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode worker")
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.max_model_len = self.model_config.max_position_embeddings
        self.addresses = {"prefill": list(prefill), "decode": list(decode)}
        self.request_timeout_s, self.max_retries, self.poll_s = request_timeout_s, max_retries, poll_s
        self.workers: list[WorkerHandle] = []
        self.in_flight = 0
        self._poller: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Started, and some prefill and some decode worker look reachable (else the API answers
        503 on /health and on requests)."""
        return all(any(w.role == r and w.healthy for w in self.workers) for r in ("prefill", "decode"))

    async def start(self) -> None:
        if self.workers:
            return
        for role, addrs in self.addresses.items():
            for a in addrs:
                ch = grpc.aio.insecure_channel(a)
                self.workers.append(WorkerHandle(a, role, wgrpc.WorkerStub(ch), ch))
        self._poller = asyncio.create_task(self._poll(), name="router-load-poll")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for w in self.workers:
            await w.channel.close()
        self.workers = []

    async def _poll(self) -> None:
        while True:
            await asyncio.gather(*(self._poll_one(w) for w in self.workers))
            await asyncio.sleep(self.poll_s)

    async def _poll_one(self, w: WorkerHandle) -> None:
        try:  # a busy worker answers between engine steps: only a refused connection counts
            w.load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=30.0)
            if not w.healthy:
                log.info("%s worker %s is back", w.role, w.address)
            w.healthy = True
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                if w.healthy:
                    log.warning("%s worker %s unreachable", w.role, w.address)
                w.healthy = False

    def stats(self) -> EngineStats:
        return EngineStats(num_running=self.in_flight, num_waiting=0)

    async def loads(self) -> dict[str, pb.Load]:
        """Every worker's current ``GetLoad`` (address -> load); unreachable ones are left out."""
        out = {}
        for w in self.workers:
            with contextlib.suppress(grpc.aio.AioRpcError):
                out[w.address] = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=5.0)
        return out

    # -- selection ----------------------------------------------------------------------------
    def pick(self, role: str, avoid: set[WorkerHandle]) -> WorkerHandle:
        """The healthy worker of ``role`` with the least outstanding work (not in ``avoid`` if
        another is left; a worker that failed this request or looks unreachable is still tried
        when it is the only one)."""
        mine = [w for w in self.workers if w.role == role]
        pool = [w for w in mine if w.healthy and w not in avoid] or [w for w in mine if w.healthy] or mine
        if not pool:
            raise DispatchError(f"no {role} worker configured", None)
        return min(pool, key=lambda w: (w.outstanding, w.address))

    # -- one request --------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request through a prefill and a decode worker (module doc).

        Raises:
            ValueError: the workers refused the request (bad input), before any output.
            RuntimeError: it failed and could not be retried.
        """
        params.validate()
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {self.max_model_len}"
            )
        avoid: set[WorkerHandle] = set()
        touched: set[WorkerHandle] = set()  # workers some attempt sent this request (or its KV) to
        first: int | None = None  # the first token, once sent to the client
        attempt = 0
        finished = False
        self.in_flight += 1
        try:
            while True:
                attempt += 1
                p = self.pick("prefill", avoid)
                d = self.pick("decode", avoid)
                started = [False]  # decode output reached the client
                touched |= {p, d}
                try:
                    async for out in self._dispatch(
                        p, d, prompt_token_ids, params, request_id, first, started
                    ):
                        if first is None and out.new_token_ids:
                            first = out.new_token_ids[0]
                        finished = out.finished
                        yield out
                    return
                except DispatchError as e:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise asyncio.CancelledError from e  # the client went away: no retry
                    if started[0] or attempt > self.max_retries:
                        raise RuntimeError(f"request failed: {e}") from e
                    log.warning("retrying %s (attempt %d): %s", request_id, attempt + 1, e)
                    if e.worker is not None:
                        avoid.add(e.worker)
        finally:
            self.in_flight -= 1
            if not finished:  # client gone or failed: drop it everywhere, staged KV included
                for w in touched:
                    asyncio.get_running_loop().create_task(self._abort(w, request_id))

    async def _dispatch(
        self,
        p: WorkerHandle,
        d: WorkerHandle,
        prompt: list[int],
        params: SamplingParams,
        rid: str,
        first_sent: int | None,
        started: list[bool],
    ) -> AsyncIterator[RequestOutput]:
        sampling = params_to_proto(params)
        timeout = self.request_timeout_s
        n = len(prompt)
        p.outstanding += n
        d.outstanding += params.max_tokens
        active: list[tuple[WorkerHandle, grpc.aio.UnaryStreamCall]] = []
        done = False
        try:
            call = p.stub.Generate(
                pb.GenerateRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling, kv_target=d.address
                ),
                timeout=timeout,
            )
            active.append((p, call))
            first, reason, usage = None, "", pb.Usage()
            async for m in self._messages(call, p, d):
                kind = m.WhichOneof("kind")
                if kind == "chunk":
                    out = output_from_chunk(rid, m)
                    first = out.new_token_ids[0] if out.new_token_ids else first
                    if first_sent is None:
                        yield out
                    elif first != first_sent:
                        raise RuntimeError("a retried prefill sampled another first token")
                elif kind == "complete":
                    reason, usage = m.complete.finish_reason, m.usage
            p.outstanding -= n
            n = 0
            if reason != FinishReason.HANDOFF.value:
                done = True
                yield RequestOutput(
                    rid, finished=True, finish_reason=finish_reason(reason), prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens,
                )  # fmt: skip
                return
            if first is None:
                raise DispatchError(f"prefill worker {p.address} handed off without a first token", p)
            cached = usage.cached_tokens
            call = d.stub.Generate(
                pb.GenerateRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling, first_token=first
                ),
                timeout=timeout,
            )
            active.append((d, call))
            async for m in self._messages(call, d, d):
                kind = m.WhichOneof("kind")
                if kind == "chunk":
                    out = output_from_chunk(rid, m)
                    out.cached_tokens = cached
                    started[0] = True
                    yield out
                elif kind == "complete":
                    done = True
                    yield RequestOutput(
                        rid, finished=True, finish_reason=finish_reason(m.complete.finish_reason),
                        prompt_tokens=m.usage.prompt_tokens, completion_tokens=m.usage.completion_tokens,
                        cached_tokens=cached,
                    )  # fmt: skip
                    return
            raise DispatchError(f"decode worker {d.address} ended the stream without completing", d)
        finally:
            p.outstanding -= n
            d.outstanding -= params.max_tokens
            if not done:
                for _, c in active:
                    c.cancel()  # the worker's stream ends: its engine aborts the request

    async def _messages(
        self, call: grpc.aio.UnaryStreamCall, worker: WorkerHandle, decode: WorkerHandle
    ) -> AsyncIterator[pb.GenerateResponse]:
        """A worker's stream; gRPC failures and error envelopes become DispatchError (ValueError
        for a request the worker refused as invalid)."""
        try:
            async for m in call:
                if m.WhichOneof("kind") == "error":
                    msg = m.error.message
                    if not m.error.retryable:
                        raise ValueError(msg)  # the worker refused the request itself
                    if msg.startswith("KV transfer"):
                        raise DispatchError(msg, decode)
                    raise DispatchError(f"{worker.role} worker {worker.address}: {msg}", worker)
                yield m
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                worker.healthy = False
            raise DispatchError(
                f"{worker.role} worker {worker.address}: {e.code().name} {e.details()}", worker
            ) from e

    async def _abort(self, w: WorkerHandle, rid: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await w.stub.Abort(pb.AbortRequest(request_id=rid), timeout=5.0)

    async def abort(self, request_id: str) -> None:
        for w in self.workers:
            await self._abort(w, request_id)
