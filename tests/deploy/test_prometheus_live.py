"""A real Prometheus (Debian's 2.42) scrapes a real local cluster (router, a prefill and a decode
worker, Redis) with deploy/prometheus/rules.yaml loaded: after a few requests every dashboard query
returns data, every rule evaluates without error and every recording rule has data, and no series
carries ``exported_instance`` (the router names workers in a ``worker`` label)."""

from __future__ import annotations

import contextlib
import math
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from swaserve.launcher import Cluster
from swaserve.model.checkpoint import make_checkpoint
from swaserve.procs import free_port
from tests.helpers import promql as h
from tests.helpers.cluster import MODEL, WORKER_ARGS, prompt, running

pytestmark = [pytest.mark.cluster, pytest.mark.slow]  # the cluster and Prometheus are child processes

# Queries that return no number on this traffic, and why.
NO_DATA = {
    # the router's outputs carry no engine scheduling times (RequestTimer): empty histograms, NaN
    ("swaserve-overview.json", "Request phases (p90)", "queue"): "router: no scheduling times",
    ("swaserve-overview.json", "Request phases (p90)", "prefill"): "router: no scheduling times",
    ("swaserve-overview.json", "Request phases (p90)", "inference"): "router: no scheduling times",
    # no GCache node in this cluster (tests/deploy/test_kubelet.py scrapes the chart's GCache pods
    # for every name these queries use)
    **{q.key: "no GCache node" for q in h.dashboard_queries() if "swaserve:gcache_" in q.expr},
    # no encoder either (tests/deploy/test_kubelet.py scrapes the chart's encoder pod for these);
    # the prefill workers' failed media fetches are exported from the start (0)
    **{q.key: "no encoder" for q in h.dashboard_queries() if "swaserve:encoder_" in q.expr},
    # no expert-parallel worker (tests/deploy/test_kubelet.py scrapes the chart's EP prefill pod)
    **{q.key: "no EP worker" for q in h.dashboard_queries() if "swaserve:ep_" in q.expr},
    # no L3 tier on the workers (tests/deploy/test_kubelet.py scrapes the chart's prefill pod with
    # GCache on for these)
    **{q.key: "no L3 tier" for q in h.dashboard_queries() if "swaserve:l3_" in q.expr},
}


@contextlib.contextmanager
def prometheus(tmp: Path, targets: dict[str, list[str]]) -> Iterator[str]:
    """Prometheus on a free 127.0.0.1 port scraping ``targets`` (job -> host:port) every second,
    with the shipped rules; stopped by pid afterwards. Yields its URL."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "prometheus not installed (Debian package prometheus; scripts/system_deps.sh installs it)"
        )
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [str(h.RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": t}]} for job, t in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    cmd = [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
           "--storage.tsdb.retention.time=1h", f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait(lambda: _get(f"{url}/-/ready") is not None, "prometheus ready", 30, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _get(url: str, **params: Any) -> Any:
    try:
        r = httpx.get(url, params=params, timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 and r.headers.get("content-type", "").startswith("application/json") else (
        r.text if r.status_code == 200 else None
    )  # fmt: skip


def wait(
    cond: Callable[[], Any], what: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.5)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    body = _get(f"{url}/api/v1/query", query=expr)
    assert body is not None and body["status"] == "success", (expr, body)
    return list(body["data"]["result"])


def numbers(result: list[dict[str, Any]]) -> list[float]:
    return [float(r["value"][1]) for r in result]


def complete(url: str, ids: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_dashboards_and_rules_on_a_live_cluster(tmp_path: Path) -> None:
    # the tiny model with MTP layers (same target, same name), workers speculating: the MTP panels
    model = make_checkpoint("tiny", tmp_path / MODEL, mtp_layers=2)
    cluster = Cluster(
        model,
        worker_args=[*WORKER_ARGS, "--num-threads", "1", "--speculative-num-steps", "2"],
        router_args=["--request-timeout", "60"],
    )
    with running(cluster, timeout_s=120):
        workers = [u.removeprefix("http://").removesuffix("/metrics") for u in cluster.metrics_urls.values()]
        targets = {"router": [cluster.url.removeprefix("http://")], "workers": workers}
        with prometheus(tmp_path, targets) as prom:
            # two scrapes of every target before any request: counters then rise from a first sample
            scraped_twice = "count(count_over_time(up[1m]) >= 2 and up == 1)"
            wait(
                lambda: numbers(query(prom, scraped_twice)) == [1 + len(workers)],
                "two scrapes of each target",
                30,
            )
            shared = prompt(1, 40)
            for ids in (shared, shared, prompt(2, 24), prompt(3, 33)):  # the same prompt twice: a prefix hit
                complete(cluster.url, ids)
            wait(lambda: numbers(query(prom, 'sum(swaserve:router_requests_total{status="ok"})')) == [4],
                 "the requests scraped", 20)  # fmt: skip
            # a series born with the requests (a decision reason) needs a second sample for rate()
            fresh = "min(count_over_time(swaserve:router_decisions_total[1m]))"
            wait(lambda: numbers(query(prom, fresh)) >= [2], "two samples of the decisions", 20)
            wait(lambda: all(r["health"] == "ok" for r in rule_list(prom)), "every rule evaluated", 20)

            assert numbers(query(prom, "sum(swaserve:prefix_cache_hits_total)"))[0] > 0, "no prefix hit"
            assert query(prom, '{exported_instance!=""}') == [], "a series labelled exported_instance"
            up = {r["metric"]["worker"] for r in query(prom, "swaserve:worker_up == 1")}
            assert up == set(cluster.worker_addresses["prefill"] + cluster.worker_addresses["decode"])
            values = _get(
                f"{prom}/api/v1/label/model_name/values", **{"match[]": "swaserve:num_requests_running"}
            )
            assert values["data"] == [MODEL]  # the dashboards' model_name variable

            empty = {}
            for q in h.dashboard_queries():
                got = numbers(query(prom, h.substitute(q.expr, rate_interval="1m", model=MODEL)))
                if not got or not all(math.isfinite(v) for v in got):
                    empty[q.key] = got
            assert set(empty) == set(NO_DATA), {
                "no data": set(empty) - set(NO_DATA),
                "has data": set(NO_DATA) - set(empty),
            }

            for name in sorted(h.recorded_names()):
                if name.startswith("swaserve:gcache_"):
                    continue  # no GCache node here (rules_test.yaml checks these on synthetic series)
                got = numbers(query(prom, name))
                assert got and all(math.isfinite(v) for v in got), f"{name}: {got}"
            assert query(prom, 'ALERTS{alertname=~"SwaserveNoWorker|SwaserveWorkerDown"}') == []


def rule_list(prom: str) -> list[dict[str, Any]]:
    body = _get(f"{prom}/api/v1/rules")
    return [r for g in body["data"]["groups"] for r in g["rules"]] if body else [{"health": "unknown"}]
