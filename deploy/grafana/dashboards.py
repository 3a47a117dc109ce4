"""Generates the Grafana dashboards in this folder (``swaserve-overview.json``) from the rows below.

    python deploy/grafana/dashboards.py           # rewrite the JSON files
    python deploy/grafana/dashboards.py --check   # exit 1 if a file differs from what this makes

Plain dashboard JSON (schemaVersion 39), one Prometheus datasource picked by the ``datasource``
variable, series filtered by the ``model_name`` variable (worker-side transfer series, the
GCache nodes' and the encoders' series carry no ``model_name``). A service that comes later adds its row to ``OVERVIEW`` (or a ``Dashboard`` of its
own to ``DASHBOARDS``); tests/deploy/test_observability.py checks every query of every panel
against exact values, so a new query needs its expected values there.

Queries follow docs/OPERATIONS.md#metrics-for-dashboards: quantiles are ``histogram_quantile`` over
``sum by (le)`` of rates; per-worker gauges, reported by every router, are deduplicated with
``max by (..., worker)`` before they are summed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name=~"$model_name"'  # the model filter of every swaserve series that has the label
R = "[$__rate_interval]"


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    description: str = ""


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]
    width: int = 8  # of 24 columns


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("swaserve",)
    variables: tuple[dict[str, Any], ...] = field(default=())


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99), sel: str = M, name: str = "") -> tuple[tuple[str, str], ...]:  # fmt: skip
    """``histogram_quantile`` targets of ``metric`` (a histogram's base name), legend ``[name ]pNN``."""
    matchers = f"{{{sel}}}" if sel else ""
    return tuple(
        (
            f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{matchers}{R})))",
            f"{name} p{round(q * 100)}".strip(),
        )
        for q in qs
    )


def per_role(metric: str) -> str:
    """Sum per role of a per-worker gauge, each worker once however many routers report it."""
    return f"sum by (role) (max by (role, worker) ({metric}{{{M}}}))"


def p90(metric: str) -> str:
    return f"histogram_quantile(0.9, sum by (le) (rate({metric}_bucket{{{M}}}{R})))"


REQUEST_HELD = (
    f"max by (role, pool) ((swaserve:kv_cache_used_pages{{{M}}} - (swaserve:prefix_cache_pages{{{M}}} "
    f"or swaserve:kv_cache_used_pages{{{M}}} * 0)) / swaserve:kv_cache_total_pages{{{M}}})"
)
HITS = f"rate(swaserve:prefix_cache_hits_total{{{M}}}{R})"
QUERIES = f"rate(swaserve:prefix_cache_queries_total{{{M}}}{R})"

