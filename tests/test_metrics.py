"""``swaserve.metrics``: the per-request histograms vLLM dashboards read (phases, token counts) and
the router's per-worker series, labelled ``worker`` (not ``instance``, which Prometheus renames)."""

from __future__ import annotations

from typing import Any

import pytest

from swaserve.engine.stats import EngineStats
from swaserve.engine.types import FinishReason, RequestOutput
from swaserve.kvcache.stats import PoolStats
from swaserve.metrics import RequestTimer, ServerMetrics, token_buckets
from swaserve.metrics_router import RouterStats, WorkerStats

M = {"model_name": "m"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _idle() -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0)


def test_token_buckets_are_vllms_1_2_5() -> None:
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    m = ServerMetrics(_idle, "m", max_model_len=4096)
    get = m.registry.get_sample_value
    assert get("swaserve:request_prompt_tokens_bucket", {**M, "le": "2000.0"}) == 0
    assert get("swaserve:request_prompt_tokens_bucket", {**M, "le": "5000.0"}) is None


def test_request_phases_and_token_counts() -> None:
    """``serve``: the engine's scheduling and first-token times split the request into phases."""
    m = ServerMetrics(_idle, "m", max_model_len=1000)
    clock = FakeClock()
    clock.now = 100.0
    timer = RequestTimer(m, clock, prompt_tokens=7)
    base: dict[str, Any] = dict(
        request_id="r", arrival_time=100.0, first_scheduled_time=100.5, prompt_tokens=7
    )
    clock.now = 101.0
    timer.observe(RequestOutput(new_token_ids=[1], first_token_time=100.75, **base))
    clock.now = 101.2
    timer.observe(RequestOutput(new_token_ids=[2, 3], **base))
    clock.now = 101.6
    timer.observe(RequestOutput(new_token_ids=[4], finished=True, finish_reason=FinishReason.LENGTH, **base))
    get = m.registry.get_sample_value
    assert get("swaserve:request_prefill_time_seconds_sum", M) == pytest.approx(0.25)  # 100.5 -> 100.75
    assert get("swaserve:request_decode_time_seconds_sum", M) == pytest.approx(0.85)  # 100.75 -> 101.6
    assert get("swaserve:request_inference_time_seconds_sum", M) == pytest.approx(1.1)  # 100.5 -> 101.6
    assert get("swaserve:request_prompt_tokens_sum", M) == 7
    assert get("swaserve:request_prompt_tokens_bucket", {**M, "le": "5.0"}) == 0
    assert get("swaserve:request_prompt_tokens_bucket", {**M, "le": "10.0"}) == 1
    assert get("swaserve:request_generation_tokens_sum", M) == 4
    assert get("swaserve:request_generation_tokens_count", M) == 1


def test_router_outputs_have_no_scheduling_times() -> None:
    """The router's outputs carry no engine times: no queue, prefill or inference time; decode time
    and token counts (the prompt length from the outputs) still are recorded."""
    m = ServerMetrics(_idle, "m")
    clock = FakeClock()
    timer = RequestTimer(m, clock)  # made at 0; the prompt's length comes from the outputs
    clock.now = 2.0
    timer.observe(RequestOutput("r", new_token_ids=[1], prompt_tokens=30))
    clock.now = 2.5
    timer.observe(RequestOutput("r", new_token_ids=[2], prompt_tokens=30))
    clock.now = 3.0
    timer.observe(RequestOutput("r", finished=True, finish_reason=FinishReason.STOP, prompt_tokens=30))
    get = m.registry.get_sample_value
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_inference_time_seconds",
    ):
        assert get(f"swaserve:{name}_count", M) == 0, name
    assert get("swaserve:time_to_first_token_seconds_sum", M) == pytest.approx(2.0)
    assert get("swaserve:request_decode_time_seconds_sum", M) == pytest.approx(0.5)
    assert get("swaserve:request_prompt_tokens_sum", M) == 30
    assert get("swaserve:request_generation_tokens_sum", M) == 2


