"""Synthetic series for the dashboard queries and the exact values each query must return on them
(tests/deploy/test_observability.py runs them through ``promtool test rules``).

Model ``m``: routers r1 and r2 (both report the same workers p1, p2 prefill and d1 decode), a
``serve`` process s1, prefill worker w1 and decode worker w2 (transfer series, no ``model_name``),
GCache nodes g1 and g2 and media encoders e1 and e2 (their own series, no ``model_name``), EP prefill
workers x1 and x2 (their own port: ``model_name``, ``role``, ``worker``; two MoE layers).
Every ``model_name="m"`` series also exists for a model ``other`` with other values (gauges and
counters x3, histograms with all observations in the first bucket): a query that forgets the
``$model_name`` filter gets other numbers. Counters grow linearly from 0, one sample a minute, so a
5m rate is the per-minute increase / 60. Quantile arithmetic is in the comments (rank = q x total
rate, linear inside the bucket holding it); ``(f64)`` marks a value float64 arithmetic rounds.
"""

from __future__ import annotations

R1 = {"job": "router", "instance": "r1:8000", "model_name": "m"}
R2 = {"job": "router", "instance": "r2:8000", "model_name": "m"}
S1 = {"job": "serve", "instance": "s1:8000", "model_name": "m"}
WP = {"job": "prefill", "instance": "w1:9090"}
WD = {"job": "decode", "instance": "w2:9090"}
P1 = {"role": "prefill", "worker": "p1"}
P2 = {"role": "prefill", "worker": "p2"}
D1 = {"role": "decode", "worker": "d1"}
G1 = {"job": "gcache", "instance": "g1:9090"}  # GCache nodes: no model_name
G2 = {"job": "gcache", "instance": "g2:9090"}
E1 = {"job": "encoder", "instance": "e1:9090"}  # media encoders: no model_name
E2 = {"job": "encoder", "instance": "e2:9090"}
# EP prefill workers (their own port)
X1 = {"job": "prefill", "instance": "x1:9090", "model_name": "m", "role": "prefill", "worker": "p1"}
X2 = {"job": "prefill", "instance": "x2:9090", "model_name": "m", "role": "prefill", "worker": "p2"}

Series = tuple[str, dict[str, str], str, float]  # (metric, labels, kind: counter|gauge|bucket, value)


def _c(name: str, per_min: float, **labels: str) -> Series:
    return (name, labels, "counter", per_min)


def _g(name: str, value: float, **labels: str) -> Series:
    return (name, labels, "gauge", value)


def _h(name: str, buckets: dict[str, float], **labels: str) -> list[Series]:
    """A histogram's ``_bucket`` series: cumulative per-minute increments by ``le``."""
    return [(f"{name}_bucket", {**labels, "le": le}, "bucket", n) for le, n in buckets.items()]


def _kv(where: dict[str, str], pool: str, usage: float, used: int, cached: int | None) -> list[Series]:
    out = [
        _g("swaserve:kv_cache_usage_perc", usage, **where, pool=pool),
        _g("swaserve:kv_cache_used_pages", used, **where, pool=pool),
        _g("swaserve:kv_cache_total_pages", 64, **where, pool=pool),
    ]
    if cached is not None:
        out.append(_g("swaserve:prefix_cache_pages", cached, **where, pool=pool))
    return out


