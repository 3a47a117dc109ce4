"""The router's engine backend: the OpenAI server (``swaserve.api.server``) over prefill and decode
workers instead of a local engine.

``ClusterEngine`` has the interface ``build_app`` expects of ``AsyncLLMEngine`` (``generate``
yielding ``RequestOutput`` deltas, ``tokenizer``, ``model_config``, ``max_model_len``, ``stats``,
``start``/``stop``), so endpoints, validation and errors are the same as ``swaserve serve``.

One request: pick a prefill and a decode worker among the reachable ones (``routing.RouterRouting``:
length bucket, prefix-cache affinity and load, with leases counted at dispatch, shared between
router replicas through Redis), ``Generate`` on the prefill worker with ``kv_target`` = the decode
worker (it streams the first token, pushes the KV, completes with ``handoff``), then ``Generate``
on the decode worker with ``first_token`` and relay its stream. A failure before the decode worker
produced anything (prefill worker down, KV transfer refused, decode worker down at the call) is
retried on other workers: the prefill runs again (a prefix-cache hit) and its first token must equal
the one already sent, else the client gets an error event. A failure after that ends the stream with
an error event. Closing the stream (client gone) cancels the calls and aborts on both workers.

The workers mark the chunk of a request's last token with its finish reason; that chunk becomes the
final ``RequestOutput`` (tokens and finish reason together, as ``AsyncLLMEngine`` yields it), so
the API's responses and SSE chunks have the same shape as ``swaserve serve``'s.

When the retries run out on capacity or reachability (a decode worker's KV staging full:
``Overloaded``; no worker reachable: ``NoWorkerAvailable``) ``generate`` raises an ``Unavailable``
(HTTP 503, or an error event with its code in a started stream); other failures a RuntimeError.
``stats``/``router_stats`` feed ``/metrics``: token counters of the relayed requests, the workers'
``GetLoad`` (pools, running, waiting, outstanding tokens), requests by status and retries.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.router.routing import RouterRouting, RoutingOptions
from swaserve.api.server import Unavailable
from swaserve.config import ModelConfig
from swaserve.disagg.convert import finish_reason, output_from_chunk, params_to_proto
from swaserve.engine.stats import EngineStats, PoolStats
from swaserve.engine.types import FinishReason, RequestOutput, SamplingParams
from swaserve.kvcache.prefix_cache import CacheStats
from swaserve.metrics import RouterStats, WorkerStats
from swaserve.routing.dispatch import NoInstanceError
from swaserve.routing.load import Lease
from swaserve.v1 import worker_pb2 as pb
from swaserve.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger("swaserve.router")
POLL_TIMEOUT_S = 10.0  # GetLoad deadline: a CPU engine step can take seconds
HUNG_POLLS = 3  # deadlines in a row before a worker that accepts connections counts as down
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class Overloaded(Unavailable):
    """No decode worker had room for the request's KV (staging full) in any attempt."""

    code = "overloaded"


class NoWorkerAvailable(Unavailable):
    """No worker of a role could be reached for the request."""

    code = "no_worker_available"


class DispatchError(RuntimeError):
    """A worker failed a request; ``worker`` is the one to avoid on a retry; ``code`` the gRPC
    status of the failure (RESOURCE_EXHAUSTED: no room; UNAVAILABLE: not reachable)."""

    def __init__(
        self, message: str, worker: WorkerHandle | None, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    ) -> None:
        super().__init__(message)
        self.worker = worker
        self.code = code

    @property
    def reason(self) -> str:
        """The retry reason it counts under (``swaserve.metrics.RETRY_REASONS``)."""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return "overloaded"
        return "unavailable" if self.code == grpc.StatusCode.UNAVAILABLE else "error"

    def final(self) -> Exception:
        """What ``generate`` raises when this was the last attempt's failure."""
        if self.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return Overloaded(f"no decode worker has room for the request's KV now, retry later ({self})")
        if self.code == grpc.StatusCode.UNAVAILABLE:
            role = self.worker.role if self.worker is not None else "a"
            return NoWorkerAvailable(f"no {role} worker available, retry later ({self})")
        return RuntimeError(f"request failed: {self}")


