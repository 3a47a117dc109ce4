"""The router's engine backend: the OpenAI server (``swaserve.api.server``) over prefill and decode
workers instead of a local engine.

``ClusterEngine`` is an ``EngineClient``: per request a prefill + decode pair (``routing``), an
attempt on them (``attempt``), retries under a new attempt id before decode output and resumes
after it within ``max_retries``, ``Unavailable`` (503) when out of capacity or workers; stats for
``/metrics``. Workers: ``workers.WorkerPool``, ``admin.WorkerAdmin``.
Retries, resume and errors: docs/DESIGN.md#servicesrouterclusterpy"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from services.convert import PRIOR_OUTPUT_FEATURE, needs_prior_output
from services.router.admin import WorkerAdmin
from services.router.attempt import (
    AttemptRunner,
    DispatchError,
    Interrupted,
    NoWorkerAvailable,
    Overloaded,
    Progress,
)
from services.router.discovery import DiscoveryOptions, KubeDiscovery
from services.router.encoders import EncoderPool
from services.router.routing import RouterRouting, RoutingOptions
from services.router.worker_handle import WorkerHandle
from services.router.workers import HUNG_POLLS, POLL_TIMEOUT_S, WorkerPool, in_routing
from services.tls import Dialer
from swaserve.config import ModelConfig
from swaserve.encoder.items import EncodeItem
from swaserve.engine.client import EngineClient, Unavailable
from swaserve.engine.stats import EngineStats
from swaserve.engine.types import RequestOutput, SamplingParams
from swaserve.kvcache.prefix_cache import CacheStats
from swaserve.media.placeholders import MediaInputs, MediaSpan
from swaserve.metrics_router import DiscoveryStats, RouterStats
from swaserve.model.identity import model_identity
from swaserve.model.multimodal import MultimodalConfig
from swaserve.routing.dispatch import NoInstanceError
from swaserve.routing.load import Lease
from swaserve.v1 import worker_pb2 as pb

if TYPE_CHECKING:
    from swaserve.transfer.kv_transfer import KVPayload

__all__ = [
    "HUNG_POLLS",
    "POLL_TIMEOUT_S",
    "ClusterEngine",
    "DispatchError",
    "Interrupted",
    "NoWorkerAvailable",
    "Overloaded",
    "WorkerHandle",
]
log = logging.getLogger("swaserve.router")
_DRAIN_RELEASES_S = 5.0  # stop(): how long the routing thread may take to apply queued releases


class ClusterEngine(EngineClient):
    """Args:
    model_dir: checkpoint dir (tokenizer, config: the workers must serve the same one).
    prefill, decode: worker addresses ``host:port`` (more can be added at runtime).
    model_name: served model name. request_timeout_s: per-request deadline (seconds).
    max_retries: re-dispatches of a request: retries of one that failed before its decode output
    started, and resumes of one that failed after (docs/DESIGN.md#servicesrouterclusterpy).
    poll_s: seconds between ``GetLoad`` polls (worker health and load) and registry syncs.
    routing: worker selection and shared state (default: cache-aware, in this process).
    poll_timeout_s: a poll's deadline (seconds); hung_polls: deadlines missed in a row that mark
    a worker down (``workers`` module docstring).
    dialer: how channels to workers are opened (``services.tls``; default: plaintext).
    discovery: find workers among Kubernetes pods too (``services.router.discovery``); with it
    ``prefill`` and ``decode`` may be empty (requests get 503 until a worker of each role is up).
    encoders: media encoder addresses (``services.router.encoders``; none: media requests get a 400).

    Raises:
        ValueError: no prefill or no decode worker (without ``discovery``), or bad poll settings.
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
        poll_timeout_s: float = POLL_TIMEOUT_S,
        hung_polls: int = HUNG_POLLS,
        dialer: Dialer | None = None,
        discovery: DiscoveryOptions | None = None,
        encoders: Sequence[str] = (),
    ) -> None:
        from swaserve.hf_tokenizer import load_tokenizer

        if discovery is None and (not prefill or not decode):
            raise ValueError("the router needs at least one prefill and one decode worker")
        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.request_timeout_s, self.max_retries, self.poll_s = request_timeout_s, max_retries, poll_s
        self.routing = RouterRouting(routing or RoutingOptions())
        self.media_config = MultimodalConfig.from_pretrained(self.model_dir)
        mdigest = None if self.media_config is None else self.media_config.digest()
        self.model = model_identity(self.model_config, self.tokenizer, self.model_dir.name, mdigest)
        self.pool = WorkerPool(self.routing, poll_s, poll_timeout_s, hung_polls, self.model, dialer)
        self.encoders = EncoderPool(encoders, self.model.fingerprint, dialer, poll_s)
        flags = {a: "decode" for a in decode} | {a: "prefill" for a in prefill}
        self.admin = WorkerAdmin(self.pool, self.routing, flags)
        self.admin.encoders = self.encoders
        self.discovery = KubeDiscovery(discovery, self.admin.discover) if discovery is not None else None
        self.runner = AttemptRunner(self.pool, self._release, request_timeout_s)
        self.in_flight = 0
        self.index_entries = 0  # last poll's prefix index size (/metrics)
        self._started = False
        self._poller: asyncio.Task[None] | None = None
        self._current: dict[str, tuple[WorkerHandle, WorkerHandle, str]] = {}  # request -> attempt
        self._background: set[asyncio.Task[Any]] = set()
        # counters since start, for /metrics (stats, router_stats)
        self.prompt_tokens_total = 0  # prompts of requests that got their first token
        self.generation_tokens_total = 0  # tokens relayed to clients
        self.cached_tokens_total = 0  # of those prompts, tokens the prefill workers had cached
        self.cached_host_tokens_total = 0  # of those, loaded from their host tiers (L3's included)
        self.cached_l3_tokens_total = 0  # of those, fetched from L3 (GCache)
        self.requests_by_status: collections.Counter[str] = collections.Counter()
        self.retries: collections.Counter[str] = collections.Counter()

    @property
    def max_model_len(self) -> int:  # type: ignore[override]  # an attribute on the engines: read-only here
        """The longest prompt + output a request may have: the least of the workers' reports
        (each lowers its own to what its KV cache holds), the model's before any reported."""
        return self.pool.max_model_len(self.model_config.max_position_embeddings)

    @property
    def workers(self) -> list[WorkerHandle]:
        """Every worker handle (draining ones included)."""
        return list(self.pool.handles.values())

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Started, and some prefill and some decode worker in use look reachable (else the API
        answers 503 on /health and on requests)."""
        return self._started and self.pool.up("prefill") and self.pool.up("decode")

    def unavailable(self) -> Unavailable | None:
        """Why the router cannot take requests now (``build_app`` answers requests and /health
        with it: 503 and its code), None when it can or is not started (``engine_not_running``):
        a ``NoWorkerAvailable`` naming the role that has no worker in use and up."""
        if not self._started:
            return None
        for role in ("prefill", "decode"):
            why = self.pool.missing(role)
            if why is not None:
                return NoWorkerAvailable(why)
        return None

    async def start(self) -> None:
        if self._started:
            return
        if self.discovery is not None:  # its first LIST, briefly awaited: the pods already Ready
            await self.discovery.start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.discovery.synced.wait(), self.discovery.opts.list_timeout_s)
        await self.admin.sync()  # the command line's workers with the registry's changes
        if self.encoders.states:
            await self.encoders.start()
        self._started = True
        self._poller = asyncio.create_task(self._poll(), name="router-poll")

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await self.encoders.stop()
        await self.pool.close()
        # the lease releases still queued on the routing thread (streams cancelled at shutdown)
        # reach the load book first: the process exits without joining threads (run_app), and a
        # release lost with Redis would leave a phantom lease on a worker for lease_ttl_s
        with contextlib.suppress(TimeoutError):
            done = asyncio.get_running_loop().run_in_executor(self.routing.executor, lambda: None)
            await asyncio.wait_for(done, _DRAIN_RELEASES_S)
        self._started = False

    async def _poll(self) -> None:
        """Index size, lease renewal and the worker registry (each worker's load has its own
        loop in ``WorkerPool``)."""
        renew_s = self.routing.opts.lease_ttl_s / 3
        last_renew = time.monotonic()
        while True:
            self.index_entries = await in_routing(self.routing, self.routing.index_size)
            if time.monotonic() - last_renew >= renew_s:
                last_renew = time.monotonic()
                await in_routing(self.routing, self.routing.renew)
            try:
                await self.admin.sync()
            except Exception:  # never let the registry stop lease renewal
                log.exception("worker registry sync failed")
            await asyncio.sleep(min(self.poll_s, renew_s))

    def stats(self) -> EngineStats:
        """Requests in flight through the router (``num_running``) and the token counters of the
        requests it relayed; the prefix-cache hits are the cached tokens the prefill workers
        reported (both tiers, counted as ``device``)."""
        return EngineStats(
            num_running=self.in_flight,
            num_waiting=0,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            prefix_cache=CacheStats(
                queries=self.prompt_tokens_total,
                hits_device=self.cached_tokens_total - self.cached_host_tokens_total,
                hits_host=self.cached_host_tokens_total - self.cached_l3_tokens_total,
                hits_l3=self.cached_l3_tokens_total,
            ),
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
            discovery=self._discovery_stats(),
            encoders=self.encoders.stats(),
        )

    def _discovery_stats(self) -> DiscoveryStats | None:
        d = self.discovery
        if d is None:
            return None
        return DiscoveryStats(dict(d.events), dict(d.relists), dict(d.workers))

    async def loads(self) -> dict[str, pb.Load]:
        """Every worker's current ``GetLoad`` (address -> load); unreachable ones are left out."""
        out = {}
        for w in self.workers:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                out[w.address] = await w.stub.GetLoad(pb.GetLoadRequest(), timeout=5.0)
        return out

    # -- selection ----------------------------------------------------------------------------
    def candidates(
        self, role: str, avoid: set[WorkerHandle], transfer_tokens: int = 0
    ) -> dict[str, WorkerHandle]:
        """Workers of ``role`` a request may go to (``WorkerPool.candidates``)."""
        return self.pool.candidates(role, avoid, transfer_tokens)

    async def _choose(
        self, rid: str, prompt: list[int], hashes: list[int], params: SamplingParams, avoid: set[WorkerHandle]
    ) -> tuple[WorkerHandle, WorkerHandle, list[Lease]]:
        ps = self.candidates("prefill", avoid)
        ds = self.candidates("decode", avoid, handoff_tokens(prompt, params))
        if needs_prior_output(params):
            ps, ds = exact_resume_workers(ps, "prefill"), exact_resume_workers(ds, "decode")
        total = len(prompt) + params.max_tokens
        try:
            d, p_lease, d_lease = await in_routing(
                self.routing, self.routing.choose, rid, len(prompt), hashes, total, ps, ds
            )
        except NoInstanceError as e:
            raise NoWorkerAvailable(str(e)) from e
        return ps[d.instance], ds[d_lease.instance], [p_lease, d_lease]

    def _check_staging(self, n: int) -> None:
        """Refuse, before any attempt, a prompt of ``n`` tokens handed to a decode worker that no
        decode worker's whole staging holds (a 400: a retry never helps), or that only decode
        workers that look down hold (a 503)."""
        staged = self.pool.max_transfer_tokens()
        if not n or staged is None:
            return
        if n > staged:
            raise ValueError(
                f"the prompt is too long for this deployment's decode workers: its KV ({n} tokens) "
                f"is larger than any decode worker's whole KV staging (at most {staged} prompt "
                "tokens, --staging-memory)"
            )
        up = self.pool.max_transfer_tokens(reachable=True)
        if up is None or n > up:
            raise NoWorkerAvailable(
                f"no decode worker whose KV staging holds a prompt of {n} tokens is reachable now "
                f"(the reachable ones hold at most {up or 0}), retry later"
            )

    def _release(self, *leases: Lease) -> None:
        asyncio.get_running_loop().run_in_executor(self.routing.executor, self.routing.release, *leases)

    # -- one request --------------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        export_kv: bool = False,
        prefilled: tuple[int, KVPayload] | None = None,
        media: MediaInputs | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream deltas of one request through a prefill and a decode worker (module doc).
        ``media``: its spans and the encoders holding their items (``media_inputs``); a retry
        submits the items again (an encoder that died is passed over).

        Raises:
            ValueError: the workers refused the request (bad input), before any output; KV
                export or import asked of the router (workers move KV, not the router).
            Overloaded, NoWorkerAvailable: no capacity / no reachable worker in any attempt.
            Interrupted: output had started and the request could not be resumed (resumes used
                up on another failure, or the resumed request refused).
            RuntimeError: it failed otherwise, before decode output, and could not be retried.
        """
        avoid: set[WorkerHandle] = set()
        first: int | None = None  # the first token, once sent to the client
        progress = Progress(self.tokenizer, prompt_token_ids, params)
        prompt, wparams = prompt_token_ids, params  # what the next attempt runs (changes on a resume)
        attempt = 0
        finished = False
        status = "cancelled"  # unless it ends otherwise
        if export_kv or prefilled is not None:
            raise ValueError("the router moves no KV itself: export_kv/prefilled go to a worker engine")
        self.in_flight += 1
        try:
            params.validate()
            if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                    f"exceeds max_model_len {self.max_model_len}"
                )
            self._check_staging(handoff_tokens(prompt_token_ids, params))
            hashes = self.routing.hashes(prompt_token_ids)
            while True:
                attempt += 1
                wire_id = f"{request_id}#{attempt}"  # the request id on the workers, per attempt
                p, d, leases = await self._choose(wire_id, prompt, hashes, wparams, avoid)
                if p.draining or d.draining or p.shutting_down or d.shutting_down:
                    # removed, or began shutting down, while the choice was made: choose again
                    self._release(*leases)
                    attempt -= 1
                    continue
                started = [False]  # decode output reached the client
                self._current[request_id] = (p, d, wire_id)
                if media is not None and attempt > 1 and media.items:  # resubmit: its encoder may be gone
                    media = await self.encoders.resubmit(media)
                first_sent = None if progress.resumed else first  # a resume samples a new token
                try:
                    run = self.runner.run(
                        p, d, wire_id, request_id, prompt, wparams, first_sent, started, leases, media
                    )
                    async with contextlib.aclosing(run) as outs:
                        async for raw in outs:
                            out = progress.relay(raw)
                            if first is None and out.new_token_ids:
                                first = out.new_token_ids[0]
                                self.prompt_tokens_total += len(prompt_token_ids)
                                self.cached_tokens_total += out.cached_tokens
                                self.cached_host_tokens_total += out.cached_host_tokens
                                self.cached_l3_tokens_total += out.cached_l3_tokens
                            self.generation_tokens_total += len(out.new_token_ids)
                            finished = out.finished
                            if finished:
                                status = "ok"
                            yield out
                            if finished:
                                break
                    if progress.cut:  # ended by the router on a stop string: the workers' part goes
                        self._abort_attempt(p, d, wire_id)
                    return
                except DispatchError as e:
                    task = asyncio.current_task()
                    if task is not None and task.cancelling():
                        raise asyncio.CancelledError from e  # the client went away: no retry
                    resume = progress.should_resume(started[0])
                    if e.worker is not None:
                        avoid.add(e.worker)  # never again for this request
                    held = handoff_tokens(prompt, wparams)  # decode workers must hold its KV
                    left_out = [
                        r
                        for r in ("prefill", "decode")
                        if not self.candidates(r, avoid, held * (r == "decode"))
                    ]
                    if attempt > self.max_retries or left_out:  # left_out: no worker to retry on
                        last = e.no_other_worker(left_out[0]) if left_out else e
                        raise (last.interrupted(len(progress.tokens)) if resume else last.final()) from e
                    self._abort_attempt(p, d, wire_id)  # whatever it left (staged KV) goes
                    if not resume:
                        log.warning("retrying %s (attempt %d): %s", request_id, attempt + 1, e)
                        self.retries[e.reason] += 1
                        continue
                    prompt, wparams = progress.resume()  # Interrupted: not resumable (counted as not resumed)
                    log.warning(
                        "resuming %s after %d tokens (attempt %d): %s",
                        request_id,
                        len(progress.tokens),
                        attempt + 1,
                        e,
                    )
                    self.retries["resumed"] += 1
                    hashes = self.routing.hashes(prompt)
                except ValueError as e:
                    if not progress.resumed:
                        raise
                    raise Interrupted(
                        f"request interrupted after {len(progress.tokens)} generated tokens: "
                        f"its resume was refused ({e})"
                    ) from e
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
            current = self._current.pop(request_id, None)
            if not finished and current is not None:  # client gone or failed: drop it everywhere
                self._abort_attempt(*current)

    async def media_inputs(
        self, spans: Sequence[MediaSpan], items: Sequence[EncodeItem], item_spans: Sequence[Sequence[int]]
    ) -> MediaInputs:
        """``EngineClient.media_inputs``: the items submitted to encoders (``EncoderPool``)."""
        return await self.encoders.media_inputs(spans, items, item_spans)

    def _abort_attempt(self, p: WorkerHandle, d: WorkerHandle, wire_id: str) -> None:
        """Abort an attempt on both its workers, in the background (staged KV included)."""
        for w in (p, d):
            task = asyncio.get_running_loop().create_task(self._abort(w, wire_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _abort(self, w: WorkerHandle, wire_id: str) -> None:
        await self.pool.abort(w, wire_id)  # one the worker misses now is sent again when it is back

    async def abort(self, request_id: str) -> None:
        """Abort a request's current attempt on its workers (closing its stream does it too)."""
        current = self._current.get(request_id)
        if current is not None:
            p, d, wire_id = current
            await asyncio.gather(self._abort(p, wire_id), self._abort(d, wire_id))


def handoff_tokens(prompt: list[int], params: SamplingParams) -> int:
    """Prompt tokens whose KV a prefill worker hands to a decode worker for this request: all of
    them, or 0 when it ends at its first token (``max_tokens`` <= 1: no decode worker)."""
    return len(prompt) if params.max_tokens > 1 else 0


def exact_resume_workers(workers: dict[str, WorkerHandle], role: str) -> dict[str, WorkerHandle]:
    """The ``workers`` that continue a resumed seeded or penalized request exactly (their
    ``Load.features`` list ``prior_output_tokens``: a worker of an older release ignores it and
    would give other tokens, e.g. during a rolling upgrade).

    Raises:
        NoWorkerAvailable: none of them does."""
    able = {
        a: w for a, w in workers.items() if w.load is not None and PRIOR_OUTPUT_FEATURE in w.load.features
    }
    if workers and not able:
        raise NoWorkerAvailable(
            f"no {role} worker continues this resumed request exactly (seeded sampling or presence/"
            f"frequency penalties need workers whose GetLoad lists {PRIOR_OUTPUT_FEATURE!r}: "
            "these run an older release)"
        )
    return able
