"""Metric families of engine features that only some engines have: MTP speculative decoding
(vLLM's ``spec_decode_*`` counters) and expert parallelism (expert load balance per MoE layer).
Shared by ``serve``'s and the router's collector (``metrics``) and each worker's own port
(``services.worker_metrics``)."""

from __future__ import annotations

from collections.abc import Iterator

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
