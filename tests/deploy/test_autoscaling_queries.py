"""The chart's KEDA trigger queries, as rendered, against synthetic series with exact values
(``promtool test rules``): a bucket's waiting requests and KV held by requests, from its own pods'
series only (not another bucket's, not the routers' copies of the same gauges)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers.chart import NAMESPACE, RELEASE, render
from tests.helpers.promql import run_promtool

pytestmark = pytest.mark.cluster  # promtool is a child process


def _series(name: str, value: float, **labels: str) -> dict[str, str]:
    body = ",".join(f'{k}="{v}"' for k, v in {"namespace": NAMESPACE, **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": f"{value:g}x10"}


def _pod(
    pod: str,
    component: str,
    bucket: str | None,
    waiting: float,
    pools: dict[str, tuple[int, int, int]],
    release: str = RELEASE,
) -> list[dict[str, str]]:
    """A scrape target's load gauges (``pools``: pool -> used, cached, total pages)."""
    lb = {"pod": pod, "release": release, "component": component, "role": "prefill"}
    lb.update(worker=f"{pod}:50051", model_name="m")
    if bucket:
        lb["bucket"] = bucket
    out = [_series("swaserve:worker_num_requests_waiting", waiting, **lb)]
    for pool, (used, cached, total) in pools.items():
        out += [
            _series("swaserve:kv_cache_used_pages", used, pool=pool, **lb),
            _series("swaserve:prefix_cache_pages", cached, pool=pool, **lb),
            _series("swaserve:kv_cache_total_pages", total, pool=pool, **lb),
        ]
    return out


def test_keda_queries_select_the_buckets_own_pods(tmp_path: Path) -> None:
    docs = render(yaml.safe_load(Path("deploy/helm/examples/values-buckets.yaml").read_text()))
    [so] = [d for d in docs if d["kind"] == "ScaledObject"]
    assert so["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-swaserve-prefill-long"
    queue, kv = (t["metadata"]["query"] for t in so["spec"]["triggers"])
    inputs: list[dict[str, Any]] = [
        # the long bucket's two pods: the queries' inputs
        *_pod("long-a", "prefill", "long", 3, {"full": (60, 20, 100), "swa": (30, 0, 50)}),  # 0.4, 0.6
        *_pod("long-b", "prefill", "long", 5, {"full": (90, 10, 100), "swa": (10, 5, 50)}),  # 0.8, 0.1
        # another bucket's pod, a router's copy of long-a's gauges: never counted
        *_pod("short-a", "prefill", "short", 40, {"full": (100, 0, 100)}),
        *_pod("router-x", "router", None, 3, {"full": (60, 20, 100), "swa": (30, 0, 50)}),
        # the same bucket name in another release of the namespace: never counted
        *_pod("other-long-a", "prefill", "long", 7, {"full": (100, 0, 100)}, release="other"),
    ]
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": inputs,
            "promql_expr_test": [
                {"expr": queue, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 8}]},
                # mean over the pods of the fuller pool's request-held share: (0.6 + 0.8) / 2
                {"expr": kv, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 0.7}]},
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "keda_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = run_promtool("test", "rules", path.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_keda_query_of_the_encoders_reads_this_releases_encoder_queues(tmp_path: Path) -> None:
    docs = render(yaml.safe_load(Path("deploy/helm/examples/values-encoder.yaml").read_text()))
    [so] = [d for d in docs if d["kind"] == "ScaledObject"]
    assert so["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": f"{RELEASE}-swaserve-encoder",
    }
    [trigger] = so["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"  # KEDA divides the sum by the replica count

    def queue(pod: str, value: float, release: str = RELEASE, namespace: str = NAMESPACE) -> dict[str, str]:
        lb = {"namespace": namespace, "pod": pod, "release": release, "component": "encoder"}
        body = ",".join(f'{k}="{v}"' for k, v in lb.items())
        return {"series": f"swaserve:encoder_queue_items{{{body}}}", "values": f"{value:g}x10"}

    inputs = [
        queue("enc-0", 30), queue("enc-1", 50),  # this release's encoders: 80 queued
        queue("other-enc-0", 500, release="other"),  # another release, another namespace: not counted
        queue("enc-0", 700, namespace="elsewhere"),
    ]  # fmt: skip
    test = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": inputs,
            "promql_expr_test": [
                {"expr": trigger["metadata"]["query"], "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 80}]},
            ],
        }],
    }  # fmt: skip
    path = tmp_path / "keda_encoder_test.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    out = run_promtool("test", "rules", path.name, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
