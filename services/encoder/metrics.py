"""An encoder's Prometheus metrics, on its own registry (served on ``--metrics-port`` in the text
format by ``services.worker_metrics.serve_metrics``, as the GCache node's).

Counters: ``swaserve:encoder_items_total{modality,outcome}`` (per submitted item: ``encoded``,
``cached`` = served without a new forward: a cache hit or joined to an identical item in flight,
``failed``), ``encoder_cache_hits_total{tier}`` (``memory``, ``shm``) and
``encoder_cache_misses_total`` (looked up at Submit), ``encoder_fetches_total{outcome}``
(``served``, ``not_found``, ``failed``, ``timeout``), ``encoder_fetch_bytes_total`` (embedding
bytes streamed). Histograms: ``encoder_batch_items`` (items per forward),
``encoder_encode_seconds{modality}`` (one forward, preprocessing included). Gauges read at
scrape (``watch``): ``encoder_queue_items``, ``encoder_running_items``, ``encoder_cache_bytes`` /
``encoder_cache_capacity_bytes`` / ``encoder_cache_entries`` (this process's memory tier),
``encoder_shm_cache_bytes`` (the machine's shared tier, with one), ``encoder_draining``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "swaserve:"  # as swaserve.metrics.PREFIX
MODALITIES = ("image", "video", "audio")
OUTCOMES = ("encoded", "cached", "failed")
TIERS = ("memory", "shm")
FETCH_OUTCOMES = ("served", "not_found", "failed", "timeout")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ENCODE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EncoderMetrics:
    """The metrics of one encoder process (module docstring). Gauges are 0 until ``watch``."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.items = Counter(
            PREFIX + "encoder_items",
            "Submitted media items by modality and outcome (encoded; cached: no new forward, a cache "
            "hit or joined to an identical item in flight; failed: bad media or an encoder error).",
            ["modality", "outcome"],
            registry=r,
        )
        self.cache_hits = Counter(
            PREFIX + "encoder_cache_hits",
            "Submitted items found in an embedding cache tier.",
            ["tier"],
            registry=r,
        )
        self.cache_misses = Counter(
            PREFIX + "encoder_cache_misses",
            "Submitted items found in no cache tier nor in flight.",
            registry=r,
        )
        self.fetches = Counter(
            PREFIX + "encoder_fetches",
            "Fetch calls by outcome (served; not_found: unknown key; failed: the item failed; "
            "timeout: still encoding at the caller's wait bound).",
            ["outcome"],
            registry=r,
        )
        self.fetch_bytes = Counter(
            PREFIX + "encoder_fetch_bytes", "Embedding bytes streamed to Fetch callers.", registry=r
        )
        self.batch_items = Histogram(
            PREFIX + "encoder_batch_items", "Items per encoder forward.", buckets=BATCH_BUCKETS, registry=r
        )
        self.encode_seconds = Histogram(
            PREFIX + "encoder_encode_seconds",
            "Seconds of one encoder forward (decode and preprocessing included), by modality.",
            ["modality"],
            buckets=ENCODE_BUCKETS,
            registry=r,
        )
        for m in MODALITIES:  # exported from the start (0), so rate() has a base
            for o in OUTCOMES:
                self.items.labels(m, o)
        for t in TIERS:
            self.cache_hits.labels(t)
        for o in FETCH_OUTCOMES:
            self.fetches.labels(o)
        gauges = {
            "queue_items": "Items submitted and waiting for a forward.",
            "running_items": "Items in the forward now.",
            "cache_bytes": "Bytes in this process's embedding cache (entry overheads included).",
            "cache_capacity_bytes": "Capacity of this process's embedding cache, bytes.",
            "cache_entries": "Items in this process's embedding cache.",
            "shm_cache_bytes": "Bytes of the machine's shared-memory embedding cache (blocks in use).",
            "draining": "1 while the encoder refuses submits (shutting down).",
        }
        self.gauges = {k: Gauge(PREFIX + f"encoder_{k}", doc, registry=r) for k, doc in gauges.items()}

    def watch(self, scheduler: Any) -> None:
        """Read the gauges from ``scheduler`` (a ``servicer.EncodeScheduler``) at each scrape, from
        the HTTP thread: reads only (lengths and counters)."""
        s, memory, shm = scheduler, scheduler.memory, scheduler.shm
        read: dict[str, Callable[[], float]] = {
            "queue_items": lambda: len(s.batcher),
            "running_items": lambda: s.running,
            "cache_bytes": lambda: memory.bytes,
            "cache_capacity_bytes": lambda: memory.capacity,
            "cache_entries": lambda: len(memory),
            "shm_cache_bytes": lambda: shm.stats().used_bytes if shm is not None else 0,
            "draining": lambda: 1 if s.draining else 0,
        }
        for name, fn in read.items():
            self.gauges[name].set_function(fn)
