"""Prometheus metrics for one serving process, in the ``swaserve:`` namespace (vLLM's names, units and
buckets, prefix ``vllm:`` -> ``swaserve:``).

Engine state is read from ``EngineStats`` at scrape time (``EngineStatsCollector``), request
latencies observed per request (``RequestTimer``); the router adds per-worker KV pool gauges and its
own counters (``RouterStats``). Each ``ServerMetrics`` owns its ``CollectorRegistry``.

Design notes: docs/DESIGN.md#metricspy"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput
from swaserve.kvcache.stats import PoolStats
from swaserve.metrics_engine import PREFIX, ep_families, spec_families

WORKER_LABEL = "worker"
"""The router's label for the worker a per-worker series is about (``host:port``). Not ``instance``:
Prometheus sets ``instance`` to the scraped target (the router) and would rename ours
``exported_instance``."""

# Bucket boundaries in seconds (the same sets vLLM exports, so SLO targets sit on boundaries).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


ROUTER_STATUSES = ("ok", "invalid", "unavailable", "failed", "cancelled")
"""Outcomes of a request at the router: finished; refused as invalid (4xx); no capacity or no
worker (503); failed otherwise (500 or an error event); the client went away first."""
RETRY_REASONS = ("overloaded", "unavailable", "worker_down", "encoder", "error", "resumed")
"""Why the router re-dispatched a request: a decode worker's staging was full; a worker could not
be reached; the router marked a worker down (refused or missed polls) while the request was on it
and cancelled it there; a prefill worker could not fetch its media from an encoder (the items are
resubmitted); another retryable failure (these five before decode output started);
``resumed``: any retryable failure after decode output reached the client, the request resumed
elsewhere with its generated tokens."""


@dataclass(frozen=True)
class WorkerStats:
    """One worker as the router last saw it (its latest ``GetLoad``).

    Attributes:
        role: ``prefill`` or ``decode``. instance: the worker's ``host:port`` (the ``worker`` label).
        up: reachable at the last poll or call.
        pools: page counts per pool (``full``, ``swa``); ``page_bytes`` is 0 (not reported).
        draining: removed at runtime, or shutting down (SIGTERM); its requests in flight finish, no
            new ones go there.
    """

    role: str
    instance: str
    up: bool
    running: int = 0
    waiting: int = 0
    outstanding_tokens: int = 0
    staged_bytes: int = 0
    pools: dict[str, PoolStats] = field(default_factory=dict)
    draining: bool = False


@dataclass(frozen=True)
class RouterStats:
    """What the router adds to the engine metrics: its workers and its request outcomes."""

    workers: tuple[WorkerStats, ...] = ()
    requests: dict[str, int] = field(default_factory=dict)  # ROUTER_STATUSES -> count
    retries: dict[str, int] = field(default_factory=dict)  # RETRY_REASONS -> count
    decisions: dict[str, int] = field(default_factory=dict)  # routing decision reason -> count
    dispatches: dict[tuple[str, str], int] = field(default_factory=dict)  # (role, instance) -> count
    index_entries: int = 0  # prefix index (block, instance) entries
    shared_state_up: bool | None = None  # Redis reachable (None: no Redis)
    discovery: DiscoveryStats | None = None  # Kubernetes discovery (None: off)
    encoders: tuple[EncoderStats, ...] = ()  # media encoders (none: no media)


@dataclass(frozen=True)
class EncoderStats:
    """A media encoder as a router sees it: reachable at the last ``GetLoad``, its queued + running
    items then, and the items this router submitted there."""

    address: str
    up: bool
    load: float
    submitted: int


@dataclass(frozen=True)
class DiscoveryStats:
    """The router's Kubernetes discovery (``services.router.discovery``): watch ``events`` by type
    (``DISCOVERY_EVENTS``), ``relists`` (pod LISTs) by reason (``DISCOVERY_RELISTS``), ``workers``
    (pods in use) by role."""

    events: dict[str, int] = field(default_factory=dict)
    relists: dict[str, int] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)


DISCOVERY_EVENTS = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK")
DISCOVERY_RELISTS = ("start", "resync", "gone", "error")


def token_bytes_family(
    pools: dict[str, PoolStats], labels: list[str], values: Callable[[str, PoolStats], list[str]]
) -> GaugeMetricFamily:
    """``kv_cache_token_bytes``: bytes one token's K and V take in each pool over its layers
    (quantization scales included), labelled by ``values(pool, stats)`` (pool and format among them)."""
    fam = GaugeMetricFamily(
        PREFIX + "kv_cache_token_bytes",
        "Bytes one token's K and V take in the pool over all its layers (scales included), by pool "
        "and page format (--kv-cache-dtype).",
        labels=labels,
    )
    for pool, p in sorted(pools.items()):
        if p.page_size:
            fam.add_metric(values(pool, p), p.token_bytes)
    return fam


class EngineStatsCollector(Collector):
    """Turns one ``EngineStats`` snapshot per scrape into gauges and counters.

    Args:
        stats: Returns the engine's current snapshot (``AsyncLLMEngine.stats``).
        model_name: Value of the ``model_name`` label.
        router: The router's snapshot (``ClusterEngine.router_stats``): KV pool gauges come from
            its workers (extra labels ``role``, ``worker``) and the router families are added.
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        router: Callable[[], RouterStats] | None = None,
    ) -> None:
        self._stats = stats
        self._model = model_name
        self._router = router

    def describe(self) -> list[Metric]:
        # An empty description keeps the registry from calling collect() at registration time.
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        r = self._router() if self._router is not None else None
        m = [self._model]
        running = GaugeMetricFamily(
            PREFIX + "num_requests_running", "Requests in model execution batches.", labels=["model_name"]
        )
        running.add_metric(m, s.num_running)
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", labels=["model_name"]
        )
        waiting.add_metric(m, s.num_waiting)
        yield running
        yield waiting

        pool_labels = ["model_name", "pool"]
        rows: list[tuple[list[str], PoolStats]] = [([self._model, n], p) for n, p in sorted(s.pools.items())]
        if r is not None:  # the router: the workers' pools
            pool_labels = ["model_name", "pool", "role", WORKER_LABEL]
            rows = [
                ([self._model, n, w.role, w.instance], p)
                for w in r.workers
                for n, p in sorted(w.pools.items())
            ]
        usage = GaugeMetricFamily(
            PREFIX + "kv_cache_usage_perc",
            "Fraction of the KV pool's pages in use (0..1).",
            labels=pool_labels,
        )
        used = GaugeMetricFamily(
            PREFIX + "kv_cache_used_pages",
            "KV pages not free: held by requests or the prefix cache.",
            labels=pool_labels,
        )
        total = GaugeMetricFamily(
            PREFIX + "kv_cache_total_pages", "KV pages in the pool.", labels=pool_labels
        )
        peak = GaugeMetricFamily(
            PREFIX + "kv_cache_peak_used_pages", "Most KV pages held at once since start.", labels=pool_labels
        )
        used_bytes = GaugeMetricFamily(
            PREFIX + "kv_cache_used_bytes",
            "Bytes of KV pages not free (requests and prefix cache).",
            labels=pool_labels,
        )
        for labels, p in rows:
            usage.add_metric(labels, p.usage)
            used.add_metric(labels, p.used_pages)
            total.add_metric(labels, p.total_pages)
            peak.add_metric(labels, p.peak_used_pages)
            if p.page_bytes:  # workers older than page_bytes in GetLoad report 0
                used_bytes.add_metric(labels, p.used_bytes)
        yield from (usage, used, total, peak, used_bytes)
        if r is None:
            yield token_bytes_family(
                s.pools, ["model_name", "pool", "format"], lambda pool, p: [self._model, pool, p.kv_format]
            )

        prompt = CounterMetricFamily(
            PREFIX + "prompt_tokens", "Prefill tokens processed.", labels=["model_name"]
        )
        prompt.add_metric(m, s.prompt_tokens_total)
        generation = CounterMetricFamily(
            PREFIX + "generation_tokens", "Generation tokens processed.", labels=["model_name"]
        )
        generation.add_metric(m, s.generation_tokens_total)
        yield prompt
        yield generation

        pc = s.prefix_cache
        queries = CounterMetricFamily(
            PREFIX + "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            labels=["model_name"],
        )
        queries.add_metric(m, pc.queries if pc is not None else 0)
        hits = CounterMetricFamily(
            PREFIX + "prefix_cache_hits",
            "Prompt tokens served from the prefix cache, by tier (device; host: what the host tier added; l3: what GCache added).",
            labels=["model_name", "tier"],
        )
        hits.add_metric([self._model, "device"], pc.hits_device if pc is not None else 0)
        hits.add_metric([self._model, "host"], pc.hits_host if pc is not None else 0)
        hits.add_metric([self._model, "l3"], pc.hits_l3 if pc is not None else 0)
        cached = GaugeMetricFamily(
            PREFIX + "prefix_cache_pages",
            "Pages the prefix cache holds, by pool (full, swa, host_full, host_swa; router: each "
            "worker's full, swa).",
            labels=pool_labels,
        )
        if r is None:
            for pool, n in sorted(s.cache_pages.items()):
                cached.add_metric([self._model, pool], n)
        for labels, p in rows if r is not None else ():
            cached.add_metric(labels, p.cached_pages)
        yield from (queries, hits, cached)
        if s.spec is not None:
            yield from spec_families(s.spec, {"model_name": self._model})
        if s.ep is not None:
            yield from ep_families(s.ep, {"model_name": self._model})
        if r is not None:
            yield from self._router_families(r)
        if r is not None and r.discovery is not None:
            yield from self._discovery_families(r.discovery)
        if r is not None and r.encoders:
            yield from self._encoder_families(r.encoders)

    def _encoder_families(self, encoders: tuple[EncoderStats, ...]) -> Iterator[Metric]:
        labels = ["model_name", "encoder"]
        up = GaugeMetricFamily(
            PREFIX + "router_encoder_up", "1 if the encoder answered the last poll.", labels=labels
        )
        load = GaugeMetricFamily(
            PREFIX + "router_encoder_load",
            "The encoder's queued + running media items at the last poll.",
            labels=labels,
        )
        for e in encoders:
            up.add_metric([self._model, e.address], int(e.up))
            load.add_metric([self._model, e.address], e.load)
        yield up
        yield load
        yield self._counter(
            "router_encoder_items",
            "Media items this router submitted to each encoder.",
            ["encoder"],
            (((e.address,), e.submitted) for e in encoders),
        )

    def _discovery_families(self, d: DiscoveryStats) -> Iterator[Metric]:
        yield self._counter(
            "router_discovery_events",
            "Pod watch events of Kubernetes discovery, by type (ADDED, MODIFIED, DELETED, BOOKMARK).",
            ["type"],
            (((t,), d.events.get(t, 0)) for t in DISCOVERY_EVENTS),
        )
        yield self._counter(
            "router_discovery_relists",
            "Full pod LISTs of Kubernetes discovery, by reason (start, resync: periodic, gone: 410 "
            "Gone, error: a failed LIST or watch, or a dropped stream).",
            ["reason"],
            (((x,), d.relists.get(x, 0)) for x in DISCOVERY_RELISTS),
        )
        workers = GaugeMetricFamily(
            PREFIX + "router_discovery_workers",
            "Pods Kubernetes discovery finds in use as workers (Running, Ready, not terminating), by role.",
            labels=["model_name", "role"],
        )
        for role, n in sorted(d.workers.items()):
            workers.add_metric([self._model, role], n)
        yield workers

    def _counter(
        self, name: str, doc: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], int]]
    ) -> Metric:
        """One counter family over ``(label values, count)`` pairs (``model_name`` added first)."""
        fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
        for key, n in values:
            fam.add_metric([self._model, *key], n)
        return fam

    def _router_families(self, r: RouterStats) -> Iterator[Metric]:
        yield self._counter(
            "router_requests",
            "Requests the router finished, by status (ok, invalid, unavailable, failed, cancelled).",
            ["status"],
            (((s,), r.requests.get(s, 0)) for s in ROUTER_STATUSES),
        )
        yield self._counter(
            "router_retries",
            "Re-dispatches of a request to other workers, by reason (overloaded, unavailable, worker_down, "
            "error, resumed: after decode output started).",
            ["reason"],
            (((x,), r.retries.get(x, 0)) for x in RETRY_REASONS),
        )
        yield self._counter(
            "router_decisions",
            "Prefill choices by reason: affinity (cache hit), load, balance (guard overrode the cache), "
            "round_robin; _fallback when no worker's length bucket held the prompt.",
            ["reason"],
            (((x,), n) for x, n in sorted(r.decisions.items())),
        )
        yield self._counter(
            "router_dispatches",
            "Attempts sent to each worker by this router.",
            ["role", WORKER_LABEL],
            sorted(({(w.role, w.instance): 0 for w in r.workers} | r.dispatches).items()),  # 0 from the start
        )
        index = GaugeMetricFamily(
            PREFIX + "router_index_entries", "Prefix index entries (block, instance).", labels=["model_name"]
        )
        index.add_metric([self._model], r.index_entries)
        yield index
        if r.shared_state_up is not None:
            up = GaugeMetricFamily(
                PREFIX + "router_shared_state_up",
                "1 if the shared routing state (Redis) answered at the last call.",
                labels=["model_name"],
            )
            up.add_metric([self._model], int(r.shared_state_up))
            yield up
        labels = ["model_name", "role", WORKER_LABEL]
        families = {
            "up": GaugeMetricFamily(
                PREFIX + "worker_up", "1 if the worker was reachable at the last poll.", labels=labels
            ),
            "draining": GaugeMetricFamily(
                PREFIX + "worker_draining",
                "1 while a worker removed or shutting down finishes its requests (no new ones go there).",
                labels=labels,
            ),
            "running": GaugeMetricFamily(
                PREFIX + "worker_num_requests_running", "Requests in the worker's batches.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                PREFIX + "worker_num_requests_waiting", "Requests waiting in the worker.", labels=labels
            ),
            "outstanding_tokens": GaugeMetricFamily(
                PREFIX + "worker_outstanding_tokens",
                "Prompt tokens not computed yet plus tokens still to generate, on the worker.",
                labels=labels,
            ),
            "staged_bytes": GaugeMetricFamily(
                PREFIX + "worker_kv_staged_bytes",
                "KV bytes received and not yet admitted (decode workers).",
                labels=labels,
            ),
        }
        for w in r.workers:
            values = {
                "up": int(w.up),
                "draining": int(w.draining),
                "running": w.running,
                "waiting": w.waiting,
                "outstanding_tokens": w.outstanding_tokens,
                "staged_bytes": w.staged_bytes,
            }
            for key, fam in families.items():
                fam.add_metric([self._model, w.role, w.instance], values[key])
        yield from families.values()


