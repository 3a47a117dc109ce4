"""Prometheus metrics for one serving process, in the ``swaserve:`` namespace (vLLM's names, units and
buckets, prefix ``vllm:`` -> ``swaserve:``).

Engine state is read from ``EngineStats`` at scrape time (``EngineStatsCollector``), request
latencies observed per request (``RequestTimer``); the router adds per-worker KV pool gauges and its
own counters (``RouterStats``). Each ``ServerMetrics`` owns its ``CollectorRegistry``.

Design notes: docs/DESIGN.md#metricspy"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput
from swaserve.kvcache.stats import PoolStats
from swaserve.metrics_engine import PREFIX, ep_families, l3_families, spec_families
from swaserve.metrics_router import WORKER_LABEL, RouterStats, router_families

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
        if s.l3:
            yield from l3_families(s.l3, {"model_name": self._model})
        if r is not None:
            yield from router_families(r, self._model)


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