def test_aborted_before_output_counts_its_prompt_and_no_tokens() -> None:
    m = ServerMetrics(_idle, "m")
    m.timer(prompt_tokens=12).abort()
    m.timer(prompt_tokens=12).discard()  # refused: nothing recorded
    get = m.registry.get_sample_value
    assert get("swaserve:request_prompt_tokens_count", M) == 1
    assert get("swaserve:request_prompt_tokens_sum", M) == 12
    assert get("swaserve:request_generation_tokens_sum", M) == 0
    assert get("swaserve:request_generation_tokens_count", M) == 1
    assert get("swaserve:request_decode_time_seconds_count", M) == 0


def _router_metrics() -> ServerMetrics:
    pools = {
        "full": PoolStats(total_pages=100, used_pages=60, peak_used_pages=70, page_bytes=0, num_layers=0,
                          cached_pages=50),
        "swa": PoolStats(total_pages=40, used_pages=4, peak_used_pages=8, page_bytes=0, num_layers=0),
    }  # fmt: skip
    worker = WorkerStats("decode", "10.0.0.7:50051", True, running=2, waiting=1, pools=pools)
    stats = RouterStats(workers=(worker,), dispatches={("decode", "10.0.0.7:50051"): 3})
    return ServerMetrics(_idle, "m", router=lambda: stats)


def test_router_series_name_the_worker_in_a_worker_label() -> None:
    m = _router_metrics()
    w = {**M, "role": "decode", "worker": "10.0.0.7:50051"}
    get = m.registry.get_sample_value
    assert get("swaserve:worker_up", w) == 1
    assert get("swaserve:worker_num_requests_waiting", w) == 1
    assert get("swaserve:router_dispatches_total", w) == 3
    assert get("swaserve:kv_cache_usage_perc", {**w, "pool": "full"}) == 0.6
    # the router's prefix-cache pages per worker and pool: what requests hold is used - cached
    assert get("swaserve:prefix_cache_pages", {**w, "pool": "full"}) == 50
    assert get("swaserve:prefix_cache_pages", {**w, "pool": "swa"}) == 0
    text = m.render()[0].decode()
    assert "instance=" not in text


def test_serve_prefix_cache_pages_keep_their_tiers() -> None:
    stats = EngineStats(num_running=0, num_waiting=0, cache_pages={"full": 7, "host_full": 20})
    m = ServerMetrics(lambda: stats, "m")
    get = m.registry.get_sample_value
    assert get("swaserve:prefix_cache_pages", {**M, "pool": "host_full"}) == 20
    assert get("swaserve:prefix_cache_pages", {**M, "pool": "full"}) == 7


def test_worker_metrics_keep_their_colons_when_prometheus_asks_for_openmetrics() -> None:
    """Prometheus asks for OpenMetrics first; prometheus_client would then write ``swaserve_...``."""
    import httpx

    from services.worker_metrics import WorkerMetrics, serve_metrics

    m = WorkerMetrics()
    m.kv_sent.inc(5)
    httpd = serve_metrics(0, "127.0.0.1", m.registry)
    try:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        r = httpx.get(f"http://127.0.0.1:{httpd.server_port}/metrics", headers={"Accept": accept}, timeout=10)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "\nswaserve:kv_transfer_sent_bytes_total 5.0\n" in r.text
    assert 'swaserve:index_events_total{outcome="dropped"} 0.0' in r.text  # exported before any event
    assert "swaserve_" not in r.text


def test_counters_exist_at_zero_before_their_first_event() -> None:
    """A series born at its first increment hides that increment from rate(): finish reasons and a
    known worker's dispatches are exported at 0 from the start."""
    worker = WorkerStats("prefill", "10.0.0.8:50051", True)
    m = ServerMetrics(_idle, "m", router=lambda: RouterStats(workers=(worker,)))
    get = m.registry.get_sample_value
    for reason in ("stop", "length", "abort"):
        assert get("swaserve:request_success_total", {**M, "finished_reason": reason}) == 0
    assert get("swaserve:router_dispatches_total", {**M, "role": "prefill", "worker": "10.0.0.8:50051"}) == 0