LATENCY = Row(
    "Latency",
    (
        Panel("Time to first token", quantiles("swaserve:time_to_first_token_seconds"), "s",
              "Arrival at the router (or serve) to the first token."),
        Panel("Inter-token latency", quantiles("swaserve:inter_token_latency_seconds"), "s"),
        Panel("End-to-end latency", quantiles("swaserve:e2e_request_latency_seconds"), "s"),
        Panel("Request phases (p90)", (
            (p90("swaserve:request_queue_time_seconds"), "queue"),
            (p90("swaserve:request_prefill_time_seconds"), "prefill"),
            (p90("swaserve:request_decode_time_seconds"), "decode"),
            (p90("swaserve:request_inference_time_seconds"), "inference"),
        ), "s", "Queue, prefill and inference times need the engine's scheduling times: `serve` only. "
                "Behind a router only decode has data."),
    ),
    width=6,
)  # fmt: skip
TRAFFIC = Row(
    "Traffic and tokens",
    (
        Panel("Requests by status (router)",
              ((f"sum by (status) (rate(swaserve:router_requests_total{{{M}}}{R}))", "{{status}}"),), "reqps"),
        Panel("Finished requests by reason",
              ((f"sum by (finished_reason) (rate(swaserve:request_success_total{{{M}}}{R}))",
                "{{finished_reason}}"),), "reqps"),
        Panel("Token throughput", (
            (f"sum(rate(swaserve:prompt_tokens_total{{{M}}}{R}))", "prompt"),
            (f"sum(rate(swaserve:generation_tokens_total{{{M}}}{R}))", "generation"),
        ), "short", "Tokens per second."),
        Panel("Tokens per request",
              quantiles("swaserve:request_prompt_tokens", (0.5, 0.9), name="prompt")
              + quantiles("swaserve:request_generation_tokens", (0.5, 0.9), name="generation")),
    ),
    width=6,
)  # fmt: skip
QUEUES = Row(
    "Queues and workers",
    (
        Panel("Requests waiting", (
            (per_role("swaserve:worker_num_requests_waiting"), "{{role}}"),
            (f"sum(swaserve:num_requests_waiting{{{M}}})", "serve engine (router: 0)"),
        ), description="Per role: the workers' queues as the routers last polled them."),
        Panel("Requests running", (
            (per_role("swaserve:worker_num_requests_running"), "{{role}}"),
            (f"sum(swaserve:num_requests_running{{{M}}})", "in flight (router) / running (serve)"),
        )),
        Panel("Workers up and draining", (
            (per_role("swaserve:worker_up"), "{{role}} up"),
            (per_role("swaserve:worker_draining"), "{{role}} draining"),
        )),
        Panel("Outstanding tokens per worker",
              ((f"max by (role, worker) (swaserve:worker_outstanding_tokens{{{M}}})", "{{role}} {{worker}}"),),
              description="Prompt tokens not computed yet plus tokens still to generate: the load routing sees."),
        Panel("Requests per worker", (
            (f"max by (role, worker) (swaserve:worker_num_requests_running{{{M}}})", "{{worker}} running"),
            (f"max by (role, worker) (swaserve:worker_num_requests_waiting{{{M}}})", "{{worker}} waiting"),
        )),
        Panel("Dispatches per worker",
              ((f"sum by (role, worker) (rate(swaserve:router_dispatches_total{{{M}}}{R}))", "{{role}} {{worker}}"),),
              "reqps", "Attempts the routers sent to each worker (retries included)."),
    ),
)  # fmt: skip
KV = Row(
    "KV cache",
    (
        Panel("KV usage by role and pool (fullest worker)",
              ((f"max by (role, pool) (swaserve:kv_cache_usage_perc{{{M}}})", "{{role}} {{pool}}"),),
              "percentunit", "Pages not free, prefix-cache pages included (they are evicted on demand)."),
        Panel("KV held by requests (fullest worker)", ((REQUEST_HELD, "{{role}} {{pool}}"),), "percentunit",
              "Used pages less the prefix cache's, over the pool: what the KV alert watches."),
        Panel("KV usage per worker",
              ((f"max by (role, worker, pool) (swaserve:kv_cache_usage_perc{{{M}}})",
                "{{role}} {{worker}} {{pool}}"),), "percentunit"),
        Panel("Prefix cache hit rate by tier", (
            (f"sum by (tier) ({HITS}) / ignoring (tier) group_left sum({QUERIES})", "{{tier}}"),
            (f"sum({HITS}) / sum({QUERIES})", "total"),
        ), "percentunit", "Prompt tokens served from the cache over prompt tokens looked up."),
        Panel("Prefix cache pages per worker",
              ((f"max by (role, worker, pool) (swaserve:prefix_cache_pages{{{M}}})",
                "{{role}} {{worker}} {{pool}}"),)),
        Panel("KV staged on decode workers",
              ((f'max by (worker) (swaserve:worker_kv_staged_bytes{{{M},role="decode"}})', "{{worker}}"),),
              "bytes", "Received from prefill workers, not admitted yet."),
    ),
)  # fmt: skip
ROUTER = Row(
    "Router",
    (
        Panel("Retries and resumes by reason",
              ((f"sum by (reason) (rate(swaserve:router_retries_total{{{M}}}{R}))", "{{reason}}"),), "reqps",
              "resumed: failed after decode output started, resumed on another worker."),
        Panel("Routing decisions",
              ((f"sum by (reason) (rate(swaserve:router_decisions_total{{{M}}}{R}))", "{{reason}}"),), "reqps"),
        Panel("Prefix index entries", ((f"swaserve:router_index_entries{{{M}}}", "{{instance}}"),)),
        Panel("Shared state (Redis) up", ((f"swaserve:router_shared_state_up{{{M}}}", "{{instance}}"),),
              description="Only with Redis."),
    ),
    width=6,
)  # fmt: skip
TRANSFER = Row(
    "KV transfer (workers)",
    (
        Panel("KV transfer throughput", (
            (f"sum(rate(swaserve:kv_transfer_sent_bytes_total{R}))", "sent (prefill)"),
            (f"sum(rate(swaserve:kv_transfer_received_bytes_total{R}))", "received (decode)"),
        ), "Bps", "Worker series: no model_name label."),
        Panel("KV bytes per request", quantiles("swaserve:kv_transfer_request_bytes", (0.5, 0.9), sel=""), "bytes"),
        Panel("Transfer failures and index events", (
            (f"sum(rate(swaserve:kv_transfer_failed_total{R}))", "failed transfers"),
            (f"sum by (outcome) (rate(swaserve:index_events_total{R}))", "index events {{outcome}}"),
        ), "short", "Per second. Index events: precise index mode only."),
    ),
)  # fmt: skip