@dataclass(eq=False)
class WorkerHandle:
    """A worker as the router sees it."""

    address: str
    role: str
    stub: wgrpc.WorkerStub
    channel: grpc.aio.Channel
    outstanding: int = 0  # tokens of requests this router dispatched and that are not done
    healthy: bool = True
    missed: int = 0  # GetLoad polls in a row that failed
    load: pb.Load | None = field(default=None, repr=False)

    def stats(self) -> WorkerStats:
        """The last ``GetLoad`` as ``/metrics`` shows it."""
        ld = self.load
        if ld is None:
            return WorkerStats(self.role, self.address, self.healthy)
        pools = {
            name: PoolStats(
                total_pages=p.total_pages,
                used_pages=p.used_pages,
                peak_used_pages=p.peak_used_pages,
                page_bytes=0,
                num_layers=0,
                cached_pages=p.cached_pages,
            )
            for name, p in ld.pools.items()
        }
        return WorkerStats(
            self.role, self.address, self.healthy, ld.running, ld.waiting, ld.outstanding_tokens,
            ld.staged_bytes, pools,
        )  # fmt: skip


class ClusterEngine:
    """Args:
    model_dir: checkpoint dir (tokenizer, config: the workers must serve the same one).
    prefill, decode: worker addresses ``host:port``.
    model_name: served model name. request_timeout_s: per-request deadline (seconds).
    max_retries: re-dispatches of a request that failed before its decode output started.
    poll_s: seconds between ``GetLoad`` polls (worker health and load).
    routing: worker selection and shared state (default: cache-aware, in this process).
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
        routing: RoutingOptions | None = None,
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
        self.routing = RouterRouting(routing or RoutingOptions())
        self.in_flight = 0
        self.index_entries = 0  # last poll's prefix index size (/metrics)
        self._poller: asyncio.Task[None] | None = None
        self._pollers: list[asyncio.Task[None]] = []
        # counters since start, for /metrics (stats, router_stats)
        self.prompt_tokens_total = 0  # prompts of requests that got their first token
        self.generation_tokens_total = 0  # tokens relayed to clients
        self.cached_tokens_total = 0  # of those prompts, tokens the prefill workers had cached
        self.requests_by_status: collections.Counter[str] = collections.Counter()
        self.retries: collections.Counter[str] = collections.Counter()

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
        self._pollers = [
            asyncio.create_task(self._poll_worker(w), name=f"poll-{w.address}") for w in self.workers
        ]

    async def stop(self) -> None:
        for t in [self._poller, *self._pollers]:
            if t is not None:
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        self._pollers = []
        for w in self.workers:
            await w.channel.close()
        self.workers = []

    async def _poll(self) -> None:
        renew_s = self.routing.opts.lease_ttl_s / 3
        last_renew = time.monotonic()
        while True:
            self.index_entries = await self._routing(self.routing.index_size)
            if time.monotonic() - last_renew >= renew_s:
                last_renew = time.monotonic()
                await self._routing(self.routing.renew)
            await asyncio.sleep(min(self.poll_s, renew_s))

    async def _poll_worker(self, w: WorkerHandle) -> None:
        """One worker's poll loop (a hung worker delays only its own polls)."""
        while True:
            await self._poll_one(w)
            await asyncio.sleep(self.poll_s)

    async def _poll_one(self, w: WorkerHandle) -> None:
        """A refused connection marks the worker down at once; a busy worker answers between
        engine steps, so only ``HUNG_POLLS`` polls in a row past ``POLL_TIMEOUT_S`` (a stopped or
        wedged process) do."""
        try:
            w.load = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=POLL_TIMEOUT_S)
            if not w.healthy:
                log.info("%s worker %s is back", w.role, w.address)
            w.healthy, w.missed = True, 0
        except grpc.aio.AioRpcError as e:
            w.missed += 1
            hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.missed >= HUNG_POLLS
            if e.code() == grpc.StatusCode.UNAVAILABLE or hung:
                if w.healthy:
                    what = "unreachable" if not hung else f"not answering for {w.missed} polls"
                    log.warning("%s worker %s %s", w.role, w.address, what)
                w.healthy = False
        await self._routing(self.routing.observe, w.address, w.role, w.load, w.healthy)

    async def _routing(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run a (blocking: Redis) routing call on the routing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.routing.executor, fn, *args)

    def stats(self) -> EngineStats:
        """Requests in flight through the router (``num_running``) and the token counters of the
        requests it relayed; the prefix-cache hits are the cached tokens the prefill workers
        reported (both tiers, counted as ``device``)."""
        return EngineStats(
            num_running=self.in_flight,
            num_waiting=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache=CacheStats(queries=self.prompt_tokens_total, hits_device=self.cached_tokens_total),
        )

    def router_stats(self) -> RouterStats:
        """Each worker's last ``GetLoad``, requests by status and retries (``/metrics``)."""
        return RouterStats(
            workers=tuple(w.stats() for w in self.workers),
            requests=dict(self.requests_by_status),
            retries=dict(self.retries),
            decisions=dict(self.routing.decisions),
            dispatches=dict(self.routing.dispatches),
            index_entries=self.index_entries,
            shared_state_up=self.routing.shared_up,
        )

    async def loads(self) -> dict[str, pb.Load]:
        """Every worker's current ``GetLoad`` (address -> load); unreachable ones are left out."""
        out = {}
        for w in self.workers:
            with contextlib.suppress(grpc.aio.AioRpcError):
                out[w.address] = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=5.0)
        return out

    # -- selection ----------------------------------------------------------------------------
    def candidates(self, role: str, avoid: set[WorkerHandle]) -> dict[str, WorkerHandle]:
        """Workers of ``role`` a request may go to: reachable ones not in ``avoid`` if any is
        left, else reachable ones, else all (a worker that failed this request or looks
        unreachable is still tried when it is the only one)."""
        mine = [w for w in self.workers if w.role == role]
        pool = [w for w in mine if w.healthy and w not in avoid] or [w for w in mine if w.healthy] or mine
        return {w.address: w for w in pool}

    async def _choose(
        self, rid: str, prompt: list[int], hashes: list[int], params: SamplingParams, avoid: set[WorkerHandle]
    ) -> tuple[WorkerHandle, WorkerHandle, list[Lease]]:
        ps, ds = self.candidates("prefill", avoid), self.candidates("decode", avoid)
        total = len(prompt) + params.max_tokens
        try:
            d, p_lease, d_lease = await self._routing(
                self.routing.choose, rid, len(prompt), hashes, total, ps, ds
            )
        except NoInstanceError as e:
            raise NoWorkerAvailable(str(e)) from e
        return ps[d.instance], ds[d_lease.instance], [p_lease, d_lease]

    def _release(self, *leases: Lease) -> None:
        asyncio.get_running_loop().run_in_executor(self.routing.executor, self.routing.release, *leases)

    # -- one request --------------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request through a prefill and a decode worker (module doc).

        Raises:
            ValueError: the workers refused the request (bad input), before any output.
            Overloaded, NoWorkerAvailable: no capacity / no reachable worker in any attempt.
            RuntimeError: it failed otherwise and could not be retried.
        """
        avoid: set[WorkerHandle] = set()
        touched: set[WorkerHandle] = set()  # workers some attempt sent this request (or its KV) to
        first: int | None = None  # the first token, once sent to the client
        attempt = 0
        finished = False
        status = "cancelled"  # unless it ends otherwise
        self.in_flight += 1
        try:
            params.validate()
            if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                    f"exceeds max_model_len {self.max_model_len}"
                )
            hashes = self.routing.hashes(prompt_token_ids)
            while True:
                attempt += 1
                p, d, leases = await self._choose(
                    f"{request_id}#{attempt}", prompt_token_ids, hashes, params, avoid
                )
                started = [False]  # decode output reached the client
                touched |= {p, d}
                try:
                    async for out in self._dispatch(
                        p, d, prompt_token_ids, params, request_id, first, started, leases
                    ):
                        if first is None and out.new_token_ids:
                            first = out.new_token_ids[0]
                            self.prompt_tokens_total += len(prompt_token_ids)
                            self.cached_tokens_total += out.cached_tokens
                        self.generation_tokens_total += len(out.new_token_ids)
                        finished = out.finished
                        if finished:
                            status = "ok"
                        yield out
                    return
                except DispatchError as e:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise asyncio.CancelledError from e  # the client went away: no retry
                    if started[0]:
                        raise RuntimeError(f"request failed: {e}") from e
                    if attempt > self.max_retries:
                        raise e.final() from e
                    log.warning("retrying %s (attempt %d): %s", request_id, attempt + 1, e)
                    self.retries[e.reason] += 1
                    if e.worker is not None:
                        avoid.add(e.worker)
        except ValueError:
            status = "invalid"
            raise
        except Unavailable:
            status = "unavailable"
            raise
        except Exception:
            status = "failed"
            raise
        finally:
            self.in_flight -= 1
            self.requests_by_status[status] += 1
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
        leases: list[Lease],
    ) -> AsyncIterator[RequestOutput]:
        """One attempt on ``p`` then ``d``; ``leases`` (prefill, decode) are released as each
        worker's part ends."""
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
                    out = _output(rid, m)
                    first = out.new_token_ids[0] if out.new_token_ids else first
                    if first_sent is not None and first != first_sent:
                        raise RuntimeError("a retried prefill sampled another first token")
                    done = out.finished  # ended at its first token: the last chunk
                    if first_sent is None:
                        yield out
                    elif done:  # its tokens were sent already
                        yield dataclasses.replace(out, new_token_ids=[], new_text="", new_logprobs=[])
                    if done:
                        return
                elif kind == "complete":
                    reason, usage = m.complete.finish_reason, m.usage
            p.outstanding -= n
            n = 0
            self._release(leases.pop(0))  # the prefill's work is done
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
                    out = _output(rid, m)
                    out.cached_tokens = cached
                    started[0] = True
                    done = out.finished
                    yield out
                    if done:
                        return
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
            self._release(*leases)
            for _, c in active:  # not done: the worker's stream ends and its engine aborts the
                c.cancel()  # request; done: only the `complete` after the last chunk is left

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
                    code = _CODES.get(m.error.code, grpc.StatusCode.UNKNOWN)
                    if msg.startswith("KV transfer"):
                        if code == grpc.StatusCode.UNAVAILABLE:
                            decode.healthy = False
                        raise DispatchError(msg, decode, code)
                    raise DispatchError(f"{worker.role} worker {worker.address}: {msg}", worker, code)
                yield m
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from e
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                worker.healthy = False
            raise DispatchError(
                f"{worker.role} worker {worker.address}: {e.code().name} {e.details()}", worker, e.code()
            ) from e

    async def _abort(self, w: WorkerHandle, rid: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await w.stub.Abort(pb.AbortRequest(request_id=rid), timeout=5.0)

    async def abort(self, request_id: str) -> None:
        for w in self.workers:
            await self._abort(w, request_id)


def _output(rid: str, m: pb.GenerateResponse) -> RequestOutput:
    """A chunk as a delta; the chunk a worker marked as the last one is the final output."""
    out = output_from_chunk(rid, m)
    if m.chunk.finish_reason:
        out.finished, out.finish_reason = True, finish_reason(m.chunk.finish_reason)
    return out
