"""Helpers for the observability tests (tests/deploy): the shipped rules and dashboards, their
queries with Grafana's variables filled in, a PromQL lint over them (``promql-parser``), the names
swaserve exports (rendered by the real metrics code) and ``promtool``."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import promql_parser as pp
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules.yaml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "rules_test.yaml"
GRAFANA = ROOT / "deploy" / "grafana"
COUNTER_FUNCS = {"rate", "increase", "irate"}
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def promtool() -> str:
    """The ``promtool`` binary (the test skips when it is not installed: scripts/system_deps.sh)."""
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus; scripts/system_deps.sh installs it)")
    return path


def run_promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True, timeout=120, cwd=cwd)


# -- what the shipped files query -------------------------------------------------------------------
def rules() -> list[dict[str, Any]]:
    """Every rule of rules.yaml, each with its group's name under ``group``."""
    doc = yaml.safe_load(RULES.read_text())
    return [{**r, "group": g["name"]} for g in doc["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def dashboard_generator() -> ModuleType:
    """deploy/grafana/dashboards.py (not a package: loaded from its path)."""
    spec = importlib.util.spec_from_file_location("swaserve_dashboards", GRAFANA / "dashboards.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(GRAFANA.glob("*.json"))}


@dataclass(frozen=True)
class Query:
    """One target of one dashboard panel: ``key`` = (dashboard file, panel title, legend)."""

    key: tuple[str, str, str]
    expr: str  # as in the JSON, Grafana variables and all


def dashboard_queries() -> Iterator[Query]:
    for name, d in dashboards().items():
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                yield Query((name, panel["title"], t["legendFormat"]), t["expr"])


def substitute(expr: str, rate_interval: str = "5m", model: str = "m") -> str:
    """A dashboard query as Grafana sends it: ``$__rate_interval`` and ``$model_name`` filled in."""
    return expr.replace("$__rate_interval", rate_interval).replace("$model_name", model)


def all_exprs() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule expression and every dashboard query (variables filled in)."""
    out = [(f"rules.yaml {r.get('record') or r.get('alert')}", str(r["expr"])) for r in rules()]
    out += [(" / ".join(q.key), substitute(q.expr)) for q in dashboard_queries()]
    return out


# -- PromQL lint ----------------------------------------------------------------------------------
def _children(node: Any) -> list[Any]:
    if isinstance(node, pp.BinaryExpr):
        return [node.lhs, node.rhs]
    if isinstance(node, pp.AggregateExpr):
        return [node.expr] + ([node.param] if node.param is not None else [])
    if isinstance(node, pp.Call):
        return list(node.args)
    if isinstance(node, (pp.UnaryExpr, pp.ParenExpr, pp.SubqueryExpr)):
        return [node.expr]
    if isinstance(node, pp.MatrixSelector):
        return [node.vector_selector]
    return []


def _walk(node: Any, parents: tuple[Any, ...] = ()) -> Iterator[tuple[Any, tuple[Any, ...]]]:
    """Every node with its ancestors (nearest last)."""
    yield node, parents
    for child in _children(node):
        yield from _walk(child, (*parents, node))


def _unparen(node: Any) -> Any:
    while isinstance(node, pp.ParenExpr):
        node = node.expr
    return node


def selector_names(node: Any) -> set[str]:
    return {n.name for n, _ in _walk(node) if isinstance(n, pp.VectorSelector) and n.name}


def _is_sum(node: Any) -> bool:
    node = _unparen(node)
    return isinstance(node, pp.AggregateExpr) and str(node.op) == "sum"


def lint(expr: str, known: set[str]) -> list[str]:
    """What is wrong with ``expr`` (empty: nothing):

    - ``histogram_quantile`` over anything but ``sum by (le, ...)`` of ``rate``/``increase``/``irate``
      (per-series quantiles, or quantiles of lifetime totals);
    - a counter or histogram series (``_total``, ``_bucket``, ``_sum``, ``_count``) not directly in
      ``rate``/``increase``/``irate`` (lifetime totals);
    - prefix-cache hits divided by queries without ``sum`` on both sides (``hits`` has a ``tier``
      label that ``queries`` lacks: a per-series division matches nothing);
    - a selector without a metric name, or a ``swaserve:`` name not in ``known``.
    """
    try:
        root = pp.parse(expr)
    except ValueError as e:
        return [f"does not parse: {e}"]
    errors = []
    for node, parents in _walk(root):
        if isinstance(node, pp.Call) and node.func.name == "histogram_quantile":
            agg = _unparen(node.args[1])
            inner = _unparen(agg.expr) if isinstance(agg, pp.AggregateExpr) else None
            if not (
                _is_sum(agg)
                and agg.modifier is not None
                and agg.modifier.type == pp.AggModifierType.By
                and "le" in agg.modifier.labels
                and isinstance(inner, pp.Call)
                and inner.func.name in COUNTER_FUNCS
            ):
                errors.append(f"histogram_quantile needs sum by (le, ...) (rate(...)): {node}")
        if isinstance(node, pp.VectorSelector):
            name = node.name
            if not name:
                errors.append(f"selector without a metric name: {node}")
                continue
            wrapped = (
                len(parents) >= 2
                and isinstance(parents[-1], pp.MatrixSelector)
                and isinstance(parents[-2], pp.Call)
                and parents[-2].func.name in COUNTER_FUNCS
            )
            if name.endswith(COUNTER_SUFFIXES) and not wrapped:
                errors.append(f"{name} outside rate/increase/irate (a lifetime total)")
            if name.startswith("swaserve:") and name not in known:
                errors.append(f"{name} is not exported by swaserve nor recorded by rules.yaml")
        if isinstance(node, pp.BinaryExpr) and str(node.op) == "/":
            lhs, rhs = selector_names(node.lhs), selector_names(node.rhs)
            pair = {"swaserve:prefix_cache_hits_total", "swaserve:prefix_cache_queries_total"}
            if (lhs | rhs) >= pair and not (_is_sum(node.lhs) and _is_sum(node.rhs)):
                errors.append(f"prefix-cache hits / queries without sum on both sides: {node}")
    return errors


# -- the names swaserve exports ---------------------------------------------------------------------
def exported_names() -> set[str]:
    """Every sample name a ``serve`` process, a router (with Redis and discovery) and a worker expose
    (with MTP, EP and an L3 tier on), rendered by the real metrics code and parsed back."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from services.worker_metrics import WorkerMetrics
    from swaserve.engine.stats import EngineStats
    from swaserve.engine.types import RequestOutput
    from swaserve.kvcache.prefix_cache import CacheStats
    from swaserve.kvcache.stats import PoolStats
    from swaserve.metrics import ServerMetrics
    from swaserve.metrics_router import DiscoveryStats, RouterStats, WorkerStats
    from swaserve.model.ep_stats import EPStats

    pools = {"full": PoolStats(8, 2, 3, 64, 1, cached_pages=1), "swa": PoolStats(8, 1, 1, 64, 1)}
    from swaserve.engine.spec import SpecStats

    engine = EngineStats(
        1,
        1,
        pools=pools,
        prefix_cache=CacheStats(10, 5, 1),
        cache_pages={"full": 1},
        spec=SpecStats(2, 6, 3, [2, 1, 0]),
        ep=EPStats([0, 0], [3.0, 1.0], [4, 2], [0.75, 0.5]),
        l3={"lookups": 1},  # an L3 tier: its families
    )
    router = RouterStats(
        workers=(WorkerStats("decode", "h:1", True, 1, 1, 1, 1, pools),),
        requests={"ok": 1}, retries={"resumed": 1}, decisions={"affinity": 1},
        dispatches={("decode", "h:1"): 1}, index_entries=1, shared_state_up=True,
        discovery=DiscoveryStats({"ADDED": 1}, {"start": 1}, {"decode": 1}),
    )  # fmt: skip
    texts = []
    for m in (ServerMetrics(lambda: engine, "m"), ServerMetrics(lambda: engine, "m", lambda: router)):
        m.timer().observe(RequestOutput("r", new_token_ids=[1], finished=True, prompt_tokens=3))
        texts.append(m.render()[0].decode())
    texts.append(generate_latest(WorkerMetrics().registry).decode())
    return {s.name for t in texts for fam in text_string_to_metric_families(t) for s in fam.samples}