GC_HITS = f"sum by (kind) (rate(swaserve:gcache_hits_total{R}))"
GC_LOOKUPS = f"({GC_HITS} + sum by (kind) (rate(swaserve:gcache_misses_total{R})))"
GCACHE = Row(
    "GCache (L3 KV cache nodes)",
    (
        Panel("GCache lookup hit rate",
              ((f"{GC_HITS} / {GC_LOOKUPS}", "{{kind}}"),), "percentunit",
              "Pages a lookup found over pages looked up, all nodes (node series: no model_name label). "
              "What it saved the prefill workers: the l3 tier of the prefix cache hit rate."),
        Panel("GCache tier usage",
              (("sum by (tier) (swaserve:gcache_used_bytes) / sum by (tier) (swaserve:gcache_capacity_bytes)",
                "{{tier}}"),), "percentunit", "Bytes of the tier's slots in use over its capacity, all nodes."),
        Panel("GCache pages per node",
              (("sum by (instance, tier) (swaserve:gcache_pages)", "{{instance}} {{tier}}"),
               ("sum by (instance, tier) (swaserve:gcache_leased_pages)", "{{instance}} {{tier}} leased")),
              description="Pages stored, and those under a read lease (neither evicted nor moved)."),
        Panel("GCache throughput", (
            (f"sum(rate(swaserve:gcache_bytes_read_total{R}))", "read"),
            (f"sum(rate(swaserve:gcache_bytes_written_total{R}))", "written"),
        ), "Bps", "Page object bytes served and stored, all nodes and tiers."),
        Panel("GCache operation latency", (
            (f"histogram_quantile(0.5, sum by (le, op) (rate(swaserve:gcache_op_seconds_bucket{R})))", "{{op}} p50"),
            (f"histogram_quantile(0.99, sum by (le, op) (rate(swaserve:gcache_op_seconds_bucket{R})))", "{{op}} p99"),
        ), "s", "Seconds a node spends on one request (gRPC and UCX together)."),
        Panel("GCache evictions and tier moves", (
            (f"sum by (tier) (rate(swaserve:gcache_evictions_total{R}))", "evicted from {{tier}}"),
            (f"sum(rate(swaserve:gcache_demotions_total{R}))", "demoted to NVMe"),
            (f"sum(rate(swaserve:gcache_promotions_total{R}))", "promoted to DRAM"),
        ), "short", "Pages per second."),
        Panel("GCache refusals and faults", (
            (f"sum(rate(swaserve:gcache_put_refused_total{R}))", "puts refused (full)"),
            (f"sum(rate(swaserve:gcache_put_no_parent_total{R}))", "puts without parent"),
            (f"sum(rate(swaserve:gcache_put_zombies_total{R}))", "puts never committed"),
            (f"sum(rate(swaserve:gcache_lease_expired_total{R}))", "leases expired"),
            (f"sum(rate(swaserve:gcache_corrupt_pages_total{R}))", "corrupt pages"),
            (f"sum by (tier) (rate(swaserve:gcache_io_errors_total{R}))", "{{tier}} I/O errors"),
        ), "short", "Pages per second. Corrupt pages are deleted, never served; I/O errors (a full or "
           "failing disk) cost the page and pause the NVMe tier for 30 s."),
        Panel("L3 fetches lost, prefill side", (
            (f"sum by (reason) (rate(swaserve:l3_fetches_lost_total{{{M}}}{R}))", "lost: {{reason}}"),
            (f"sum by (op) (rate(swaserve:l3_node_errors_total{{{M}}}{R}))", "node {{op}} failed"),
            (f"sum(rate(swaserve:l3_put_errors_total{{{M}}}{R}))", "puts failed"),
        ), "short", "Per second, from the prefill workers: L3 fetches that ended without a hit (each "
           "costs only its hit), failed operations on one node, failed writes. A steady rise: a node "
           "or the network is in trouble."),
        Panel("GCache nodes serving and draining", (
            ("sum(1 - swaserve:gcache_draining)", "serving"),
            ("sum(swaserve:gcache_draining)", "draining"),
        ), description="Nodes scraped: draining ones refuse puts and leave the registry when they stop."),
    ),
    width=6,
)  # fmt: skip

