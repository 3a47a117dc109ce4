"""A GCache node's Prometheus metrics: the store's counters per tier and kind
(``swaserve:gcache_<what>_total{tier,kind}``; lookups count ``hits`` / ``misses`` under tier
``any``), per-tier gauges (``gcache_capacity_bytes``, ``gcache_used_bytes``, ``gcache_pages``,
``gcache_leased_pages``), ``gcache_draining`` and the latency histogram
``gcache_op_seconds{op,transport}``. Served in the text format on ``--metrics-port``
(``services.worker_metrics.serve_metrics``)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "swaserve:"  # as swaserve.metrics.PREFIX (that module imports the engine package)

log = logging.getLogger("swaserve.gcache")

Snapshot = tuple[Counter[tuple[str, str, str]], dict[str, dict[str, int]]]

# store counter -> help; exported as swaserve:gcache_<name>_total{tier, kind}
COUNTERS = {
    "hits": "Pages a lookup found (tier any).",
    "misses": "Pages a lookup did not find (tier any).",
    "reads": "Pages read.",
    "bytes_read": "Object bytes read.",
    "puts": "Pages stored.",
    "bytes_written": "Object bytes stored.",
    "evictions": "Pages evicted (coldest leaves first).",
    "demotions": "Pages moved from DRAM to NVMe, counted on the tier they left.",
    "promotions": "Pages moved from NVMe back to DRAM, counted on the tier they left.",
    "corrupt_pages": "Pages that failed their checks on a read: deleted, never served.",
    "put_zombies": "Put reservations never committed, reclaimed after the put timeout.",
    "put_refused": "Puts refused for lack of room (FULL).",
    "put_no_parent": "Full pages refused because their parent is not stored (NO_PARENT).",
    "lease_expired": "Read leases that ran out before their get.",
    "io_errors": "Reads and writes the tier's disk failed (a full or failing NVMe device): the page "
    "is a miss or stays where it was, and the NVMe tier takes no new pages for 30 s.",
}
KINDS = ("full", "swa")
OP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GCacheCollector(Collector):
    """The store's counters and usage at each scrape. Args: snapshot: ``GCacheNode.snapshot``
    (a scrape that cannot get one exports only what needs no store); draining: the node's state."""

    def __init__(self, snapshot: Callable[[], Snapshot], draining: Callable[[], bool]) -> None:
        self._snapshot, self._draining = snapshot, draining

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        drain = GaugeMetricFamily(PREFIX + "gcache_draining", "1 while the node refuses puts (draining).")
        drain.add_metric([], 1.0 if self._draining() else 0.0)
        yield drain
        try:
            stats, usage = self._snapshot()
        except Exception as e:  # closed, or the store thread busy past the timeout
            log.warning("gcache metrics: no store snapshot (%s)", e)
            return
        tiers = sorted(usage)
        for what, doc in COUNTERS.items():
            fam = CounterMetricFamily(PREFIX + f"gcache_{what}", doc, labels=["tier", "kind"])
            values: dict[tuple[str, str], float] = {}
            for tier in ("any",) if what in ("hits", "misses") else tiers:
                for kind in KINDS:
                    values[(tier, kind)] = 0.0
            for (w, tier, kind), n in stats.items():
                if w == what:
                    values[(tier, kind)] = values.get((tier, kind), 0.0) + n
            for (tier, kind), v in sorted(values.items()):
                fam.add_metric([tier, kind], v)
            yield fam
        for name, field, doc in (
            ("gcache_capacity_bytes", "capacity", "Bytes the tier may hold."),
            ("gcache_used_bytes", "used", "Bytes of the tier's slots in use."),
            ("gcache_pages", "pages", "Pages stored in the tier."),
            ("gcache_leased_pages", "leased", "Pages of the tier under a read lease."),
        ):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["tier"])
            for tier in tiers:
                g.add_metric([tier], float(usage[tier][field]))
            yield g


class GCacheMetrics:
    """A node's metrics registry: the op histogram now, the store's series once ``attach``ed."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.op_seconds = Histogram(
            PREFIX + "gcache_op_seconds",
            "Seconds a node spends on one request, by operation and transport (grpc, ucx).",
            ["op", "transport"],
            buckets=OP_BUCKETS,
            registry=self.registry,
        )

    def observe(self, op: str, transport: str, seconds: float) -> None:
        self.op_seconds.labels(op, transport).observe(seconds)

    def attach(self, snapshot: Callable[[], Snapshot], draining: Callable[[], bool]) -> None:
        self.registry.register(GCacheCollector(snapshot, draining))