class ServerMetrics:
    """The metrics of one serving process, with its own registry.

    Args:
        stats: Returns the engine's current ``EngineStats`` (read at scrape time).
        model_name: Value of the ``model_name`` label on every series.
        router: The router's ``RouterStats`` (read at scrape time), in ``swaserve up``'s router.
        max_model_len: Longest prompt + output: the top bucket of the per-request token histograms.
    """

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        router: Callable[[], RouterStats] | None = None,
        max_model_len: int = 1 << 17,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            h = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            return h.labels(model_name)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first output token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last output.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds",
            "Time from arrival to the first scheduled step.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Time from the first scheduled step to the first token (not at the router: no scheduling times).",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.", REQUEST_LATENCY_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Time from the first scheduled step to the last token (not at the router).",
            REQUEST_LATENCY_BUCKETS,
        )
        tokens = token_buckets(max_model_len)
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", tokens
        )
        self._success = Counter(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT):  # 0 from the start
            self._success.labels(model_name, reason.value)
        self.registry.register(EngineStatsCollector(stats, model_name, router))

    def count_finished(self, reason: FinishReason | str) -> None:
        """Count one finished request under ``finished_reason`` (stop, length, abort)."""
        value = reason.value if isinstance(reason, FinishReason) else reason
        self._success.labels(self.model_name, value).inc()

    def timer(self, prompt_tokens: int | None = None) -> RequestTimer:
        """A timer for one new request of ``prompt_tokens`` tokens (None: as its outputs say), starting now."""
        return RequestTimer(self, prompt_tokens=prompt_tokens)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTimer:
    """Observes one request's latencies from its ``RequestOutput`` stream.

    Engine timestamps (``arrival_time``, ``first_scheduled_time``, ``first_token_time``) are on the
    ``time.monotonic`` clock; outputs arriving here are timed with the same clock. Where the engine
    leaves ``arrival_time`` at 0, the time this timer was made stands in for it. Prefill and
    inference times need ``first_scheduled_time``, which the router's outputs do not carry.

    Args:
        metrics: Where to record.
        clock: Monotonic clock in seconds (injectable for tests).
        prompt_tokens: The prompt's length (None: the last ``prompt_tokens`` an output reported).
    """

    def __init__(
        self,
        metrics: ServerMetrics,
        clock: Callable[[], float] = time.monotonic,
        prompt_tokens: int | None = None,
    ) -> None:
        self._m = metrics
        self._clock = clock
        self._created = clock()
        self._arrival: float | None = None
        self._scheduled: float | None = None
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._prompt_tokens = prompt_tokens
        self._generated = 0
        self.done = False

    def observe(self, out: RequestOutput) -> None:
        """Record what one output tells: queue time, TTFT, inter-token gaps, end-to-end latency."""
        if self.done:
            return
        now = self._clock()
        if self._arrival is None:
            self._arrival = out.arrival_time or self._created
        if self._scheduled is None and out.first_scheduled_time is not None:
            self._scheduled = out.first_scheduled_time
            self._m.queue.observe(max(0.0, self._scheduled - self._arrival))
        if self._prompt_tokens is None and out.prompt_tokens:
            self._prompt_tokens = out.prompt_tokens
        n = len(out.new_token_ids)
        self._generated += n
        if n:
            if self._last_token is None:
                first = out.first_token_time if out.first_token_time is not None else now
                self._m.ttft.observe(max(0.0, first - self._arrival))
                if self._scheduled is not None:
                    self._m.prefill_time.observe(max(0.0, first - self._scheduled))
                self._first_token = self._last_token = first
                n -= 1  # the first token has no predecessor
            if n:
                gap = max(0.0, now - self._last_token) / n
                for _ in range(n):
                    self._m.itl.observe(gap)
                self._last_token = now
        if out.finished:
            self._finish(out.finish_reason or FinishReason.STOP, now)

    def abort(self) -> None:
        """Record a request that ended without a final output (client gone, server error)."""
        if not self.done:
            self._finish(FinishReason.ABORT, self._clock())

    def discard(self) -> None:
        """Record nothing more for this request (it was refused, not served)."""
        self.done = True

    def _finish(self, reason: FinishReason, now: float) -> None:
        self.done = True
        arrival = self._arrival if self._arrival is not None else self._created
        self._m.e2e.observe(max(0.0, now - arrival))
        if self._first_token is not None and self._last_token is not None:
            self._m.decode_time.observe(max(0.0, self._last_token - self._first_token))
            if self._scheduled is not None:
                self._m.inference_time.observe(max(0.0, self._last_token - self._scheduled))
        if self._prompt_tokens:
            self._m.prompt_tokens.observe(self._prompt_tokens)
        self._m.generation_tokens.observe(self._generated)
        self._m.count_finished(reason)
