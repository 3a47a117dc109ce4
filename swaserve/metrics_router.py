"""The router's metric families: its request outcomes, retries, routing decisions and dispatches,
its workers as it last saw them (up, draining, load), the prefix index, Redis, Kubernetes discovery
and media encoders. The snapshot types (``RouterStats`` and its parts) are filled by
``services.router``; ``metrics.EngineStatsCollector`` adds these families when it has a router."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from swaserve.kvcache.stats import PoolStats
from swaserve.metrics_engine import PREFIX

WORKER_LABEL = "worker"
"""The router's label for the worker a per-worker series is about (``host:port``). Not ``instance``:
Prometheus sets ``instance`` to the scraped target (the router) and would rename ours
``exported_instance``."""

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


def _encoder_families(model: str, encoders: tuple[EncoderStats, ...]) -> Iterator[Metric]:
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
        up.add_metric([model, e.address], int(e.up))
        load.add_metric([model, e.address], e.load)
    yield up
    yield load
    yield _counter(
        model,
        "router_encoder_items",
        "Media items this router submitted to each encoder.",
        ["encoder"],
        (((e.address,), e.submitted) for e in encoders),
    )


def _discovery_families(model: str, d: DiscoveryStats) -> Iterator[Metric]:
    yield _counter(
        model,
        "router_discovery_events",
        "Pod watch events of Kubernetes discovery, by type (ADDED, MODIFIED, DELETED, BOOKMARK).",
        ["type"],
        (((t,), d.events.get(t, 0)) for t in DISCOVERY_EVENTS),
    )
    yield _counter(
        model,
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
        workers.add_metric([model, role], n)
    yield workers


def _counter(
    model: str, name: str, doc: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], int]]
) -> Metric:
    """One counter family over ``(label values, count)`` pairs (``model_name`` added first)."""
    fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", *labels])
    for key, n in values:
        fam.add_metric([model, *key], n)
    return fam


def _router_families(model: str, r: RouterStats) -> Iterator[Metric]:
    yield _counter(
        model,
        "router_requests",
        "Requests the router finished, by status (ok, invalid, unavailable, failed, cancelled).",
        ["status"],
        (((s,), r.requests.get(s, 0)) for s in ROUTER_STATUSES),
    )
    yield _counter(
        model,
        "router_retries",
        "Re-dispatches of a request to other workers, by reason (overloaded, unavailable, worker_down, "
        "error, resumed: after decode output started).",
        ["reason"],
        (((x,), r.retries.get(x, 0)) for x in RETRY_REASONS),
    )
    yield _counter(
        model,
        "router_decisions",
        "Prefill choices by reason: affinity (cache hit), load, balance (guard overrode the cache), "
        "round_robin; _fallback when no worker's length bucket held the prompt.",
        ["reason"],
        (((x,), n) for x, n in sorted(r.decisions.items())),
    )
    yield _counter(
        model,
        "router_dispatches",
        "Attempts sent to each worker by this router.",
        ["role", WORKER_LABEL],
        sorted(({(w.role, w.instance): 0 for w in r.workers} | r.dispatches).items()),  # 0 from the start
    )
    index = GaugeMetricFamily(
        PREFIX + "router_index_entries", "Prefix index entries (block, instance).", labels=["model_name"]
    )
    index.add_metric([model], r.index_entries)
    yield index
    if r.shared_state_up is not None:
        up = GaugeMetricFamily(
            PREFIX + "router_shared_state_up",
            "1 if the shared routing state (Redis) answered at the last call.",
            labels=["model_name"],
        )
        up.add_metric([model], int(r.shared_state_up))
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
            fam.add_metric([model, w.role, w.instance], values[key])
    yield from families.values()


def router_families(r: RouterStats, model: str) -> Iterator[Metric]:
    """Every router family of snapshot ``r`` (``model``: the ``model_name`` label)."""
    yield from _router_families(model, r)
    if r.discovery is not None:
        yield from _discovery_families(model, r.discovery)
    if r.encoders:
        yield from _encoder_families(model, r.encoders)
