"""Metric families of engine features that only some engines have: MTP speculative decoding
(vLLM's ``spec_decode_*`` counters), expert parallelism (expert load balance per MoE layer) and
the L3 KV tier (GCache: lookups, fetches, losses, puts).
Shared by ``serve``'s and the router's collector (``metrics``) and each worker's own port
(``services.worker_metrics``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from swaserve.engine.spec import SpecStats
from swaserve.model.ep_stats import EPStats

PREFIX = "swaserve:"


def spec_families(sp: SpecStats, labels: dict[str, str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters with ``labels`` (mean accept length = 1 + accepted /
    drafts); ``..._per_pos`` adds ``position`` (0: the first draft)."""
    names, values = list(labels), list(labels.values())
    for name, doc, n in (
        ("spec_decode_num_drafts", "Verify steps with drafts.", sp.drafts),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed.", sp.draft_tokens),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", sp.accepted),
    ):
        fam = CounterMetricFamily(PREFIX + name, doc, labels=names)
        fam.add_metric(values, n)
        yield fam
    per = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by draft position (0: the first draft).",
        labels=[*names, "position"],
    )
    for i, n in enumerate(sp.accepted_per_pos):
        per.add_metric([*values, str(i)], n)
    yield per


def ep_families(ep: EPStats, labels: dict[str, str]) -> Iterator[Metric]:
    """Expert load per MoE layer (``layer``: its index among the MoE layers) of an EP instance:
    sums over steps of the mean and of the max (token, expert) rows per rank, whose ratio over a
    window (``rate(mean) / rate(max)``) is the token-weighted balance, 1 = even (SGLang's
    ``compute_utilization_rate``); and that ratio since start as a gauge."""
    names, values = [*labels, "layer"], list(labels.values())
    mean = CounterMetricFamily(
        PREFIX + "ep_expert_tokens_mean", "Sum over steps of the mean expert rows per EP rank.", labels=names
    )
    top = CounterMetricFamily(
        PREFIX + "ep_expert_tokens_max", "Sum over steps of the max expert rows per EP rank.", labels=names
    )
    bal = GaugeMetricFamily(
        PREFIX + "ep_expert_balance",
        "Expert load balance since start: mean / max expert rows per EP rank (1 = even).",
        labels=names,
    )
    for layer, (m, x, b) in enumerate(zip(ep.mean_sum, ep.max_sum, ep.balance(), strict=True)):
        mean.add_metric([*values, str(layer)], m)
        top.add_metric([*values, str(layer)], x)
        bal.add_metric([*values, str(layer)], b)
    yield from (mean, top, bal)


# L3Tier.stats key -> (metric, help); lost_<reason> -> l3_fetches_lost_total{reason}
L3_COUNTERS = {
    "lookups": ("l3_lookups", "L3 lookups started (a prompt that could gain --l3-min-tokens)."),
    "lookup_misses": ("l3_lookup_misses", "L3 lookups that found nothing worth fetching."),
    "fetched_pages": ("l3_fetched_pages", "KV pages fetched from L3 into the host tier."),
    "fetched_tokens": ("l3_fetched_tokens", "Prompt tokens whose KV was fetched from L3."),
    "corrupt_pages": ("l3_corrupt_pages", "Pages fetched from L3 that failed their checks (not used)."),
    "unfulfilled_staging_full": (
        "l3_unfetched_host_full_tokens",
        "Prompt tokens L3 held but no fetch took: no host-tier room for them.",
    ),
    "put_pages": ("l3_put_pages", "KV pages written to L3."),
    "put_errors": ("l3_put_errors", "L3 writes that failed (node unreachable, refused, timed out)."),
    "puts_dropped": ("l3_puts_dropped", "L3 writes not attempted: the write backlog was full."),
}


def l3_families(l3: Mapping[str, int], labels: dict[str, str]) -> Iterator[Metric]:
    """The L3 tier's counters (``engine.l3_tier.L3Tier.stats``) with ``labels``: a fetch that
    failed or ran out of time costs only its hit, so these are how an operator sees L3 trouble."""
    names, values = list(labels), list(labels.values())
    for key, (name, doc) in L3_COUNTERS.items():
        fam = CounterMetricFamily(PREFIX + name, doc, labels=names)
        fam.add_metric(values, l3.get(key, 0))
        yield fam
    lost = CounterMetricFamily(
        PREFIX + "l3_fetches_lost",
        "L3 fetches that ended without a hit, by reason (error: a node failed; deadline: "
        "--l3-timeout-s ran out; missing, corrupt: pages gone or bad between lookup and read).",
        labels=[*names, "reason"],
    )
    for reason in ("error", "deadline", "missing", "corrupt"):
        lost.add_metric([*values, reason], l3.get(f"lost_{reason}", 0))
    yield lost
    nodes = CounterMetricFamily(
        PREFIX + "l3_node_errors",
        "Operations on one GCache node that failed (it answers absent meanwhile), by operation.",
        labels=[*names, "op"],
    )
    for op in ("lookup", "get", "put", "remove"):
        nodes.add_metric([*values, op], l3.get(f"node_errors_{op}", 0))
    yield nodes