ENC_HITS = f"rate(swaserve:encoder_cache_hits_total{R})"
ENC_LOOKUPS = f"(sum({ENC_HITS}) + sum(rate(swaserve:encoder_cache_misses_total{R})))"
ENCODER = Row(
    "Media encoders",
    (
        Panel("Encoder items by modality and outcome",
              ((f"sum by (modality, outcome) (rate(swaserve:encoder_items_total{R}))", "{{modality}} {{outcome}}"),),
              "short", "Media items per second submitted to the encoders (encoder series: no model_name label): "
                       "encoded (a forward), cached (no new forward: a cache hit or joined to an identical item "
                       "in flight), failed (the media did not decode, or the forward failed)."),
        Panel("Encoder batch size", quantiles("swaserve:encoder_batch_items", (0.5, 0.9), sel=""), "short",
              "Items per encoder forward: how much the encoders fuse the items of different requests."),
        Panel("Encoder queue", (
            ("sum by (instance) (swaserve:encoder_queue_items)", "{{instance}} queued"),
            ("sum by (instance) (swaserve:encoder_running_items)", "{{instance}} running"),
        ), description="Items waiting for a forward and in the forward now, per encoder (what the "
                        "autoscaler and the backlog alert read)."),
        Panel("Encoder cache hit ratio by tier", (
            (f"sum by (tier) ({ENC_HITS}) / ignoring (tier) group_left () {ENC_LOOKUPS}", "{{tier}}"),
            (f"sum({ENC_HITS}) / {ENC_LOOKUPS}", "total"),
        ), "percentunit", "Submitted items found in the process's memory tier or the shared-memory tier, over "
                          "the items looked up (items joined to one in flight are neither)."),
        Panel("Encode latency by modality", (
            (f"histogram_quantile(0.5, sum by (le, modality) (rate(swaserve:encoder_encode_seconds_bucket{R})))",
             "{{modality}} p50"),
            (f"histogram_quantile(0.9, sum by (le, modality) (rate(swaserve:encoder_encode_seconds_bucket{R})))",
             "{{modality}} p90"),
        ), "s", "Seconds of one encoder forward, media decoding and preprocessing included."),
        Panel("Embedding fetch throughput",
              ((f"sum(rate(swaserve:encoder_fetch_bytes_total{R}))", "fetched by prefill workers"),), "Bps",
              "Embedding bytes the encoders streamed to prefill workers."),
        Panel("Media fetch failures", (
            (f"sum(rate(swaserve:media_fetch_failed_total{R}))", "prefill: requests failed"),
            (f'sum by (outcome) (rate(swaserve:encoder_fetches_total{{outcome!="served"}}{R}))',
             "encoder: fetches {{outcome}}"),
        ), "short", "Per second. A request whose embeddings a prefill worker could not fetch is retried "
                    "elsewhere with its items submitted again; the encoders' side by outcome."),
        Panel("Encoder cache size", (
            ("sum by (instance) (swaserve:encoder_cache_bytes)", "{{instance}} memory"),
            ("sum by (instance) (swaserve:encoder_shm_cache_bytes)", "{{instance}} shared memory"),
        ), "bytes", "Bytes held by each encoder's memory tier and its shared-memory tier."),
    ),
    width=6,
)  # fmt: skip

DRAFTS = f"sum(rate(swaserve:spec_decode_num_drafts_total{{{M}}}{R}))"
SPEC = Row(
    "Speculative decoding (MTP)",
    (
        Panel("Mean accept length",
              ((f"1 + sum(rate(swaserve:spec_decode_num_accepted_tokens_total{{{M}}}{R})) / {DRAFTS}", "mean"),),
              "short", "Tokens per verify step, the bonus token included (1 = no draft accepted)."),
        Panel("Acceptance by draft position",
              ((f"sum by (position) (rate(swaserve:spec_decode_num_accepted_tokens_per_pos_total{{{M}}}{R}))"
                f" / ignoring (position) group_left {DRAFTS}", "draft {{position}}"),),
              "percentunit", "Fraction of verify steps that accepted the draft at each position."),
        Panel("Drafts", (
            (DRAFTS, "verify steps"),
            (f"sum(rate(swaserve:spec_decode_num_draft_tokens_total{{{M}}}{R}))", "draft tokens"),
            (f"sum(rate(swaserve:spec_decode_num_accepted_tokens_total{{{M}}}{R}))", "accepted"),
        ), "short", "Per second, from `serve` or the decode workers' own /metrics."),
    ),
)  # fmt: skip

EP_MEAN = f"rate(swaserve:ep_expert_tokens_mean_total{{{M}}}{R})"
EP_MAX = f"rate(swaserve:ep_expert_tokens_max_total{{{M}}}{R})"
EP_BY_LAYER = f"sum by (layer) ({EP_MEAN}) / sum by (layer) ({EP_MAX})"
EP = Row(
    "Expert parallelism",
    (
        Panel("Expert load balance per layer", ((EP_BY_LAYER, "layer {{layer}}"),), "percentunit",
              "Per MoE layer over the window: mean / max (token, expert) rows per EP rank, token-weighted over "
              "the steps and the EP instances (prefill workers' own series, or serve); 1 = even. A layer's "
              "experts run at this share of what an even split would give."),
        Panel("Expert load balance, mean over layers", (
            (f"avg({EP_BY_LAYER})", "all instances"),
            (f"avg by (worker) (sum by (worker, layer) ({EP_MEAN}) / sum by (worker, layer) ({EP_MAX}))",
             "{{worker}}"),
        ), "percentunit", "The per-layer balance over the window averaged over the MoE layers, for all EP "
                          "instances together and per instance (worker)."),
        Panel("Expert load balance since start", (
            (f"min by (layer) (swaserve:ep_expert_balance{{{M}}})", "layer {{layer}} (lowest instance)"),
            (f"avg by (worker) (swaserve:ep_expert_balance{{{M}}})", "{{worker}} mean over layers"),
        ), "percentunit", "Each instance's balance since it started (a gauge): per layer the lowest instance, "
                          "and per instance the mean over its layers."),
    ),
)  # fmt: skip

VARIABLES: tuple[dict[str, Any], ...] = (
    {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
     "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": ""},
    {"name": "model_name", "label": "Model", "type": "query", "datasource": DS,
     "query": "label_values(swaserve:num_requests_running, model_name)",
     "definition": "label_values(swaserve:num_requests_running, model_name)",
     "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True, "options": [],
     "refresh": 2, "regex": "", "sort": 1},
)  # fmt: skip

OVERVIEW = Dashboard(
    "swaserve-overview",
    "swaserve overview",
    (LATENCY, TRAFFIC, QUEUES, KV, SPEC, EP, ROUTER, TRANSFER, GCACHE, ENCODER),
    variables=VARIABLES,
)
DASHBOARDS = {"swaserve-overview.json": OVERVIEW}


def render(d: Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model: a row panel per row, then its panels left to right, 8 high."""
    panels: list[dict[str, Any]] = []
    y = 0
    for row in d.rows:
        panels.append({"id": len(panels) + 1, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        y += 1
        per_line = 24 // row.width
        for i, p in enumerate(row.panels):
            x = (i % per_line) * row.width
            if i and x == 0:
                y += 8
            targets = [
                {
                    "refId": chr(ord("A") + k),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": True,
                }
                for k, (expr, legend) in enumerate(p.targets)
            ]
            panels.append({
                "id": len(panels) + 1, "type": "timeseries", "title": p.title, "description": p.description,
                "datasource": DS, "gridPos": {"h": 8, "w": row.width, "x": x, "y": y},
                "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "none"}},
                "targets": targets,
            })  # fmt: skip
        y += 8
    return {
        "uid": d.uid, "title": d.title, "tags": list(d.tags), "editable": True, "graphTooltip": 1,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser", "annotations": {"list": []}, "templating": {"list": list(d.variables)},
        "panels": panels,
    }  # fmt: skip


def dump(d: Dashboard) -> str:
    return json.dumps(render(d), indent=2) + "\n"


def main(argv: list[str]) -> int:
    stale = []
    for name, d in DASHBOARDS.items():
        path = HERE / name
        text = dump(d)
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"out of date (run python {Path(__file__).relative_to(HERE.parents[1])}): {', '.join(stale)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