SERIES: list[Series] = [
    *_h("swaserve:time_to_first_token_seconds", {"0.5": 0, "1.0": 60, "2.5": 120, "5.0": 240, "+Inf": 240}, **R1),
    *_h("swaserve:inter_token_latency_seconds", {"0.05": 0, "0.1": 60, "0.2": 120, "+Inf": 120}, **R1),
    *_h("swaserve:e2e_request_latency_seconds", {"1.0": 60, "2.0": 180, "5.0": 240, "+Inf": 240}, **R1),
    *_h("swaserve:request_queue_time_seconds", {"0.5": 60, "1.0": 120, "+Inf": 120}, **S1),
    *_h("swaserve:request_prefill_time_seconds", {"0.5": 0, "1.0": 120, "+Inf": 120}, **S1),
    *_h("swaserve:request_decode_time_seconds", {"1.0": 0, "2.0": 60, "+Inf": 60}, **R1),
    *_h("swaserve:request_inference_time_seconds", {"2.0": 0, "5.0": 60, "+Inf": 60}, **S1),
    *_h("swaserve:request_prompt_tokens", {"10.0": 0, "20.0": 60, "50.0": 120, "+Inf": 120}, **R1),
    *_h("swaserve:request_generation_tokens", {"5.0": 60, "10.0": 120, "+Inf": 120}, **R1),
    *_h("swaserve:kv_transfer_request_bytes", {"1024.0": 0, "4096.0": 60, "16384.0": 120, "+Inf": 120}, **WP),
    _c("swaserve:router_requests_total", 300, **R1, status="ok"),
    _c("swaserve:router_requests_total", 300, **R2, status="ok"),
    _c("swaserve:router_requests_total", 60, **R1, status="failed"),
    _c("swaserve:request_success_total", 240, **R1, finished_reason="stop"),
    _c("swaserve:request_success_total", 120, **R1, finished_reason="length"),
    _c("swaserve:request_success_total", 60, **S1, finished_reason="stop"),
    _c("swaserve:prompt_tokens_total", 1200, **R1),
    _c("swaserve:prompt_tokens_total", 600, **S1),
    _c("swaserve:generation_tokens_total", 600, **R1),
    _c("swaserve:prefix_cache_queries_total", 600, **R1),
    _c("swaserve:prefix_cache_hits_total", 300, **R1, tier="device"),
    _c("swaserve:prefix_cache_hits_total", 60, **R1, tier="host"),
    _c("swaserve:router_retries_total", 60, **R1, reason="overloaded"),
    _c("swaserve:router_retries_total", 12, **R2, reason="resumed"),
    _c("swaserve:router_decisions_total", 180, **R1, reason="affinity"),
    _c("swaserve:router_decisions_total", 60, **R1, reason="load"),
    _c("swaserve:router_dispatches_total", 120, **R1, **P1),
    _c("swaserve:router_dispatches_total", 120, **R2, **P1),
    _c("swaserve:router_dispatches_total", 240, **R1, **D1),
    _c("swaserve:kv_transfer_sent_bytes_total", 6000, **WP),
    _c("swaserve:kv_transfer_received_bytes_total", 6000, **WD),
    _c("swaserve:kv_transfer_failed_total", 0, **WP),
    _c("swaserve:kv_transfer_failed_total", 6, **WD),
    _c("swaserve:index_events_total", 600, **WP, outcome="published"),
    _c("swaserve:index_events_total", 0, **WP, outcome="dropped"),
    # per-worker gauges from both routers (r2's poll of p1 is older: the max is r1's)
    *(_g("swaserve:worker_num_requests_waiting", v, **r, **w) for r in (R1, R2) for w, v in ((P1, 3), (P2, 2), (D1, 1))),
    *(_g("swaserve:num_requests_waiting", v, **w) for w, v in ((R1, 0), (R2, 0), (S1, 4))),
    _g("swaserve:worker_num_requests_running", 4, **R1, **P1),
    _g("swaserve:worker_num_requests_running", 3, **R2, **P1),
    _g("swaserve:worker_num_requests_running", 0, **R1, **P2),
    _g("swaserve:worker_num_requests_running", 6, **R1, **D1),
    _g("swaserve:worker_num_requests_running", 6, **R2, **D1),
    *(_g("swaserve:num_requests_running", v, **w) for w, v in ((R1, 7), (R2, 2), (S1, 1))),
    _g("swaserve:worker_up", 0, **R1, **P1),
    _g("swaserve:worker_up", 1, **R2, **P1),
    _g("swaserve:worker_up", 0, **R1, **P2),
    _g("swaserve:worker_up", 0, **R2, **P2),
    _g("swaserve:worker_up", 1, **R1, **D1),
    _g("swaserve:worker_up", 1, **R2, **D1),
    *(_g("swaserve:worker_draining", v, **R1, **w) for w, v in ((P1, 0), (P2, 1), (D1, 0))),
    _g("swaserve:worker_outstanding_tokens", 100, **R1, **P1),
    _g("swaserve:worker_outstanding_tokens", 80, **R2, **P1),
    _g("swaserve:worker_outstanding_tokens", 50, **R1, **P2),
    _g("swaserve:worker_outstanding_tokens", 300, **R1, **D1),
    *_kv({**R1, **D1}, "full", 0.96875, 62, 2),
    *_kv({**R1, **D1}, "swa", 0.5, 32, 0),
    *_kv({**R1, **P1}, "full", 0.25, 16, 8),
    *_kv({**R1, **P1}, "swa", 0.125, 8, 0),
    *_kv({**R1, **P2}, "full", 0.75, 48, 40),
    *_kv({**R1, **P2}, "swa", 0.375, 24, 0),
    *_kv(S1, "full", 0.5, 32, 16),  # serve: no role or worker
    *_kv(S1, "swa", 0.25, 16, None),  # no cache series: nothing subtracted
    _g("swaserve:prefix_cache_pages", 100, **S1, pool="host_full"),  # the host tier: no pool to match
    _g("swaserve:worker_kv_staged_bytes", 1024, **R1, **D1),
    _g("swaserve:worker_kv_staged_bytes", 1024, **R2, **D1),
    _g("swaserve:worker_kv_staged_bytes", 0, **R1, **P1),
    _g("swaserve:router_index_entries", 100, **R1),
    _g("swaserve:router_index_entries", 120, **R2),
    _g("swaserve:router_shared_state_up", 1, **R1),
    _g("swaserve:router_shared_state_up", 0, **R2),
    # MTP: a decode worker's own counters (model_name, role, worker) and serve's
    _c("swaserve:spec_decode_num_drafts_total", 120, **WD, model_name="m", **D1),
    _c("swaserve:spec_decode_num_drafts_total", 60, **S1),
    _c("swaserve:spec_decode_num_draft_tokens_total", 360, **WD, model_name="m", **D1),
    _c("swaserve:spec_decode_num_draft_tokens_total", 180, **S1),
    _c("swaserve:spec_decode_num_accepted_tokens_total", 240, **WD, model_name="m", **D1),
    _c("swaserve:spec_decode_num_accepted_tokens_total", 60, **S1),
    *(_c("swaserve:spec_decode_num_accepted_tokens_per_pos_total", v, **WD, model_name="m", **D1, position=str(i))
      for i, v in enumerate((120, 72, 48))),
    *(_c("swaserve:spec_decode_num_accepted_tokens_per_pos_total", v, **S1, position=str(i))
      for i, v in enumerate((30, 18, 12))),
    # GCache nodes g1 (DRAM + NVMe) and g2 (DRAM only, draining)
    _c("swaserve:gcache_hits_total", 300, **G1, tier="any", kind="full"),
    _c("swaserve:gcache_hits_total", 60, **G1, tier="any", kind="swa"),
    _c("swaserve:gcache_hits_total", 120, **G2, tier="any", kind="full"),
    _c("swaserve:gcache_misses_total", 180, **G1, tier="any", kind="full"),
    _c("swaserve:gcache_misses_total", 60, **G1, tier="any", kind="swa"),
    _c("swaserve:gcache_misses_total", 0, **G2, tier="any", kind="full"),
    _g("swaserve:gcache_used_bytes", 600, **G1, tier="dram"),
    _g("swaserve:gcache_used_bytes", 1000, **G1, tier="nvme"),
    _g("swaserve:gcache_used_bytes", 200, **G2, tier="dram"),
    _g("swaserve:gcache_capacity_bytes", 1000, **G1, tier="dram"),
    _g("swaserve:gcache_capacity_bytes", 4000, **G1, tier="nvme"),
    _g("swaserve:gcache_capacity_bytes", 1000, **G2, tier="dram"),
    _g("swaserve:gcache_pages", 30, **G1, tier="dram"),
    _g("swaserve:gcache_pages", 50, **G1, tier="nvme"),
    _g("swaserve:gcache_pages", 10, **G2, tier="dram"),
    _g("swaserve:gcache_leased_pages", 3, **G1, tier="dram"),
    _g("swaserve:gcache_leased_pages", 0, **G1, tier="nvme"),
    _g("swaserve:gcache_leased_pages", 1, **G2, tier="dram"),
    _c("swaserve:gcache_bytes_read_total", 6000, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_bytes_read_total", 3000, **G2, tier="dram", kind="full"),
    _c("swaserve:gcache_bytes_written_total", 1200, **G1, tier="dram", kind="full"),
    *_h("swaserve:gcache_op_seconds", {"0.001": 0, "0.0025": 60, "0.005": 120, "+Inf": 120}, **G1, op="lookup", transport="grpc"),
    *_h("swaserve:gcache_op_seconds", {"0.01": 0, "0.025": 60, "+Inf": 60}, **G2, op="get", transport="ucx"),
    _c("swaserve:gcache_evictions_total", 120, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_evictions_total", 60, **G1, tier="nvme", kind="full"),
    _c("swaserve:gcache_demotions_total", 180, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_promotions_total", 30, **G1, tier="nvme", kind="full"),
    _c("swaserve:gcache_put_refused_total", 60, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_put_no_parent_total", 12, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_put_zombies_total", 6, **G2, tier="dram", kind="swa"),
    _c("swaserve:gcache_lease_expired_total", 3, **G1, tier="dram", kind="full"),
    _c("swaserve:gcache_corrupt_pages_total", 0, **G1, tier="nvme", kind="full"),
    _c("swaserve:gcache_io_errors_total", 6, **G1, tier="nvme", kind="full"),
    # the prefill workers' L3 counters (their own port)
    _c("swaserve:l3_fetches_lost_total", 60, **X1, reason="error"),
    _c("swaserve:l3_fetches_lost_total", 30, **X2, reason="error"),
    _c("swaserve:l3_fetches_lost_total", 6, **X1, reason="deadline"),
    _c("swaserve:l3_node_errors_total", 12, **X1, op="lookup"),
    _c("swaserve:l3_put_errors_total", 3, **X2),
    _g("swaserve:gcache_draining", 0, **G1),
    _g("swaserve:gcache_draining", 1, **G2),
    # media encoders e1 (images) and e2 (audio, a few images); the prefill worker's failed fetches
    _c("swaserve:encoder_items_total", 360, **E1, modality="image", outcome="encoded"),
    _c("swaserve:encoder_items_total", 120, **E1, modality="image", outcome="cached"),
    _c("swaserve:encoder_items_total", 60, **E1, modality="image", outcome="failed"),
    _c("swaserve:encoder_items_total", 120, **E2, modality="image", outcome="encoded"),
    _c("swaserve:encoder_items_total", 180, **E2, modality="audio", outcome="encoded"),
    *_h("swaserve:encoder_batch_items", {"1.0": 60, "2.0": 60, "4.0": 120, "8.0": 240, "16.0": 240, "+Inf": 240}, **E1),
    _g("swaserve:encoder_queue_items", 12, **E1),
    _g("swaserve:encoder_queue_items", 3, **E2),
    _g("swaserve:encoder_running_items", 4, **E1),
    _g("swaserve:encoder_running_items", 0, **E2),
    _c("swaserve:encoder_cache_hits_total", 180, **E1, tier="memory"),
    _c("swaserve:encoder_cache_hits_total", 60, **E1, tier="shm"),
    _c("swaserve:encoder_cache_hits_total", 120, **E2, tier="memory"),
    _c("swaserve:encoder_cache_hits_total", 0, **E2, tier="shm"),
    _c("swaserve:encoder_cache_misses_total", 120, **E1),
    _c("swaserve:encoder_cache_misses_total", 120, **E2),
    *_h("swaserve:encoder_encode_seconds", {"0.01": 0, "0.025": 60, "0.05": 120, "+Inf": 120}, **E1, modality="image"),
    *_h("swaserve:encoder_encode_seconds", {"0.1": 0, "0.25": 60, "+Inf": 60}, **E2, modality="audio"),
    _c("swaserve:encoder_fetch_bytes_total", 6000, **E1),
    _c("swaserve:encoder_fetch_bytes_total", 3000, **E2),
    _c("swaserve:encoder_fetches_total", 600, **E1, outcome="served"),
    _c("swaserve:encoder_fetches_total", 6, **E1, outcome="not_found"),
    _c("swaserve:encoder_fetches_total", 0, **E1, outcome="timeout"),
    _c("swaserve:encoder_fetches_total", 12, **E2, outcome="failed"),
    _c("swaserve:media_fetch_failed_total", 3, **WP),
    _g("swaserve:encoder_cache_bytes", 1000, **E1),
    _g("swaserve:encoder_cache_bytes", 500, **E2),
    _g("swaserve:encoder_shm_cache_bytes", 4000, **E1),
    _g("swaserve:encoder_shm_cache_bytes", 0, **E2),
    # EP prefill workers: mean / max expert rows per rank per second, layers 0 and 1 (x1: 4/5, 2/4; x2: 2/2, 1/2)
    _c("swaserve:ep_expert_tokens_mean_total", 240, **X1, layer="0"),
    _c("swaserve:ep_expert_tokens_max_total", 300, **X1, layer="0"),
    _c("swaserve:ep_expert_tokens_mean_total", 120, **X1, layer="1"),
    _c("swaserve:ep_expert_tokens_max_total", 240, **X1, layer="1"),
    _c("swaserve:ep_expert_tokens_mean_total", 120, **X2, layer="0"),
    _c("swaserve:ep_expert_tokens_max_total", 120, **X2, layer="0"),
    _c("swaserve:ep_expert_tokens_mean_total", 60, **X2, layer="1"),
    _c("swaserve:ep_expert_tokens_max_total", 120, **X2, layer="1"),
    _g("swaserve:ep_expert_balance", 0.8, **X1, layer="0"),
    _g("swaserve:ep_expert_balance", 0.5, **X1, layer="1"),
    _g("swaserve:ep_expert_balance", 0.9, **X2, layer="0"),
    _g("swaserve:ep_expert_balance", 0.6, **X2, layer="1"),
]  # fmt: skip


def _other(s: Series, buckets: dict[tuple[str, str], float]) -> Series:
    name, labels, kind, v = s
    if kind == "bucket":  # every observation in the first bucket
        v = buckets[(name, labels["instance"])]
    else:
        v *= 3
    return name, {**labels, "model_name": "other"}, kind, v


def series() -> list[Series]:
    """SERIES and the ``other`` model's copies."""
    totals = {(n, lb["instance"]): v for n, lb, k, v in SERIES if k == "bucket" and lb["le"] == "+Inf"}
    return SERIES + [_other(s, totals) for s in SERIES if s[1].get("model_name") == "m"]


S = '{role="%s"}'
N = "swaserve:router_index_entries"
# (dashboard, panel title, legend) -> [(labels, value)]; every query on model "m", $__rate_interval 5m
OV = "swaserve-overview.json"
EXPECTED: dict[tuple[str, str, str], list[tuple[str, float]]] = {
    # TTFT rates 0, 1, 2, 4, 4 at le 0.5, 1, 2.5, 5, +Inf: rank 2 -> 1 + 1.5 x 1/1; 3.6 -> 2.5 + 2.5 x 1.6/2; 3.96
    (OV, "Time to first token", "p50"): [("{}", 2.5)],
    (OV, "Time to first token", "p90"): [("{}", 4.5)],
    (OV, "Time to first token", "p99"): [("{}", 4.95)],
    # ITL rates 0, 1, 2, 2: rank 1 -> 0.1; 1.8 -> 0.1 + 0.1 x 0.8 (f64); 1.98 -> 0.1 + 0.1 x 0.98
    (OV, "Inter-token latency", "p50"): [("{}", 0.1)],
    (OV, "Inter-token latency", "p90"): [("{}", 0.18000000000000002)],
    (OV, "Inter-token latency", "p99"): [("{}", 0.198)],
    # E2E rates 1, 3, 4, 4: rank 2 -> 1 + 1 x 1/2; 3.6 -> 2 + 3 x 0.6 (f64); 3.96 -> 2 + 3 x 0.96
    (OV, "End-to-end latency", "p50"): [("{}", 1.5)],
    (OV, "End-to-end latency", "p90"): [("{}", 3.8000000000000003)],
    (OV, "End-to-end latency", "p99"): [("{}", 4.88)],
    # queue: rank 1.8 of rates 1, 2 -> 0.5 + 0.5 x 0.8; prefill: 0, 2 -> 0.5 + 0.5 x 1.8/2;
    # decode: 0, 1 -> 1 + 1 x 0.9; inference: 0, 1 -> 2 + 3 x 0.9
    (OV, "Request phases (p90)", "queue"): [("{}", 0.9)],
    (OV, "Request phases (p90)", "prefill"): [("{}", 0.95)],
    (OV, "Request phases (p90)", "decode"): [("{}", 1.9)],
    (OV, "Request phases (p90)", "inference"): [("{}", 4.7)],
    (OV, "Requests by status (router)", "{{status}}"): [('{status="ok"}', 10), ('{status="failed"}', 1)],
    (OV, "Finished requests by reason", "{{finished_reason}}"): [
        ('{finished_reason="stop"}', 5), ('{finished_reason="length"}', 2)],
    (OV, "Token throughput", "prompt"): [("{}", 30)],
    (OV, "Token throughput", "generation"): [("{}", 10)],
    # prompt rates 0, 1, 2, 2 at le 10, 20, 50: rank 1 -> 10 + 10; rank 1.8 -> 20 + 30 x 0.8
    (OV, "Tokens per request", "prompt p50"): [("{}", 20)],
    (OV, "Tokens per request", "prompt p90"): [("{}", 44)],
    # generation rates 1, 2, 2 at le 5, 10: rank 1 -> 5; 1.8 -> 5 + 5 x 0.8
    (OV, "Tokens per request", "generation p50"): [("{}", 5)],
    (OV, "Tokens per request", "generation p90"): [("{}", 9)],
    (OV, "Requests waiting", "{{role}}"): [(S % "prefill", 5), (S % "decode", 1)],
    (OV, "Requests waiting", "serve engine (router: 0)"): [("{}", 4)],
    (OV, "Requests running", "{{role}}"): [(S % "prefill", 4), (S % "decode", 6)],
    (OV, "Requests running", "in flight (router) / running (serve)"): [("{}", 10)],
    (OV, "Workers up and draining", "{{role}} up"): [(S % "prefill", 1), (S % "decode", 1)],
    (OV, "Workers up and draining", "{{role}} draining"): [(S % "prefill", 1), (S % "decode", 0)],
    (OV, "Outstanding tokens per worker", "{{role}} {{worker}}"): [
        ('{role="prefill",worker="p1"}', 100), ('{role="prefill",worker="p2"}', 50),
        ('{role="decode",worker="d1"}', 300)],
    (OV, "Requests per worker", "{{worker}} running"): [
        ('{role="prefill",worker="p1"}', 4), ('{role="prefill",worker="p2"}', 0), ('{role="decode",worker="d1"}', 6)],
    (OV, "Requests per worker", "{{worker}} waiting"): [
        ('{role="prefill",worker="p1"}', 3), ('{role="prefill",worker="p2"}', 2), ('{role="decode",worker="d1"}', 1)],
    (OV, "Dispatches per worker", "{{role}} {{worker}}"): [
        ('{role="prefill",worker="p1"}', 4), ('{role="decode",worker="d1"}', 4)],
    (OV, "KV usage by role and pool (fullest worker)", "{{role}} {{pool}}"): [
        ('{role="decode",pool="full"}', 0.96875), ('{role="decode",pool="swa"}', 0.5),
        ('{role="prefill",pool="full"}', 0.75), ('{role="prefill",pool="swa"}', 0.375),
        ('{pool="full"}', 0.5), ('{pool="swa"}', 0.25)],
    # (used - cached) / 64: d1 60, 32; p1 8, 8; p2 8, 24; serve 16, 16 (no swa cache series)
    (OV, "KV held by requests (fullest worker)", "{{role}} {{pool}}"): [
        ('{role="decode",pool="full"}', 0.9375), ('{role="decode",pool="swa"}', 0.5),
        ('{role="prefill",pool="full"}', 0.125), ('{role="prefill",pool="swa"}', 0.375),
        ('{pool="full"}', 0.25), ('{pool="swa"}', 0.25)],
    (OV, "KV usage per worker", "{{role}} {{worker}} {{pool}}"): [
        ('{role="decode",worker="d1",pool="full"}', 0.96875), ('{role="decode",worker="d1",pool="swa"}', 0.5),
        ('{role="prefill",worker="p1",pool="full"}', 0.25), ('{role="prefill",worker="p1",pool="swa"}', 0.125),
        ('{role="prefill",worker="p2",pool="full"}', 0.75), ('{role="prefill",worker="p2",pool="swa"}', 0.375),
        ('{pool="full"}', 0.5), ('{pool="swa"}', 0.25)],
    # hits 5 (device) + 1 (host) of 10 queried tokens/s
    (OV, "Prefix cache hit rate by tier", "{{tier}}"): [('{tier="device"}', 0.5), ('{tier="host"}', 0.1)],
    (OV, "Prefix cache hit rate by tier", "total"): [("{}", 0.6)],
    (OV, "Prefix cache pages per worker", "{{role}} {{worker}} {{pool}}"): [
        ('{role="decode",worker="d1",pool="full"}', 2), ('{role="decode",worker="d1",pool="swa"}', 0),
        ('{role="prefill",worker="p1",pool="full"}', 8), ('{role="prefill",worker="p1",pool="swa"}', 0),
        ('{role="prefill",worker="p2",pool="full"}', 40), ('{role="prefill",worker="p2",pool="swa"}', 0),
        ('{pool="full"}', 16), ('{pool="host_full"}', 100)],
    (OV, "KV staged on decode workers", "{{worker}}"): [('{worker="d1"}', 1024)],
    (OV, "Retries and resumes by reason", "{{reason}}"): [('{reason="overloaded"}', 1), ('{reason="resumed"}', 0.2)],
    (OV, "Routing decisions", "{{reason}}"): [('{reason="affinity"}', 3), ('{reason="load"}', 1)],
    (OV, "Prefix index entries", "{{instance}}"): [
        (N + '{job="router",instance="r1:8000",model_name="m"}', 100),
        (N + '{job="router",instance="r2:8000",model_name="m"}', 120)],
    (OV, "Shared state (Redis) up", "{{instance}}"): [
        ('swaserve:router_shared_state_up{job="router",instance="r1:8000",model_name="m"}', 1),
        ('swaserve:router_shared_state_up{job="router",instance="r2:8000",model_name="m"}', 0)],
    (OV, "KV transfer throughput", "sent (prefill)"): [("{}", 100)],
    (OV, "KV transfer throughput", "received (decode)"): [("{}", 100)],
    # rates 0, 1, 2, 2 at le 1024, 4096, 16384: rank 1 -> 4096; 1.8 -> 4096 + 12288 x 0.8 (f64)
    (OV, "KV bytes per request", "p50"): [("{}", 4096)],
    (OV, "KV bytes per request", "p90"): [("{}", 13926.400000000001)],  # (f64)
    # drafts 2 + 1 /s, accepted 4 + 1 /s: 1 + 5/3; per position (2 + 0.5, 1.2 + 0.3, 0.8 + 0.2) / 3
    (OV, "Mean accept length", "mean"): [("{}", 1 + 5 / 3)],
    (OV, "Acceptance by draft position", "draft {{position}}"): [
        ('{position="0"}', 2.5 / 3), ('{position="1"}', 0.5000000000000001), ('{position="2"}', 1 / 3)],  # (f64)
    (OV, "Drafts", "verify steps"): [("{}", 3)],
    (OV, "Drafts", "draft tokens"): [("{}", 9)],
    (OV, "Drafts", "accepted"): [("{}", 5)],
    (OV, "Transfer failures and index events", "failed transfers"): [("{}", 0.1)],
    (OV, "Transfer failures and index events", "index events {{outcome}}"): [
        ('{outcome="published"}', 10), ('{outcome="dropped"}', 0)],
    # GCache: full hits 5 + 2 of 10 pages/s looked up, swa 1 of 2
    (OV, "GCache lookup hit rate", "{{kind}}"): [('{kind="full"}', 0.7), ('{kind="swa"}', 0.5)],
    (OV, "GCache tier usage", "{{tier}}"): [('{tier="dram"}', 0.4), ('{tier="nvme"}', 0.25)],
    (OV, "GCache pages per node", "{{instance}} {{tier}}"): [
        ('{instance="g1:9090",tier="dram"}', 30), ('{instance="g1:9090",tier="nvme"}', 50),
        ('{instance="g2:9090",tier="dram"}', 10)],
    (OV, "GCache pages per node", "{{instance}} {{tier}} leased"): [
        ('{instance="g1:9090",tier="dram"}', 3), ('{instance="g1:9090",tier="nvme"}', 0),
        ('{instance="g2:9090",tier="dram"}', 1)],
    (OV, "GCache throughput", "read"): [("{}", 150)],
    (OV, "GCache throughput", "written"): [("{}", 20)],
    # lookup rates 0, 1, 2, 2 at le 0.001, 0.0025, 0.005: rank 1 -> 0.0025; 1.98 -> 0.0025 + 0.0025 x 0.98 (f64);
    # get rates 0, 1 at le 0.01, 0.025: rank 0.5 -> 0.01 + 0.015 x 0.5; 0.99 -> 0.01 + 0.015 x 0.99
    (OV, "GCache operation latency", "{{op}} p50"): [('{op="lookup"}', 0.0025), ('{op="get"}', 0.0175)],
    (OV, "GCache operation latency", "{{op}} p99"): [('{op="lookup"}', 0.0049499999999999995), ('{op="get"}', 0.02485)],
    (OV, "GCache evictions and tier moves", "evicted from {{tier}}"): [('{tier="dram"}', 2), ('{tier="nvme"}', 1)],
    (OV, "GCache evictions and tier moves", "demoted to NVMe"): [("{}", 3)],
    (OV, "GCache evictions and tier moves", "promoted to DRAM"): [("{}", 0.5)],
    (OV, "GCache refusals and faults", "puts refused (full)"): [("{}", 1)],
    (OV, "GCache refusals and faults", "puts without parent"): [("{}", 0.2)],
    (OV, "GCache refusals and faults", "puts never committed"): [("{}", 0.1)],
    (OV, "GCache refusals and faults", "leases expired"): [("{}", 0.05)],
    (OV, "GCache refusals and faults", "corrupt pages"): [("{}", 0)],
    (OV, "GCache refusals and faults", "{{tier}} I/O errors"): [('{tier="nvme"}', 0.1)],
    (OV, "L3 fetches lost, prefill side", "lost: {{reason}}"): [('{reason="error"}', 1.5), ('{reason="deadline"}', 0.1)],
    (OV, "L3 fetches lost, prefill side", "node {{op}} failed"): [('{op="lookup"}', 0.2)],
    (OV, "L3 fetches lost, prefill side", "puts failed"): [("{}", 0.05)],
    (OV, "GCache nodes serving and draining", "serving"): [("{}", 1)],
    (OV, "GCache nodes serving and draining", "draining"): [("{}", 1)],
    # encoders: items/s by modality and outcome over both encoders
    (OV, "Encoder items by modality and outcome", "{{modality}} {{outcome}}"): [
        ('{modality="image",outcome="encoded"}', 8), ('{modality="image",outcome="cached"}', 2),
        ('{modality="image",outcome="failed"}', 1), ('{modality="audio",outcome="encoded"}', 3)],
    # batch rates 1, 1, 2, 4, 4 at le 1, 2, 4, 8, 16: rank 2 -> 2 + 2 x 1/1; 3.6 -> 4 + 4 x 1.6/2
    (OV, "Encoder batch size", "p50"): [("{}", 4)],
    (OV, "Encoder batch size", "p90"): [("{}", 7.2)],
    (OV, "Encoder queue", "{{instance}} queued"): [('{instance="e1:9090"}', 12), ('{instance="e2:9090"}', 3)],
    (OV, "Encoder queue", "{{instance}} running"): [('{instance="e1:9090"}', 4), ('{instance="e2:9090"}', 0)],
    # lookups 10/s: memory hits 3 + 2, shm 1, misses 2 + 2
    (OV, "Encoder cache hit ratio by tier", "{{tier}}"): [('{tier="memory"}', 0.5), ('{tier="shm"}', 0.1)],
    (OV, "Encoder cache hit ratio by tier", "total"): [("{}", 0.6)],
    # image rates 0, 1, 2 at le 0.01, 0.025, 0.05: rank 1 -> 0.025; 1.8 -> 0.025 + 0.025 x 0.8 (f64);
    # audio 0, 1 at le 0.1, 0.25: rank 0.5 -> 0.1 + 0.15 x 0.5; 0.9 -> 0.1 + 0.15 x 0.9 (f64)
    (OV, "Encode latency by modality", "{{modality}} p50"): [('{modality="image"}', 0.025), ('{modality="audio"}', 0.175)],
    (OV, "Encode latency by modality", "{{modality}} p90"): [
        ('{modality="image"}', 0.045000000000000005), ('{modality="audio"}', 0.23500000000000001)],  # (f64)
    (OV, "Embedding fetch throughput", "fetched by prefill workers"): [("{}", 150)],
    (OV, "Media fetch failures", "prefill: requests failed"): [("{}", 0.05)],
    (OV, "Media fetch failures", "encoder: fetches {{outcome}}"): [
        ('{outcome="not_found"}', 0.1), ('{outcome="timeout"}', 0), ('{outcome="failed"}', 0.2)],
    (OV, "Encoder cache size", "{{instance}} memory"): [('{instance="e1:9090"}', 1000), ('{instance="e2:9090"}', 500)],
    (OV, "Encoder cache size", "{{instance}} shared memory"): [('{instance="e1:9090"}', 4000), ('{instance="e2:9090"}', 0)],
    # EP: layer 0 (4 + 2) / (5 + 2), layer 1 (2 + 1) / (4 + 2); their mean; per worker (0.8 + 0.5) / 2, (1 + 0.5) / 2
    (OV, "Expert load balance per layer", "layer {{layer}}"): [('{layer="0"}', 6 / 7), ('{layer="1"}', 0.5)],
    (OV, "Expert load balance, mean over layers", "all instances"): [("{}", (6 / 7 + 0.5) / 2)],
    (OV, "Expert load balance, mean over layers", "{{worker}}"): [('{worker="p1"}', 0.65), ('{worker="p2"}', 0.75)],
    # the gauges: per layer the lower of x1 and x2; per worker the mean of its layers
    (OV, "Expert load balance since start", "layer {{layer}} (lowest instance)"): [('{layer="0"}', 0.8), ('{layer="1"}', 0.5)],
    (OV, "Expert load balance since start", "{{worker}} mean over layers"): [('{worker="p1"}', 0.65), ('{worker="p2"}', 0.75)],
}  # fmt: skip
