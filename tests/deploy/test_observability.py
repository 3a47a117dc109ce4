"""The Prometheus rules and Grafana dashboards under deploy/, checked without a cluster: promtool's own
checks and unit tests (every recording rule and alert, and every dashboard query against exact
values), a PromQL lint over all of them, their names against what swaserve exports, the dashboard
files against their generator, the alerts' runbook links."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promql_parser as pp
import pytest
import yaml

from tests.deploy.dashboard_cases import EXPECTED, series
from tests.helpers import promql as h

OPERATIONS = h.ROOT / "docs" / "OPERATIONS.md"


# -- promtool ----------------------------------------------------------------------------------------
@pytest.mark.cluster  # promtool is a child process
def test_promtool_checks_and_unit_tests_pass() -> None:
    check = h.run_promtool("check", "rules", h.RULES)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = h.run_promtool("test", "rules", h.RULES_TEST.name, cwd=h.RULES_TEST.parent)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_rules_test_covers_every_rule_and_alert_both_ways() -> None:
    tests = yaml.safe_load(h.RULES_TEST.read_text())["tests"]
    exprs = [t["expr"] for group in tests for t in group.get("promql_expr_test", [])]
    for name in h.recorded_names():
        assert any(re.match(re.escape(name) + r"($|[{\s])", e) for e in exprs), (
            f"{name} has no promql_expr_test"
        )
    cases: dict[str, set[bool]] = {}
    for group in tests:
        for t in group.get("alert_rule_test", []):
            cases.setdefault(t["alertname"], set()).add(bool(t["exp_alerts"]))
    for r in h.rules():
        if "alert" in r:
            assert cases.get(r["alert"]) == {True, False}, (
                f"{r['alert']}: needs a firing and a not-firing case"
            )


def test_alerts_are_complete() -> None:
    """Each alert waits (``for``), has a severity and says what, why and where to read more (an
    anchor of docs/OPERATIONS.md)."""
    anchors = {_slug(m) for m in re.findall(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    for r in (r for r in h.rules() if "alert" in r):
        assert r.get("for") and r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        ann = r["annotations"]
        assert ann["summary"] and ann["description"], r["alert"]
        path, _, anchor = ann["runbook_url"].partition("#")
        assert path == "docs/OPERATIONS.md" and anchor in anchors, f"{r['alert']}: no heading for {anchor}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _promtool_tests(queries: list[h.Query]) -> dict[str, Any]:
    """A promtool test file: the synthetic series and one promql_expr_test per dashboard query."""

    def selector(name: str, labels: dict[str, str]) -> str:
        return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"

    inputs = [
        {"series": selector(n, lb), "values": f"0+{v:g}x20" if kind != "gauge" else f"{v:g}x20"}
        for n, lb, kind, v in series()
    ]
    cases = [
        {
            "expr": h.substitute(q.expr),
            "eval_time": "10m",
            "exp_samples": [{"labels": lb, "value": v} for lb, v in EXPECTED[q.key]],
        }
        for q in queries
    ]
    return {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": inputs, "promql_expr_test": cases}],
    }


def test_every_dashboard_query_has_expected_values() -> None:
    keys = [q.key for q in h.dashboard_queries()]
    assert len(keys) == len(set(keys)), "two targets of a panel share a legend"
    assert set(keys) == set(EXPECTED), {"no expected values": set(keys) - set(EXPECTED),
                                        "no such query": set(EXPECTED) - set(keys)}  # fmt: skip


@pytest.mark.cluster  # promtool is a child process
def test_dashboard_queries_return_exact_values(tmp_path: Path) -> None:
    path = tmp_path / "dashboards_test.yaml"
    path.write_text(yaml.safe_dump(_promtool_tests(list(h.dashboard_queries())), sort_keys=False))
    out = h.run_promtool("test", "rules", path.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


# -- PromQL lint -----------------------------------------------------------------------------------
def gcache_exported_names() -> set[str]:
    """Every sample name a GCache node exposes: its metrics code (services/gcache/metrics.py) over a
    real store with both tiers, one operation observed, rendered and parsed back."""
    import tempfile
    from collections import Counter

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.gcache.metrics import GCacheMetrics
    from swaserve.gcache.store import PageStore
    from swaserve.gcache.tiers import DramTier, NvmeTier

    with tempfile.TemporaryDirectory() as tmp:
        store = PageStore(DramTier(1 << 20), NvmeTier(Path(tmp), 1 << 20, direct=False))
        metrics = GCacheMetrics()
        metrics.observe("lookup", "grpc", 0.001)
        metrics.attach(lambda: (Counter(store.stats), store.usage()), lambda: False)
        text = generate_latest(metrics.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def encoder_exported_names() -> set[str]:
    """Every sample name a media encoder exposes: its metrics code (services/encoder/metrics.py),
    one forward and one fetch observed, gauges read from a stand-in scheduler, rendered and parsed
    back."""
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.encoder.metrics import EncoderMetrics
    from swaserve.encoder.cache import EmbeddingCache

    metrics = EncoderMetrics()
    metrics.batch_items.observe(2)
    metrics.encode_seconds.labels("image").observe(0.01)
    metrics.fetch_bytes.inc(1024)
    metrics.watch(
        SimpleNamespace(batcher=[], running=0, memory=EmbeddingCache(1 << 20), shm=None, draining=False)
    )
    text = generate_latest(metrics.registry).decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def known_names() -> set[str]:
    """What a query may name: the serve/router/worker series, the GCache nodes', the encoders',
    the recorded ones."""
    return h.exported_names() | gcache_exported_names() | encoder_exported_names() | h.recorded_names()


def test_rules_and_dashboards_pass_the_lint() -> None:
    known = known_names()
    errors = [f"{where}: {e}" for where, expr in h.all_exprs() for e in h.lint(expr, known)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    ("expr", "error"),
    [
        ("histogram_quantile(0.9, rate(swaserve:time_to_first_token_seconds_bucket[5m]))", "histogram_quantile"),
        ("histogram_quantile(0.9, sum(rate(swaserve:time_to_first_token_seconds_bucket[5m])))", "histogram_quantile"),
        ("histogram_quantile(0.9, sum by (le) (swaserve:time_to_first_token_seconds_bucket))", "histogram_quantile"),
        ("histogram_quantile(0.9, max by (le) (rate(swaserve:time_to_first_token_seconds_bucket[5m])))", "histogram_quantile"),
        ("sum(swaserve:prompt_tokens_total)", "outside rate"),
        ("sum(swaserve:e2e_request_latency_seconds_count)", "outside rate"),
        ("delta(swaserve:router_retries_total[5m])", "outside rate"),
        ("rate(swaserve:prefix_cache_hits_total[5m]) / rate(swaserve:prefix_cache_queries_total[5m])", "hits / queries"),
        ("sum(rate(swaserve:prefix_cache_hits_total[5m])) / rate(swaserve:prefix_cache_queries_total[5m])", "hits / queries"),
        ("swaserve:num_requests_pending", "not exported"),
        ("sum(swaserve:gcache_hits)", "not exported"),  # a counter family's name, not its sample's
        ("sum(rate(swaserve:gcache_lookups_total[5m]))", "not exported"),
        ("sum(rate(swaserve:encoder_items[5m]))", "not exported"),  # the family, not its sample
        ("histogram_quantile(0.9, sum by (modality) (rate(swaserve:encoder_encode_seconds_bucket[5m])))", "histogram_quantile"),
        ("sum(swaserve:encoder_fetch_bytes_total)", "outside rate"),
        ("vllm:num_requests_waiting or swaserve:kv_cache_usage", "not exported"),
        ('{__name__="swaserve:worker_up"}', "without a metric name"),
        ("sum(", "does not parse"),
    ],
)  # fmt: skip
def test_lint_catches(expr: str, error: str) -> None:
    known = known_names()
    errors = h.lint(expr, known)
    assert any(error in e for e in errors), errors


def test_exported_names_come_from_the_code() -> None:
    """The name set the lint trusts: router families, the new per-request histograms, worker
    transfer counters; none labelled ``instance``."""
    names = h.exported_names()
    for n in (
        "swaserve:worker_up",
        "swaserve:request_prompt_tokens_bucket",
        "swaserve:request_decode_time_seconds_sum",
        "swaserve:kv_transfer_sent_bytes_total",
        "swaserve:index_events_total",
        "swaserve:router_shared_state_up",
    ):
        assert n in names, n  # fmt: skip
    assert "swaserve:time_per_output_token_seconds_bucket" not in names  # vLLM's removed name


def test_gcache_names_come_from_the_code() -> None:
    """The GCache node's names the lint trusts: counters by tier and kind, per-tier gauges, the op
    histogram; the dashboards and rules use each family."""
    names = gcache_exported_names()
    for n in (
        "swaserve:gcache_hits_total",
        "swaserve:gcache_misses_total",
        "swaserve:gcache_used_bytes",
        "swaserve:gcache_capacity_bytes",
        "swaserve:gcache_draining",
        "swaserve:gcache_op_seconds_bucket",
        "swaserve:gcache_corrupt_pages_total",
        "swaserve:gcache_put_refused_total",
    ):
        assert n in names, n  # fmt: skip
    used = {n for _, expr in h.all_exprs() for n in h.selector_names(pp.parse(expr))}
    assert {n for n in used if n.startswith("swaserve:gcache_")} >= {
        "swaserve:gcache_hits_total", "swaserve:gcache_misses_total", "swaserve:gcache_used_bytes",
        "swaserve:gcache_capacity_bytes", "swaserve:gcache_op_seconds_bucket", "swaserve:gcache_draining",
    }  # fmt: skip


def test_encoder_names_come_from_the_code() -> None:
    """The encoder's names the lint trusts (the brief's list and the gauges read at scrape), the
    prefill workers' failed fetches; the dashboards and rules use each of the brief's families."""
    names = encoder_exported_names()
    for n in (
        "swaserve:encoder_items_total",
        "swaserve:encoder_batch_items_bucket",
        "swaserve:encoder_queue_items",
        "swaserve:encoder_running_items",
        "swaserve:encoder_cache_hits_total",
        "swaserve:encoder_cache_misses_total",
        "swaserve:encoder_cache_bytes",
        "swaserve:encoder_shm_cache_bytes",
        "swaserve:encoder_encode_seconds_bucket",
        "swaserve:encoder_fetch_bytes_total",
        "swaserve:encoder_fetches_total",
    ):
        assert n in names, n  # fmt: skip
    assert "swaserve:media_fetch_failed_total" in h.exported_names()  # a prefill worker's
    used = {n for _, expr in h.all_exprs() for n in h.selector_names(pp.parse(expr))}
    assert {n for n in used if n.startswith("swaserve:encoder_") or n.startswith("swaserve:media_")} >= {
        "swaserve:encoder_items_total", "swaserve:encoder_batch_items_bucket", "swaserve:encoder_queue_items",
        "swaserve:encoder_cache_hits_total", "swaserve:encoder_cache_misses_total", "swaserve:encoder_cache_bytes",
        "swaserve:encoder_encode_seconds_bucket", "swaserve:encoder_fetch_bytes_total",
        "swaserve:media_fetch_failed_total",
    }  # fmt: skip


# -- dashboards --------------------------------------------------------------------------------------
def test_dashboard_files_are_what_the_generator_makes() -> None:
    gen = h.dashboard_generator()
    files = {p.name for p in h.GRAFANA.glob("*.json")}
    assert files == set(gen.DASHBOARDS)
    for name, d in gen.DASHBOARDS.items():
        assert (h.GRAFANA / name).read_text() == gen.dump(d), (
            f"{name}: run python deploy/grafana/dashboards.py"
        )


def test_dashboard_structure() -> None:
    for name, d in h.dashboards().items():
        variables = {v["name"]: v for v in d["templating"]["list"]}
        assert (
            variables["datasource"]["type"] == "datasource"
            and variables["datasource"]["query"] == "prometheus"
        )
        assert variables["model_name"]["query"] == "label_values(swaserve:num_requests_running, model_name)"
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), name
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
            mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
            assert not cells & mine, f"{name}: {p['title']} overlaps another panel"
            cells |= mine
            if p["type"] == "row":
                continue
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                worker_side = any(
                    s in t["expr"]
                    for s in ("kv_transfer_", "index_events", "gcache_", "encoder_", "media_fetch_")
                )
                assert worker_side or t["expr"].count("swaserve:") == t["expr"].count(
                    'model_name=~"$model_name"'
                ), f"{p['title']}: every swaserve series filtered by $model_name"
