"""A worker's Prometheus metrics (``WorkerMetrics``: KV transfer bytes and failures, index events)
and its ``--metrics-port`` (``serve_metrics``), which always answers in the text format 0.0.4.

Prometheus asks for OpenMetrics first, and prometheus_client's OpenMetrics output (0.26) turns the
``:`` of ``swaserve:`` names into ``_`` on sample lines while its ``# TYPE`` lines keep it
(prometheus/client_python#1177): the series would arrive as ``swaserve_kv_transfer_...``. The text
format keeps the names as they are, as the router's ``/metrics`` serves them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from swaserve.engine.stats import EngineStats
from swaserve.metrics import PREFIX, token_bytes_family
from swaserve.metrics_engine import ep_families, l3_families, spec_families
from swaserve.metrics_router import WORKER_LABEL

TEXT_FORMAT = "text/plain; version=0.0.4"


class WorkerMetrics:
    """Prometheus metrics of a worker (own registry; served on ``--metrics-port``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.kv_sent = Counter(
            "swaserve:kv_transfer_sent_bytes",
            "KV payload bytes pushed to decode workers",
            registry=self.registry,
        )
        self.kv_received = Counter(
            "swaserve:kv_transfer_received_bytes",
            "KV payload bytes received into staging",
            registry=self.registry,
        )
        self.kv_request = Histogram(
            "swaserve:kv_transfer_request_bytes",
            "KV payload bytes per transferred request",
            buckets=tuple(2**i for i in range(10, 36, 2)),
            registry=self.registry,
        )
        self.kv_failed = Counter(
            "swaserve:kv_transfer_failed", "KV transfers refused or failed", registry=self.registry
        )
        self.media_fetch_failed = Counter(
            "swaserve:media_fetch_failed",
            "requests whose media embeddings could not be fetched from their encoder (retried elsewhere)",
            registry=self.registry,
        )
        self.index_events = Counter(
            "swaserve:index_events",
            "prefix-cache block events for the router's index, by outcome (published, dropped)",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in ("published", "dropped"):  # exported from the start (0), so rate() has a base
            self.index_events.labels(outcome)


class WorkerLoadCollector(Collector):
    """The worker's own load, under the names and labels the router exports for it
    (``worker_num_requests_*``, ``worker_outstanding_tokens``, ``worker_kv_staged_bytes``,
    ``kv_cache_{usage_perc,used_pages,total_pages}`` and ``prefix_cache_pages`` with ``model_name``,
    ``role``, ``worker`` and ``pool``; ``kv_cache_token_bytes`` by ``pool`` and ``format``;
    ``worker_prefix_cache_{queries,hits}_total`` (hits by
    ``tier``: device, host, l3); with MTP on the ``spec_decode_*`` counters): per-pod series an autoscaler can select by the pod's labels
    (the chart's KEDA triggers), and that ``max by (worker)`` folds with the routers' copies.

    Args: stats: the engine's latest snapshot (never waits for a step); staged_bytes: decode KV
    staged and not admitted; model_name, role, worker: label values (``worker``: the address routers
    dial, as they label it)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        staged_bytes: Callable[[], int],
        model_name: str,
        role: str,
        worker: str,
    ) -> None:
        self._stats, self._staged = stats, staged_bytes
        self._labels = [model_name, role, worker]

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        names = ["model_name", "role", WORKER_LABEL]
        for name, doc, value in (
            ("worker_num_requests_running", "Requests in the worker's batches.", s.num_running),
            ("worker_num_requests_waiting", "Requests waiting in the worker.", s.num_waiting),
            ("worker_outstanding_tokens", "Prompt tokens not computed yet plus tokens still to generate.",
             max(0, s.outstanding_tokens)),
            ("worker_kv_staged_bytes", "KV bytes received and not yet admitted (decode workers).", self._staged()),
        ):  # fmt: skip
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            fam.add_metric(self._labels, value)
            yield fam
        pool_names = ["model_name", "pool", "role", WORKER_LABEL]
        for name, doc, get in (
            ("kv_cache_usage_perc", "Fraction of the KV pool's pages in use (0..1).", lambda p: p.usage),
            ("kv_cache_used_pages", "KV pages not free: held by requests or the prefix cache.",
             lambda p: p.used_pages),
            ("kv_cache_total_pages", "KV pages in the pool.", lambda p: p.total_pages),
            ("prefix_cache_pages", "Pages the prefix cache holds, by pool.", lambda p: p.cached_pages),
        ):  # fmt: skip
            fam = GaugeMetricFamily(PREFIX + name, doc, labels=pool_names)
            for pool, p in sorted(s.pools.items()):
                fam.add_metric([self._labels[0], pool, *self._labels[1:]], get(p))
            yield fam
        yield token_bytes_family(s.pools, ["model_name", "pool", "format", "role", WORKER_LABEL],
                                 lambda pool, p: [self._labels[0], pool, p.kv_format, *self._labels[1:]])  # fmt: skip
        pc = s.prefix_cache
        if pc is not None:  # per tier (the router's prefix_cache_hits has no tiers in a cluster)
            queries = CounterMetricFamily(
                PREFIX + "worker_prefix_cache_queries", "Prompt tokens looked up in this worker's prefix cache.",
                labels=names,
            )  # fmt: skip
            queries.add_metric(self._labels, pc.queries)
            hits = CounterMetricFamily(
                PREFIX + "worker_prefix_cache_hits",
                "Prompt tokens this worker served from its prefix cache, by tier (device; host: what "
                "the host tier added; l3: what GCache added).",
                labels=["model_name", "tier", "role", WORKER_LABEL],
            )
            for tier, n in (("device", pc.hits_device), ("host", pc.hits_host), ("l3", pc.hits_l3)):
                hits.add_metric([self._labels[0], tier, *self._labels[1:]], n)
            yield from (queries, hits)
        if s.spec is not None:  # MTP on: the acceptance counters (decode workers verify)
            yield from spec_families(s.spec, dict(zip(names, self._labels, strict=True)))
        if s.ep is not None:  # expert parallel: expert load balance per MoE layer
            yield from ep_families(s.ep, dict(zip(names, self._labels, strict=True)))
        if s.l3:  # an L3 tier (--l3-url): its lookups, fetches, losses and puts
            yield from l3_families(s.l3, dict(zip(names, self._labels, strict=True)))


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # every scrape would be a line
        pass


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> WSGIServer:
    """Serve ``registry`` on ``host:port`` from a daemon thread (``shutdown()`` the result to stop)."""
    app = make_wsgi_app(registry)

    def text_only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        return app({**environ, "HTTP_ACCEPT": TEXT_FORMAT}, start_response)

    httpd = make_server(host, port, text_only, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd
