"""The Helm chart, rendered by Helm's own engine: golden files, strict lint, the values schema, the
Kubernetes OpenAPI schemas of two minor versions (CRDs: KEDA, prometheus-operator models), and
checks across objects that no schema makes (selectors, ports, flags the services really have)."""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import typer

from swaserve.routing.registry import ROLES
from tests.helpers.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    example_values,
    golden_path,
    golden_text,
    notes,
    render,
)

helm_python = pytest.importorskip("helm_python")
EXAMPLES = example_values()
KUBE_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest minors the chart is checked against
WORKLOADS = ("Deployment", "StatefulSet")


def _objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _by_name(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _pod_templates(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in docs:
        if d["kind"] in WORKLOADS:
            yield d, d["spec"]["template"]


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels."""
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        k, op, vals = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(k) not in vals:
            return False
        if op == "NotIn" and labels.get(k) in vals:
            return False
        if op == "Exists" and k not in labels:
            return False
        if op == "DoesNotExist" and k in labels:
            return False
    return True


def _selector_string_matches(selector: str, labels: dict[str, str]) -> bool:
    """An equality-based label selector string (``k=v,k2=v2``) against labels."""
    return all(labels.get(k) == v for k, _, v in (p.partition("=") for p in selector.split(",")))


# -- golden files, lint, schema ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_render_as_their_golden_files(name: str) -> None:
    path = golden_path(name)
    assert path.exists(), f"no golden file {path.name}: run python -m tests.helpers.chart --update"
    assert golden_text(EXAMPLES[name]) == path.read_text(), (
        f"the chart renders {path.name} differently: if the change is intended, run "
        "python -m tests.helpers.chart --update and review the diff"
    )


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("kube", ["v1.30.0", "v1.37.0"])
def test_strict_lint_passes(name: str, kube: str) -> None:
    report = helm_python.lint(CHART, EXAMPLES[name], strict=True, namespace=NAMESPACE, kube_version=kube)
    assert report["errors"] == []
    bad = [m for m in report["messages"] if m["severity"] > 1 and "icon" not in m["error"]]
    assert bad == []


TYPOS = [
    ({"router": {"replicaz": 2}}, "additional properties 'replicaz' not allowed"),
    ({"router": {"replicas": "two"}}, "got string, want integer"),
    ({"prefill": {"defaults": {"autoscaling": {"enable": True}}}}, "additional properties 'enable'"),
    ({"decode": {"autoscaling": {"type": "vpa"}}}, "/decode/autoscaling/type"),
    ({"prefill": {"buckets": [{"name": "short", "promptLenRange": "0-4k", "replica": 1}]}}, "'replica'"),
    ({"prefill": {"buckets": [{"name": "Short", "promptLenRange": "0-4k"}]}}, "/prefill/buckets/0/name"),
    ({"prefill": {"buckets": [{"name": "a", "promptLenRange": "4k"}]}}, "promptLenRange"),
    ({"prefill": {"buckets": []}}, "/prefill/buckets"),
    ({"redis": {"mode": "sentinel"}}, "/redis/mode"),
    ({"redis": {"external": {"url": "http://x"}}}, "/redis/external/url"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"model": {"path": "models/x"}}, "/model/path"),
    ({"router": {"policy": "cache-aware"}}, "/router/policy"),
    ({"decode": {"stagingMemory": "lots"}}, "/decode/stagingMemory"),
    ({"tls": {"grpc": {"enable": True}}}, "'enable'"),
    ({"monitoring": {"podMonitor": {"interval": 15}}}, "/monitoring/podMonitor/interval"),
    ({"auth": {"adminToken": {"enabled": "yes"}}}, "/auth/adminToken/enabled"),
    ({"decode": {"gpus": -1}}, "/decode/gpus"),
    ({"decode": {"autoscaling": {"kvUsageThreshold": 80}}}, "/decode/autoscaling/kvUsageThreshold"),
    ({"routr": {}}, "additional properties 'routr' not allowed"),
    ({"gcache": {"enable": True}}, "additional properties 'enable'"),
    ({"gcache": {"dram": "lots"}}, "/gcache/dram"),
    ({"gcache": {"nvme": {"volume": {"type": "s3"}}}}, "/gcache/nvme/volume/type"),
    ({"gcache": {"ucx": {"tcpPortRange": "50100"}}}, "/gcache/ucx/tcpPortRange"),
    ({"gcache": {"antiAffinity": "strict"}}, "/gcache/antiAffinity"),
    ({"gcache": {"prefill": {"transport": "tcp"}}}, "/gcache/prefill/transport"),
    ({"gcache": {"replicas": 0}}, "/gcache/replicas"),
    ({"encoder": {"enable": True}}, "additional properties 'enable'"),
    ({"encoder": {"device": "gpu"}}, "/encoder/device"),
    ({"encoder": {"dtype": "fp16"}}, "/encoder/dtype"),
    ({"encoder": {"cacheBytes": "lots"}}, "/encoder/cacheBytes"),
    ({"encoder": {"shmCache": {"name": "a/b"}}}, "/encoder/shmCache/name"),
    ({"encoder": {"shmSize": "1GiB"}}, "/encoder/shmSize"),  # a Kubernetes quantity, not a flag's size
    ({"encoder": {"batching": {"maxItem": 2}}}, "additional properties 'maxItem'"),
    ({"encoder": {"batching": {"maxItems": 0}}}, "/encoder/batching/maxItems"),
    ({"encoder": {"replicas": 0}}, "/encoder/replicas"),
    ({"encoder": {"autoscaling": {"minReplicas": 0}}}, "/encoder/autoscaling/minReplicas"),
    ({"encoder": {"autoscaling": {"kvUsageThreshold": 0.8}}}, "additional properties 'kvUsageThreshold'"),
    ({"encoder": {"image": {"pullPolicy": "Sometimes"}}}, "/encoder/image/pullPolicy"),
    ({"encoder": {"prefill": {"fetchTimeout": 0}}}, "/encoder/prefill/fetchTimeout"),
    ({"router": {"media": {"limitPerPrompt": {"images": 2}}}}, "additional properties 'images'"),
    ({"router": {"media": {"limitPerPrompt": {"image": -1}}}}, "/router/media/limitPerPrompt/image"),
    ({"router": {"media": {"allowedDomains": ["https://x.com"]}}}, "/router/media/allowedDomains/0"),
    ({"router": {"media": {"allowedLocalPath": "media"}}}, "/router/media/allowedLocalPath"),
    ({"clusterDomain": "Cluster.Local"}, "/clusterDomain"),
    ({"prefill": {"defaults": {"ep": {"size": 0}}}}, "/prefill/defaults/ep/size"),
    ({"prefill": {"defaults": {"ep": {"sise": 2}}}}, "additional properties 'sise'"),
    ({"prefill": {"defaults": {"ep": {"timeoutSeconds": 0}}}}, "/prefill/defaults/ep/timeoutSeconds"),
    ({"prefill": {"defaults": {"ep": {"shmPerRank": "1GiB"}}}}, "/prefill/defaults/ep/shmPerRank"),
    ({"prefill": {"defaults": {"ep": {"placement": [[0, 1]]}}}}, "/prefill/defaults/ep/placement"),
    (
        {"prefill": {"defaults": {"ep": {"placement": {"ranks": [[0, -1]]}}}}},
        "/prefill/defaults/ep/placement/ranks/0/1",
    ),
    (
        {"prefill": {"buckets": [{"name": "a", "promptLenRange": "0-", "ep": {"size": "2"}}]}},
        "/prefill/buckets/0/ep/size",
    ),
    ({"decode": {"ep": {"size": 2}}}, "additional properties 'ep'"),  # EP is the prefill workers'
    ({"decode": {"env": [{"value": "bar"}]}}, "/decode/env/0"),  # an EnvVar needs its name
    ({"image": {"variant": "rocm"}}, "/image/variant"),
    ({"model": {"kvArgs": "--page-size 8"}}, "/model/kvArgs"),
]


@pytest.mark.parametrize(("values", "message"), TYPOS, ids=[m for _, m in TYPOS])
def test_the_schema_refuses_typos_and_wrong_types(values: dict[str, Any], message: str) -> None:
    chart = helm_python.Chart.load(CHART)
    with pytest.raises(helm_python.HelmValuesError, match=re.escape(message)):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError):  # and so does a render (install, template)
        render(values)


FAILS = [
    ({"redis": {"mode": "none"}}, "redis.mode none keeps routing state in each router"),
    ({"router": {"discovery": {"mode": "static"}}}, "needs router.staticWorkers.prefill"),
    ({"redis": {"mode": "external"}}, "redis.external.url or redis.external.existingSecret is required"),
    ({"model": {"source": "pvc", "path": "/models"}}, "model.pvc.claimName is required"),
    ({"tls": {"grpc": {"enabled": True}}}, "tls.grpc.secretName is required"),
    (
        {
            "prefill": {
                "buckets": [{"name": "a", "promptLenRange": "0-4k"}, {"name": "a", "promptLenRange": "4k-"}]
            }
        },
        'the name "a" is used twice',
    ),
    (
        {
            "prefill": {
                "buckets": [{"name": "a", "promptLenRange": "0-8k"}, {"name": "b", "promptLenRange": "4k-"}]
            }
        },
        "b (4k-) and a (0-8k) overlap",
    ),
    ({"prefill": {"buckets": [{"name": "a", "promptLenRange": "8k-4k"}]}}, "needs LO < HI"),
    ({"model": {"source": "pvc", "pvc": {"claimName": "c"}}}, "is not inside the pvc volume"),
    ({"redis": {"mode": "none"}, "router": {"replicas": 1, "indexMode": "precise"}}, "needs a Redis"),
    ({"networkPolicy": {"routerFrom": [{"podSelector": {}}]}}, "set networkPolicy.metricsFrom"),
    ({"router": {"livenessProbe": {"httpGet": {"path": "/health", "port": "http"}}}}, "exactly one handler"),
    (
        {"decode": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "minReplicas 5 > maxReplicas 2",
    ),
    (
        {"gcache": {"enabled": True}, "redis": {"mode": "none"}, "router": {"replicas": 1}},
        "gcache.enabled needs a Redis",
    ),
    ({"gcache": {"enabled": True, "nvme": {"volume": {"type": "hostPath"}}}}, "hostPath.path is required"),
    (
        {
            "gcache": {
                "enabled": True,
                "nvme": {"volume": {"type": "hostPath", "hostPath": {"path": "/mnt/g"}}},
            }
        },
        "set gcache.antiAffinity hard",
    ),
    ({"gcache": {"enabled": True, "dram": "0"}}, "at '/gcache/dram': '0' does not match pattern"),
    (
        {"workerPorts": {"grpc": 9090, "metrics": 9090}},
        "workerPorts.grpc and workerPorts.metrics are both 9090",
    ),
    (
        {"gcache": {"enabled": True, "ports": {"grpc": 50062, "ucx": 50062}}},
        "gcache.ports [50062 9090 50062]",
    ),
    ({"gcache": {"enabled": True, "ports": {"ucx": 50110}}}, "gcache.ports.ucx 50110 is inside"),
    (
        {"tls": {"grpc": {"enabled": True, "secretName": "s", "healthPort": 50051}}},
        "tls.grpc.healthPort 50051 is also a workerPorts port",
    ),
    (
        {"gcache": {"enabled": True, "dram": "6GiB"}},
        "gcache.dram 6GiB does not fit gcache.resources.limits.memory 6Gi",
    ),
    (
        {"gcache": {"enabled": True, "nvme": {"capacity": "100GiB"}}},
        "100GiB is more than its pvc volume's 70Gi",
    ),
    ({"decode": {"stagingMemory": "0GiB"}}, "at '/decode/stagingMemory': '0GiB' does not match"),
    (
        {"gcache": {"enabled": True, "ucx": {"enabled": False}, "prefill": {"transport": "ucx"}}},
        "gcache.prefill.transport ucx needs gcache.ucx.enabled",
    ),
    (
        {"router": {"autoscaling": {"enabled": True, "minReplicas": 9, "maxReplicas": 2}}},
        "router autoscaling: minReplicas 9 > maxReplicas 2",
    ),
    (
        {"model": {"speculativeNumSteps": 2}, "decode": {"engineArgs": ["--speculative-num-steps", "0"]}},
        "set model.speculativeNumSteps instead",
    ),
    ({"decode": {"engineArgs": ["--page-size", "8"]}}, "engineArgs has --page-size: set it in model.kvArgs"),
    (
        {"prefill": {"defaults": {"engineArgs": ["--kv-cache-dtype=int8"]}}},
        "engineArgs has --kv-cache-dtype=int8: set it in model.kvArgs",
    ),
    ({"decode": {"engineArgs": ["--kv-kivi-residual", "64"]}}, "engineArgs has --kv-kivi-residual"),
    (
        {"decode": {"podLabels": {"app.kubernetes.io/component": "x"}}},
        "podLabels has app.kubernetes.io/component",
    ),
    ({"router": {"podLabels": {"swaserve.io/role": "decode"}}}, "router: podLabels has swaserve.io/role"),
    ({"gcache": {"enabled": True, "podLabels": {"app.kubernetes.io/name": "x"}}}, "gcache: podLabels has"),
    (
        {"encoder": {"enabled": True, "podLabels": {"app.kubernetes.io/instance": "x"}}},
        "encoder: podLabels has",
    ),
    (
        {"serviceAccount": {"create": False}},
        "router.discovery.mode kubernetes with serviceAccount.create false needs serviceAccount.name",
    ),
    (  # 6.4G is 6.4 GiB to the GCache node (--dram), over a 6Gi limit
        {"gcache": {"enabled": True, "dram": "6.4G"}},
        "gcache.dram 6.4G does not fit gcache.resources.limits.memory 6Gi",
    ),
    ({"gcache": {"enabled": True, "nvme": {"capacity": "71G"}}}, "71G is more than its pvc volume's 70Gi"),
    ({"gcache": {"enabled": True, "ucx": {"tcpPortRange": "50200-50100"}}}, "needs 1 <= LO <= HI <= 65535"),
    ({"encoder": {"enabled": True, "device": "cuda"}}, "encoder.device cuda needs encoder.gpus >= 1"),
    (
        {"encoder": {"enabled": True, "autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "encoder autoscaling: minReplicas 5 > maxReplicas 2",
    ),
    (
        {"prefill": {"defaults": {"gpus": 2, "ep": {"size": 4}}}},
        "gpus is per rank, set it to 1 (the pod then requests 4 GPUs)",
    ),
    (
        {"prefill": {"defaults": {"ep": {"placement": {"ranks": [[0, 1], [2, 3]]}}}}},
        "ep.size is 1 (no expert parallelism): set ep.size 2",
    ),
    (
        {"prefill": {"defaults": {"ep": {"size": 4, "placement": {"ranks": [[0, 1], [2, 3]]}}}}},
        "ep.placement has 2 ranks, ep.size is 4",
    ),
    (
        {"prefill": {"defaults": {"ep": {"size": 2, "placement": {"ranks": [[0, 1], [1, 2]]}}}}},
        "experts 0..3 exactly once each (some are repeated)",
    ),
    (
        {"prefill": {"defaults": {"ep": {"size": 2, "placement": {"ranks": [[0, 1], [2, 7]]}}}}},
        "expert 7 is out of range",
    ),
    (
        {"prefill": {"defaults": {"engineArgs": ["--ep-size", "2"]}}},
        "engineArgs has --ep-size: set prefill.defaults.ep",
    ),
    (
        {"prefill": {"defaults": {"engineArgs": ["--ep-placement=/x.json"]}}},
        "engineArgs has --ep-placement=/x.json",
    ),
    (
        {"prefill": {"defaults": {"ep": {"size": 2}, "engineArgs": ["--engine-process", "inline"]}}},
        "drop --engine-process inline",
    ),
    (
        {
            "prefill": {
                "buckets": [
                    {
                        "name": "long",
                        "promptLenRange": "0-",
                        "ep": {"size": 2},
                        "engineArgs": ["--engine-process=inline"],
                    }
                ]
            }
        },
        "prefill bucket long: ep.size 2 runs each rank in its own process",
    ),
]


@pytest.mark.parametrize(("values", "message"), FAILS, ids=[m[:40] for _, m in FAILS])
def test_inconsistent_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm_python.HelmError, match=re.escape(message)):
        render(values)


def test_kv_args_reach_every_prefill_and_decode_worker_and_labels_of_others_are_kept() -> None:
    values = {
        "model": {"kvArgs": ["--kv-cache-dtype", "fp8_e4m3", "--page-size=8"]},
        "prefill": {
            "buckets": [{"name": "a", "promptLenRange": "0-4k"}, {"name": "b", "promptLenRange": "4k-"}]
        },
        "decode": {"podLabels": {"team": "kv", "app.kubernetes.io/part-of": "serving"}},
    }
    docs = render(values)
    workers = [
        d
        for d in _objects(docs, "Deployment")
        if "swaserve.io/role" in d["spec"]["template"]["metadata"]["labels"]
    ]
    assert len(workers) == 3
    for d in workers:
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        assert _arg({"args": args}, "--kv-cache-dtype") == "fp8_e4m3" and "--page-size=8" in args, args
    labels = _by_name(docs, "Deployment", f"{RELEASE}-swaserve-decode")["spec"]["template"]["metadata"][
        "labels"
    ]
    assert labels["team"] == "kv" and labels["app.kubernetes.io/part-of"] == "serving"
    assert labels["app.kubernetes.io/component"] == "decode"


def test_a_bucket_clears_the_defaults_expert_placement() -> None:
    ranks = [list(range(8)), list(range(8, 16))]
    values = {
        "prefill": {
            "defaults": {"ep": {"size": 2, "placement": {"ranks": ranks}}},
            "buckets": [
                {"name": "short", "promptLenRange": "0-4k", "ep": {"size": 1, "placement": {}}},
                {"name": "long", "promptLenRange": "4k-"},
            ],
        }
    }
    docs = render(values)
    short = _by_name(docs, "Deployment", f"{RELEASE}-swaserve-prefill-short")["spec"]["template"]["spec"]
    assert not [a for a in short["containers"][0]["args"] if a.startswith("--ep-")]
    assert {
        d["metadata"]["name"] for d in _objects(docs, "ConfigMap") if d["metadata"]["name"].endswith("-ep")
    } == {f"{RELEASE}-swaserve-prefill-long-ep"}


def test_a_probe_handler_can_be_replaced_by_nulling_the_default() -> None:
    values = {
        "router": {"livenessProbe": {"tcpSocket": None, "httpGet": {"path": "/health", "port": "http"}}}
    }
    router = _by_name(render(values), "Deployment", f"{RELEASE}-swaserve-router")
    probe = router["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    assert "tcpSocket" not in probe and probe["httpGet"]["path"] == "/health"


def test_user_env_replaces_the_charts_entry_of_the_same_name() -> None:
    values = {
        "router": {
            "env": [{"name": "REDIS_URL", "value": "redis://other:6379/0"}, {"name": "X", "value": "1"}]
        }
    }
    router = _by_name(render(values), "Deployment", f"{RELEASE}-swaserve-router")
    env = router["spec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)) and names[-2:] == ["REDIS_URL", "X"]
    assert next(e for e in env if e["name"] == "REDIS_URL")["value"] == "redis://other:6379/0"
    assert "REDIS_PASSWORD" in names  # the chart's other entries stay


@pytest.mark.cluster  # runs the rendered command: sh and this machine's redis-server
def test_the_bundled_redis_reads_its_password_from_stdin_not_argv(tmp_path: Path) -> None:
    import redis

    from swaserve.procs import free_port
    from swaserve.redis_server import redis_binary

    spec = _by_name(render({}), "StatefulSet", f"{RELEASE}-swaserve-redis")["spec"]["template"]["spec"]
    c = spec["containers"][0]
    args, port = list(c["args"]), free_port()
    args[args.index("--port") + 1], args[args.index("--bind") + 1] = str(port), "127.0.0.1"
    args[args.index("--dir") + 1] = str(tmp_path)
    image_bin = tmp_path / "bin"
    image_bin.mkdir()
    (image_bin / "redis-server").symlink_to(redis_binary())
    password = "a \"quoted\\ pa$$ word's"
    env = {"PATH": f"{image_bin}{os.pathsep}{os.environ['PATH']}", "REDIS_PASSWORD": password}
    proc = subprocess.Popen(
        [*c["command"], *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        client = redis.Redis(port=port, password=password, socket_timeout=5)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, password="wrong", socket_timeout=5).ping()
        cmdline = " ".join(psutil.Process(proc.pid).cmdline())  # exec'd: the server itself
        assert "redis-server" in cmdline and password not in cmdline
    finally:
        proc.terminate()
        proc.wait(10)


def test_long_names_are_cut_to_what_keda_accepts() -> None:
    values = {
        "prefill": {"buckets": [{"name": "b" * 20, "promptLenRange": "0-", "autoscaling": {"enabled": True}}]}
    }
    docs = render(values, name="r" * 45)
    [so] = _objects(docs, "ScaledObject")
    target = so["spec"]["scaleTargetRef"]["name"]
    assert len(so["metadata"]["name"]) <= 54 < len(target)
    assert _by_name(docs, "Deployment", target)


def test_redis_password_reaches_every_client_from_a_secret() -> None:
    docs = render({"router": {"indexMode": "precise"}})
    redis = _by_name(docs, "StatefulSet", f"{RELEASE}-swaserve-redis")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-swaserve-redis"
    for name in (f"{RELEASE}-swaserve-router", f"{RELEASE}-swaserve-prefill-all"):
        c = _by_name(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == f"{RELEASE}-swaserve-redis"
        assert env["REDIS_URL"]["value"].startswith("redis://:$(REDIS_PASSWORD)@")
        assert "--redis-url" not in c["args"]  # the URL stays off the command line
    assert {s["metadata"]["name"] for s in _objects(docs, "Secret")} >= {f"{RELEASE}-swaserve-redis"}


def test_keda_without_its_crds_fails_instead_of_not_autoscaling() -> None:
    values = {"decode": {"autoscaling": {"enabled": True, "type": "keda"}}}
    with pytest.raises(helm_python.HelmError, match="needs KEDA's CRDs"):
        render(values, api_versions=())
    assert _objects(render(values), "ScaledObject")


def test_monitoring_objects_render_only_when_their_crds_exist() -> None:
    without = render({}, api_versions=())
    assert not _objects(without, "PodMonitor") and not _objects(without, "PrometheusRule")
    assert "Prometheus Operator CRDs are not installed" in notes({}, api_versions=())
    docs = render({})
    assert {d["metadata"]["name"] for d in _objects(docs, "PodMonitor")} == {
        f"{RELEASE}-swaserve-router",
        f"{RELEASE}-swaserve-workers",
    }
    assert len(_objects(docs, "PrometheusRule")) == 1


# -- Kubernetes and CRD schemas ------------------------------------------------------------------
def _validate_crd(doc: dict[str, Any]) -> None:
    from cloudcoil.models.keda.v1alpha1 import ScaledObject
    from cloudcoil.models.prometheus_operator.v1 import PodMonitor, PrometheusRule

    model = {"ScaledObject": ScaledObject, "PodMonitor": PodMonitor, "PrometheusRule": PrometheusRule}
    model[doc["kind"]].model_validate(doc)


@pytest.fixture(scope="module")
def kubernetes_validate() -> Iterator[Any]:
    """``kubernetes_validate``, its schema files read once per module (it reads each object's
    schema and the 4 MB definitions file again on every call; it never changes them)."""
    kv = pytest.importorskip("kubernetes_validate")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv.utils, "schema_contents", functools.cache(kv.utils.schema_contents))
        yield kv


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_object_validates_against_its_schema(name: str, kubernetes_validate: Any) -> None:
    for doc in render(EXAMPLES[name]):
        if doc["apiVersion"].startswith(("keda.sh/", "monitoring.coreos.com/")):
            _validate_crd(doc)
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_a_schema_error_is_caught(kubernetes_validate: Any) -> None:
    """The validator is not vacuous: a wrong field in a rendered object fails."""
    dep = copy.deepcopy(_objects(render({}), "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[0], strict=True)


# -- across objects ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_selectors_and_targets_point_at_rendered_pods(name: str) -> None:
    docs = render(EXAMPLES[name])
    pods = list(_pod_templates(docs))
    for w, t in pods:  # a workload's selector selects its own template, and no other workload's
        assert _matches(w["spec"]["selector"], t["metadata"]["labels"]), w["metadata"]["name"]
        others = [
            o for o, ot in pods if o is not w and _matches(w["spec"]["selector"], ot["metadata"]["labels"])
        ]
        assert others == [], f"{w['metadata']['name']} also selects {[o['metadata']['name'] for o in others]}"
    for d in docs:
        kind, spec = d["kind"], d.get("spec") or {}
        if kind == "Service":
            sel = {"matchLabels": spec["selector"]}
            chosen = [t for _, t in pods if _matches(sel, t["metadata"]["labels"])]
            assert chosen, f"Service {d['metadata']['name']} selects no pod"
            for port in spec["ports"]:
                for t in chosen:
                    names = {p.get("name") for c in t["spec"]["containers"] for p in c.get("ports", [])}
                    assert port["targetPort"] in names, (d["metadata"]["name"], port)
        elif kind in ("PodDisruptionBudget", "NetworkPolicy", "PodMonitor"):
            sel = spec["selector"] if kind != "NetworkPolicy" else spec["podSelector"]
            assert any(_matches(sel, t["metadata"]["labels"]) for _, t in pods), (
                f"{kind} {d['metadata']['name']}"
            )
        elif kind in ("HorizontalPodAutoscaler", "ScaledObject"):
            ref = spec["scaleTargetRef"]
            target = _by_name(docs, ref["kind"], ref["name"])
            assert "replicas" not in target["spec"], f"{ref['name']} has replicas and an autoscaler"
    targets = [
        (d["kind"], d["spec"]["scaleTargetRef"]["name"])
        for d in docs
        if "scaleTargetRef" in (d.get("spec") or {})
    ]
    assert len(targets) == len({name for _, name in targets}), f"two autoscalers on one target: {targets}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_probe_and_policy_ports_exist_on_their_containers(name: str) -> None:
    docs = render(EXAMPLES[name])
    for _, t in _pod_templates(docs):
        for c in t["spec"]["containers"]:
            ports = {p["containerPort"] for p in c.get("ports", [])} | {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    handler = next(v for k, v in c[probe].items() if k in ("grpc", "httpGet", "tcpSocket"))
                    assert handler["port"] in ports, (c["name"], probe, handler)
    for pol in _objects(docs, "NetworkPolicy"):
        chosen = [
            t
            for _, t in _pod_templates(docs)
            if _matches(pol["spec"]["podSelector"], t["metadata"]["labels"])
        ]
        for rule in pol["spec"]["ingress"]:
            for port in rule["ports"]:
                for t in chosen:
                    c = t["spec"]["containers"][0]
                    if "endPort" in port:  # a range: the UCX TCP ports the container pins (its env)
                        env = {e["name"]: e.get("value") for e in c.get("env", [])}
                        assert env.get("UCX_TCP_PORT_RANGE") == f"{port['port']}-{port['endPort']}", (
                            pol["metadata"]["name"], c["name"], port)  # fmt: skip
                        continue
                    names = {p["name"] for p in c.get("ports", [])}
                    assert port["port"] in names, (pol["metadata"]["name"], port)


def _service_options(module: str) -> set[str]:
    """The long option names of ``python -m services.<module>`` (its typer app)."""
    import importlib

    app = importlib.import_module(f"services.{module}.__main__").app
    cmd = typer.main.get_command(app)
    return {o for p in cmd.params for o in getattr(p, "opts", ()) if o.startswith("--")}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_containers_run_the_services_with_flags_they_have(name: str) -> None:
    docs = render(EXAMPLES[name])
    for _, t in _pod_templates(docs):
        for c in t["spec"]["containers"]:
            if c["name"] == "redis":
                continue
            assert c["command"][:2] == ["python", "-m"] and c["command"][2].startswith("services."), c[
                "command"
            ]
            module = c["command"][2].removeprefix("services.")
            known = _service_options(module)
            flags = [a for a in c["args"] if a.startswith("--")]
            assert set(flags) <= known, f"{module}: unknown flags {set(flags) - known}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_router_discovers_exactly_this_releases_workers(name: str) -> None:
    docs = render(EXAMPLES[name])
    router = _by_name(docs, "Deployment", f"{RELEASE}-swaserve-router")["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    if "--discovery" not in args:
        assert EXAMPLES[name]["router"]["discovery"]["mode"] == "static"
        assert not _objects(docs, "Role")
        return
    selector = args[args.index("--selector") + 1]
    roles = {}
    for _, t in _pod_templates(docs):
        labels = t["metadata"]["labels"]
        if _selector_string_matches(selector, labels) and "swaserve.io/role" in labels:
            if labels["swaserve.io/role"] not in ROLES:  # encoders: given by --encoder, not discovered
                assert labels["swaserve.io/role"] == "encoder" and "--encoder" in args
                continue
            roles.setdefault(labels["swaserve.io/role"], []).append(labels.get("swaserve.io/bucket"))
            assert (
                t["metadata"]["annotations"]["swaserve.io/grpc-port"] == args[args.index("--worker-port") + 1]
            )
    assert set(roles) == {"prefill", "decode"}
    assert len(roles["prefill"]) == len(EXAMPLES[name].get("prefill", {}).get("buckets", [None]))
    role = _objects(docs, "Role")[0]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert router["automountServiceAccountToken"] is True
    for _, t in _pod_templates(docs):  # no other pod gets an API token
        if t["metadata"]["labels"]["app.kubernetes.io/component"] != "router":
            assert t["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_workers_and_routers_drain_within_their_grace_period(name: str) -> None:
    for _, t in _pod_templates(render(EXAMPLES[name])):
        c = t["spec"]["containers"][0]
        if t["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
            continue
        hook = c.get("lifecycle", {}).get("preStop")
        assert hook or c["name"] == "encoder", c["name"]  # encoders learn nothing from a preStop sleep
        pre_stop = int(hook["exec"]["command"][1]) if hook else 0
        flag = {"gcache": "--shutdown-timeout-s", "encoder": "--grace-s"}.get(c["name"], "--shutdown-timeout")
        timeout = float(c["args"][c["args"].index(flag) + 1])
        assert t["spec"]["terminationGracePeriodSeconds"] >= pre_stop + timeout + 10


def test_gpus_are_requested_and_limited() -> None:
    """A GPU per decode worker; a GPU per rank of the expert-parallel prefill instance (EP 4)."""
    docs = render(EXAMPLES["gpu"])
    workers = {t["metadata"]["labels"]["swaserve.io/role"]: t for _, t in _pod_templates(docs)
               if "swaserve.io/role" in t["metadata"]["labels"]}  # fmt: skip
    assert set(workers) == {"prefill", "decode"}
    for role, (gpus, memory) in {"prefill": (4, "256Gi"), "decode": (1, "64Gi")}.items():
        t = workers[role]
        res = t["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == gpus
        assert res["requests"]["memory"] == memory  # the values' own requests kept
        assert t["spec"]["runtimeClassName"] == "nvidia"
    assert _arg(workers["prefill"]["spec"]["containers"][0], "--ep-size") == "4"
    for _, t in _pod_templates(render({})):
        assert "nvidia.com/gpu" not in str(t["spec"]["containers"][0].get("resources"))


def test_buckets_are_one_deployment_each_with_their_range() -> None:
    docs = render(EXAMPLES["buckets"])
    ranges = {}
    for d in _objects(docs, "Deployment"):
        c = d["spec"]["template"]["spec"]["containers"][0]
        if c["name"] == "prefill":
            ranges[d["metadata"]["name"]] = c["args"][c["args"].index("--prompt-len-range") + 1]
            env = {e["name"] for e in c["env"]}
            assert "SWASERVE_INDEX_REDIS_URL" in env  # the precise index: cache events published
    assert ranges == {
        f"{RELEASE}-swaserve-prefill-short": "0-4k",
        f"{RELEASE}-swaserve-prefill-medium": "4k-32k",
        f"{RELEASE}-swaserve-prefill-long": "32k-",
    }
    long = _by_name(docs, "Deployment", f"{RELEASE}-swaserve-prefill-long")
    assert "replicas" not in long["spec"]
    assert long["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["memory"] == "16Gi"
    scaled = [d["spec"]["scaleTargetRef"]["name"] for d in _objects(docs, "ScaledObject")]
    assert scaled == [f"{RELEASE}-swaserve-prefill-long"]
    query = _objects(docs, "ScaledObject")[0]["spec"]["triggers"][0]["metadata"]["query"]
    assert (
        'bucket="long"' in query and f'namespace="{NAMESPACE}"' in query and f'release="{RELEASE}"' in query
    )


def test_keys_come_from_secrets_never_from_values_or_args() -> None:
    docs = render(EXAMPLES["secure"])
    router = _by_name(docs, "Deployment", f"{RELEASE}-swaserve-router")["spec"]["template"]["spec"]
    env = {e["name"]: e for e in router["containers"][0]["env"]}
    for var in ("SWASERVE_API_KEY", "SWASERVE_ADMIN_TOKEN"):
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "swaserve-keys"
        assert "value" not in env[var]
    # existing Secrets named: none created but the bundled Redis's password
    assert {d["metadata"]["name"] for d in _objects(docs, "Secret")} == {f"{RELEASE}-swaserve-redis"}
    created = render({"auth": {"apiKey": {"enabled": True}}})
    secrets = {s["metadata"]["name"]: s for s in _objects(created, "Secret")}
    assert set(secrets) == {f"{RELEASE}-swaserve-{k}" for k in ("api-key", "admin-token", "redis")}
    assert all(s["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep" for s in secrets.values())
    for _, t in _pod_templates(docs):
        args = " ".join(t["spec"]["containers"][0].get("args", []))
        assert "api-key" not in args and "admin-token" not in args
    for _, t in _pod_templates(render({})):  # the bundled Redis reads its password from stdin
        for c in t["spec"]["containers"]:
            argv = [*c.get("command", []), *c.get("args", [])]
            assert not [a for a in argv if "$(REDIS_PASSWORD)" in a or a == "--requirepass"], argv


def test_tls_mounts_certificates_and_probes_use_the_plaintext_health_port() -> None:
    docs = render(EXAMPLES["secure"])
    for _, t in _pod_templates(docs):
        c = t["spec"]["containers"][0]
        if "swaserve.io/role" in t["metadata"]["labels"]:
            assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == 50052
            for flag in ("--grpc-tls-cert", "--grpc-tls-key", "--grpc-tls-ca", "--health-port"):
                assert flag in c["args"]
        elif c["name"] == "router":
            assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
            assert "--ssl-certfile" in c["args"] and "--grpc-tls-ca" in c["args"]


def test_notes_say_how_to_reach_the_endpoint() -> None:
    text = notes({})
    assert f"kubectl -n {NAMESPACE} port-forward svc/{RELEASE}-swaserve 8000:80" in text
    assert '/workers -H "Authorization: Bearer $ADMIN_TOKEN"' in text
    secure = notes(EXAMPLES["secure"])
    assert "https://" in secure and "loadBalancer.ingress" in secure and "$API_KEY" in secure


# -- GCache ----------------------------------------------------------------------------------------
GCACHE = f"{RELEASE}-swaserve-gcache"


def _container(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    container: dict[str, Any] = _by_name(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]
    return container


def _arg(c: dict[str, Any], flag: str) -> str:
    value: str = c["args"][c["args"].index(flag) + 1]
    return value


def test_gcache_is_off_by_default() -> None:
    docs = render({})
    assert not [d for d in docs if "gcache" in d["metadata"]["name"]]
    prefill = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-all")
    assert (
        not [a for a in prefill["args"] if a.startswith("--l3-")]
        and "--host-cache-memory" not in prefill["args"]
    )
    assert "REDIS_URL" not in {e["name"] for e in prefill["env"]}  # approximate index: no Redis for prefill


def test_gcache_nodes_are_a_statefulset_registered_in_this_releases_redis() -> None:
    docs = render(EXAMPLES["gcache"])
    sts = _by_name(docs, "StatefulSet", GCACHE)
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == GCACHE
    c = _container(docs, "StatefulSet", GCACHE)
    assert c["command"] == ["python", "-m", "services.gcache"]
    env = {e["name"]: e for e in c["env"]}
    # the node id is the pod's name (stable across restarts); clients dial the pod IP
    assert (
        _arg(c, "--node-id") == "$(POD_NAME)"
        and env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    )
    assert _arg(c, "--advertise") == "$(POD_IP):50061" and _arg(c, "--port") == "50061"
    # the routers' Redis and namespace, the URL (and its password) in the environment only
    router = _container(docs, "Deployment", f"{RELEASE}-swaserve-router")
    assert _arg(c, "--namespace") == _arg(router, "--namespace") == f"swaserve.{NAMESPACE}.{RELEASE}"
    assert "--redis-url" not in c["args"] and env["SWASERVE_GCACHE_REDIS_URL"]["value"] == "$(REDIS_URL)"
    names = [e["name"] for e in c["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL") < names.index("SWASERVE_GCACHE_REDIS_URL")
    assert env["REDIS_URL"]["value"] == {e["name"]: e for e in router["env"]}["REDIS_URL"]["value"]
    # tiers: DRAM, NVMe on the claim mounted at --nvme-dir
    assert _arg(c, "--dram") == "8GiB" and _arg(c, "--nvme") == "256GiB"
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "nvme"]
    assert _arg(c, "--nvme-dir") == mount["mountPath"]
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "nvme" and claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["resources"]["requests"]["storage"] == "270Gi"
    # probes: gRPC health (NOT_SERVING while draining), liveness only the port
    assert c["readinessProbe"]["grpc"]["port"] == c["startupProbe"]["grpc"]["port"] == 50061
    assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {
        "grpc": 50061,
        "ucx": 50062,
        "metrics": 9090,
    }
    assert _arg(c, "--ucx-port") == "50062" and _arg(c, "--metrics-port") == "9090"
    # one node per host (hard), spread
    pod = sts["spec"]["template"]["spec"]
    [term] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert _matches(term["labelSelector"], sts["spec"]["template"]["metadata"]["labels"])
    assert pod["automountServiceAccountToken"] is False
    svc = _by_name(docs, "Service", GCACHE)
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in svc["spec"]["ports"]} == {"grpc", "ucx", "metrics"}
    pdb = _by_name(docs, "PodDisruptionBudget", GCACHE)
    assert _matches(pdb["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    monitor = _by_name(docs, "PodMonitor", GCACHE)
    assert _matches(monitor["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    # not a worker: the routers do not discover it, the workers' policy and monitor do not select it
    assert "swaserve.io/role" not in sts["spec"]["template"]["metadata"]["labels"]


def test_prefill_workers_get_the_l3_flags_while_gcache_is_enabled() -> None:
    docs = render(EXAMPLES["gcache"])
    for bucket in ("short", "long"):
        c = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-{bucket}")
        env = {e["name"]: e for e in c["env"]}
        assert not [a for a in c["args"] if "l3-url" in a or "REDIS" in a]  # the URL from env only
        assert env["SWASERVE_L3_URL"]["value"] == (
            f"$(REDIS_URL)?namespace=swaserve.{NAMESPACE}.{RELEASE}&transport=auto"
        )
        names = [e["name"] for e in c["env"]]
        assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL") < names.index("SWASERVE_L3_URL")
        assert len(names) == len(set(names))
        assert _arg(c, "--host-cache-memory") == "8GiB" and _arg(c, "--l3-min-tokens") == "512"
        assert _arg(c, "--l3-timeout-s") == "2" and _arg(c, "--l3-timeout-per-ki-token-s") == "0.1"
        assert "--weights-id" not in c["args"]
        assert env["UCX_TCP_PORT_RANGE"]["value"] == "50100-50163"
    decode = _container(docs, "Deployment", f"{RELEASE}-swaserve-decode")
    assert not [a for a in decode["args"] if a.startswith("--l3-")]  # decode workers do not read L3
    # precise index and L3 together: one REDIS_URL, both variables
    both = render({**EXAMPLES["gcache"], "router": {"indexMode": "precise"},
                   "gcache": {"enabled": True, "prefill": {"weightsId": "ft-7", "transport": "grpc"}}})  # fmt: skip
    c = _container(both, "Deployment", f"{RELEASE}-swaserve-prefill-short")
    names = [e["name"] for e in c["env"]]
    assert len(names) == len(set(names)) and {"SWASERVE_INDEX_REDIS_URL", "SWASERVE_L3_URL"} <= set(names)
    assert _arg(c, "--weights-id") == "ft-7"
    assert {e["name"]: e for e in c["env"]}["SWASERVE_L3_URL"]["value"].endswith("&transport=grpc")
    # the user's engineArgs come after the chart's L3 flags (the last value of a flag wins)
    mine = render(
        {
            "gcache": {"enabled": True},
            "prefill": {"defaults": {"engineArgs": ["--host-cache-memory", "1GiB"]}},
        }
    )
    args = _container(mine, "Deployment", f"{RELEASE}-swaserve-prefill-all")["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--host-cache-memory"] == ["2GiB", "1GiB"]


def test_gcache_network_policies_open_grpc_ucx_and_metrics_only_to_their_peers() -> None:
    docs = render(EXAMPLES["gcache"])
    labels = {n: t["metadata"]["labels"] for w, t in _pod_templates(docs) for n in [w["metadata"]["name"]]}
    gcache, prefill = labels[GCACHE], labels[f"{RELEASE}-swaserve-prefill-short"]
    decode, router = labels[f"{RELEASE}-swaserve-decode"], labels[f"{RELEASE}-swaserve-router"]
    pol = _by_name(docs, "NetworkPolicy", GCACHE)["spec"]
    assert _matches(pol["podSelector"], gcache) and not _matches(pol["podSelector"], prefill)
    data, metrics = pol["ingress"]
    assert [p["port"] for p in data["ports"]] == ["grpc", "ucx", 50100]
    [peer] = data["from"]
    assert _matches(peer["podSelector"], prefill)
    assert not any(_matches(peer["podSelector"], other) for other in (decode, router, gcache))
    assert (
        metrics["ports"] == [{"port": "metrics"}]
        and metrics["from"] == EXAMPLES["gcache"]["networkPolicy"]["metricsFrom"]
    )
    # UCX over TCP: the node connects back to the worker's pinned UCX TCP ports
    back = _by_name(docs, "NetworkPolicy", f"{GCACHE}-ucx")["spec"]
    assert _matches(back["podSelector"], prefill) and not _matches(back["podSelector"], decode)
    assert back["ingress"][0]["ports"] == [{"port": 50100, "endPort": 50163}]
    assert _matches(back["ingress"][0]["from"][0]["podSelector"], gcache)
    # Redis: the nodes register there
    redis = _by_name(docs, "NetworkPolicy", f"{RELEASE}-swaserve-redis")["spec"]
    assert any(_matches(f["podSelector"], gcache) for r in redis["ingress"] for f in r["from"])
    # without UCX: no UCX port, range or back policy
    off = render({**EXAMPLES["gcache"], "gcache": {"enabled": True, "ucx": {"enabled": False}}})
    c = _container(off, "StatefulSet", GCACHE)
    assert _arg(c, "--ucx-port") == "-1" and "ucx" not in {p["name"] for p in c["ports"]}
    assert "UCX_TCP_PORT_RANGE" not in {e["name"] for e in c["env"]}
    assert [p["port"] for p in _by_name(off, "NetworkPolicy", GCACHE)["spec"]["ingress"][0]["ports"]] == [
        "grpc"
    ]
    assert not [d for d in off if d["metadata"]["name"] == f"{GCACHE}-ucx"]


@pytest.mark.parametrize("volume", ["pvc", "hostPath", "emptyDir", "off"])
def test_gcache_nvme_volume_options(volume: str, kubernetes_validate: Any) -> None:
    nvme: dict[str, Any] = {"enabled": volume != "off"}
    if volume != "off":
        nvme["volume"] = {"type": volume, "hostPath": {"path": "/mnt/nvme0/gcache"}}
    docs = render({"gcache": {"enabled": True, "nvme": nvme, "antiAffinity": "none", "affinity": {}}})
    sts = _by_name(docs, "StatefulSet", GCACHE)
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert ("volumeClaimTemplates" in sts["spec"]) == (volume == "pvc")
    assert ("persistentVolumeClaimRetentionPolicy" in sts["spec"]) == (volume == "pvc")
    if volume == "off":
        assert "--nvme-dir" not in c["args"] and "nvme" not in vols
        assert "nvme" not in {m["name"] for m in c["volumeMounts"]}
    else:
        assert _arg(c, "--nvme-dir") == "/var/lib/gcache"
    if volume == "hostPath":
        assert vols["nvme"]["hostPath"] == {"path": "/mnt/nvme0/gcache", "type": "DirectoryOrCreate"}
        # the kubelet makes it root's; fsGroup does not reach hostPath: chowned before the node starts
        [init] = pod["initContainers"]
        assert init["command"] == ["chown", "10001:10001", "/var/lib/gcache"]
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert init["volumeMounts"] == [{"name": "nvme", "mountPath": "/var/lib/gcache"}]
    else:
        assert "initContainers" not in pod
    if volume == "emptyDir":
        assert vols["nvme"]["emptyDir"] == {"sizeLimit": "70Gi"}
    assert "affinity" not in pod  # antiAffinity none
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(sts, version, strict=True)


def test_gcache_soft_anti_affinity_and_notes() -> None:
    values = {"gcache": {"enabled": True}}
    pod = _by_name(render(values), "StatefulSet", GCACHE)["spec"]["template"]["spec"]
    [pref] = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["weight"] == 100 and pref["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    mine: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
    }
    pod = _by_name(render({"gcache": {"enabled": True, "affinity": mine}}), "StatefulSet", GCACHE)
    assert pod["spec"]["template"]["spec"]["affinity"] == mine  # the user's affinity replaces the term
    text = notes(values)
    assert f"StatefulSet {GCACHE}" in text and f"swaserve.{NAMESPACE}.{RELEASE}" in text
    assert "GCache" not in notes({})


# -- media encoders ------------------------------------------------------------------------------------
ENCODER = f"{RELEASE}-swaserve-encoder"
ROUTER = f"{RELEASE}-swaserve-router"


def _encoder_addresses(docs: list[dict[str, Any]]) -> list[str]:
    args = _container(docs, "Deployment", ROUTER)["args"]
    return [args[i + 1] for i, a in enumerate(args) if a == "--encoder"]


def test_encoders_are_off_by_default() -> None:
    docs = render({})
    assert not [d for d in docs if "encoder" in d["metadata"]["name"]]
    router = _container(docs, "Deployment", ROUTER)["args"]
    assert not {
        "--encoder",
        "--limit-mm-per-prompt",
        "--allowed-media-domains",
        "--allowed-local-media-path",
    } & set(router)
    prefill = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-all")["args"]
    assert not [a for a in prefill if a.startswith("--media-")]
    assert "Media encoders" not in notes({})


def test_encoder_pod_names_are_the_addresses_the_routers_dial() -> None:
    """The routers get one --encoder per StatefulSet ordinal: <pod>.<headless svc>.<ns>.svc.<domain>
    on the encoders' gRPC port, which the Service publishes even for pods not Ready (draining)."""
    docs = render({"encoder": {"enabled": True, "replicas": 3}, "clusterDomain": "k8s.example"})
    sts = _by_name(docs, "StatefulSet", ENCODER)
    svc = _by_name(docs, "Service", ENCODER)
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert _matches({"matchLabels": svc["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])
    [grpc] = [p for p in svc["spec"]["ports"] if p["name"] == "grpc"]
    port = next(
        p["containerPort"] for p in _container(docs, "StatefulSet", ENCODER)["ports"] if p["name"] == "grpc"
    )
    assert grpc["port"] == port == 50071
    assert _encoder_addresses(docs) == [
        f"{ENCODER}-{i}.{ENCODER}.{NAMESPACE}.svc.k8s.example:{port}" for i in range(3)
    ]
    # autoscaled: every name up to maxReplicas (a name without a pod is down at the routers' polls)
    scaled = render(
        {"encoder": {"enabled": True, "autoscaling": {"enabled": True, "type": "hpa", "maxReplicas": 5}}}
    )
    assert "replicas" not in _by_name(scaled, "StatefulSet", ENCODER)["spec"]
    assert [a.split(".")[0] for a in _encoder_addresses(scaled)] == [f"{ENCODER}-{i}" for i in range(5)]
    assert "helm upgrade" in notes({"encoder": {"enabled": True}})


def test_encoder_statefulset_runs_the_service_with_the_values() -> None:
    docs = render(EXAMPLES["encoder"])
    sts = _by_name(docs, "StatefulSet", ENCODER)
    pod = sts["spec"]["template"]["spec"]
    c = _container(docs, "StatefulSet", ENCODER)
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert labels["swaserve.io/role"] == "encoder" and labels["swaserve.io/role"] not in ROLES
    assert c["command"] == ["python", "-m", "services.encoder"]
    assert c["image"] == "registry.example.com/swaserve:0.1.0-cuda" and c["imagePullPolicy"] == "IfNotPresent"
    flags = {
        "--port": "50071", "--metrics-port": "9090", "--device": "cuda", "--dtype": "bfloat16",
        "--max-batch-items": "16", "--max-batch-tokens": "16384", "--max-wait-ms": "5",
        "--max-queued-items": "1024", "--fetch-timeout-s": "60", "--cache-bytes": "8GiB",
        "--shm-cache": "swaserve-encoder", "--shm-cache-bytes": "8GiB", "--video-threads": "4", "--grace-s": "10",
    }  # fmt: skip
    assert {f: _arg(c, f) for f in flags} == flags
    assert _arg(c, "--host") == "0.0.0.0" and "--num-threads" not in c["args"]
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 1
    assert pod["runtimeClassName"] == "nvidia" and pod["automountServiceAccountToken"] is False
    assert pod["tolerations"] == EXAMPLES["encoder"]["encoder"]["tolerations"]
    # ports, probes: gRPC health on the gRPC port (NOT_SERVING while draining), liveness only the port
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 50071, "metrics": 9090}
    assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == 50071
    assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"
    # drain: no preStop by default, grace = --grace-s + 15
    assert "lifecycle" not in c and pod["terminationGracePeriodSeconds"] == 25
    # /dev/shm: a memory emptyDir of shmSize (1Gi) + the shared tier (8GiB)
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": 9 << 30}
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # the prefill workers fetch with the values' staging and timeout
    prefill = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-all")
    assert (
        _arg(prefill, "--media-staging-memory") == "4GiB" and _arg(prefill, "--media-fetch-timeout") == "30"
    )
    assert (
        "--media-staging-memory" not in _container(docs, "Deployment", f"{RELEASE}-swaserve-decode")["args"]
    )
    # the routers' media flags
    from swaserve.media import parse_limits

    router = _container(docs, "Deployment", ROUTER)
    assert parse_limits(_arg(router, "--limit-mm-per-prompt")) == {"image": 4, "video": 1, "audio": 2}
    assert _arg(router, "--allowed-media-domains") == "images.example.com"
    assert "--allowed-local-media-path" not in router["args"]
    assert len(_encoder_addresses(docs)) == 4  # autoscaling.maxReplicas


@pytest.mark.parametrize(
    ("shm", "expected"),
    [
        ({}, 1 << 30),  # shmSize only
        ({"shmSize": "512Mi", "shmCache": {"enabled": True, "bytes": "1.5GiB"}}, (512 << 20) + (3 << 29)),
        ({"shmSize": "1G", "shmCache": {"enabled": True, "bytes": "500MB"}}, 10**9 + 500 * 10**6),
        ({"shmSize": 1048576, "shmCache": {"enabled": True, "bytes": "1073741824"}}, (1 << 20) + (1 << 30)),
    ],
)
def test_encoder_shm_volume_holds_the_shared_tier(shm: dict[str, Any], expected: int) -> None:
    """The sizes as the encoder reads its flag (swaserve.options.parse_size) and Kubernetes its quantity."""
    from swaserve.options import parse_size

    docs = render({"encoder": {"enabled": True, **shm}})
    pod = _by_name(docs, "StatefulSet", ENCODER)["spec"]["template"]["spec"]
    [vol] = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert vol["emptyDir"]["sizeLimit"] == expected
    c = pod["containers"][0]
    if shm.get("shmCache"):
        assert vol["emptyDir"]["sizeLimit"] - parse_size(_arg(c, "--shm-cache-bytes")) > 0
    else:
        assert "--shm-cache" not in c["args"]


def test_encoder_options_image_threads_prestop_and_local_media() -> None:
    values = {
        "encoder": {"enabled": True, "image": {"repository": "r/enc", "tag": "t1", "pullPolicy": "Always"},
                    "numThreads": 3, "preStopSleep": 4, "graceSeconds": 7.5, "extraArgs": ["--max-wait-ms", "2"],
                    "env": [{"name": "X", "value": "1"}]},
        "router": {"media": {"allowedLocalPath": "/models/media", "allowedDomains": ["a.example", "b.example"]}},
    }  # fmt: skip
    docs = render(values)
    pod = _by_name(docs, "StatefulSet", ENCODER)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == "r/enc:t1" and c["imagePullPolicy"] == "Always"
    assert _arg(c, "--num-threads") == "3" and c["args"][-2:] == ["--max-wait-ms", "2"]
    assert c["env"] == [{"name": "X", "value": "1"}]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "4"]
    assert pod["terminationGracePeriodSeconds"] == 4 + 8 + 15
    router = _container(docs, "Deployment", ROUTER)["args"]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--allowed-media-domains"] == [
        "a.example",
        "b.example",
    ]
    assert _arg({"args": router}, "--allowed-local-media-path") == "/models/media"
    # the other pods keep the chart's image
    assert _container(docs, "Deployment", ROUTER)["image"] == "swaserve:0.1.0-cpu"


def test_encoder_network_policy_admits_routers_and_prefill_workers_only() -> None:
    """Across every rendered policy (they add up): the encoders' gRPC port is reachable from the
    routers and prefill workers only, their metrics port from networkPolicy.metricsFrom; no other
    policy (the workers') selects the encoders, and the encoders reach no worker's gRPC port."""
    values = {**EXAMPLES["encoder"], "gcache": {"enabled": True}}
    docs = render(values)
    pods = {w["metadata"]["name"]: t["metadata"]["labels"] for w, t in _pod_templates(docs)}
    enc = pods[ENCODER]
    policies = [p["spec"] for p in _objects(docs, "NetworkPolicy") if _matches(p["spec"]["podSelector"], enc)]
    assert [p["podSelector"] for p in policies] == [
        _by_name(docs, "NetworkPolicy", ENCODER)["spec"]["podSelector"]
    ]

    def admitted(port: str) -> set[str]:
        out = set()
        for pol in policies:
            for rule in pol["ingress"]:
                if {"port": port} not in rule["ports"]:
                    continue
                for name, labels in pods.items():
                    if any(
                        "podSelector" in f and _matches(f["podSelector"], labels)
                        for f in rule.get("from", [])
                    ):
                        out.add(name)
        return out

    assert admitted("grpc") == {ROUTER, f"{RELEASE}-swaserve-prefill-all"}
    [metrics] = [r for pol in policies for r in pol["ingress"] if {"port": "metrics"} in r["ports"]]
    assert metrics["from"] == values["networkPolicy"]["metricsFrom"]
    # the workers' policy: neither selects encoders nor admits them as peers
    workers = _by_name(docs, "NetworkPolicy", f"{RELEASE}-swaserve-workers")["spec"]
    assert not _matches(workers["podSelector"], enc)
    assert _matches(workers["podSelector"], pods[f"{RELEASE}-swaserve-decode"])
    peers = [f["podSelector"] for r in workers["ingress"] for f in r.get("from", []) if "podSelector" in f]
    assert peers and not any(_matches(s, enc) for s in peers)


def test_encoder_pdb_podmonitor_and_autoscaler() -> None:
    docs = render(EXAMPLES["encoder"])
    labels = _by_name(docs, "StatefulSet", ENCODER)["spec"]["template"]["metadata"]["labels"]
    pdb = _by_name(docs, "PodDisruptionBudget", ENCODER)["spec"]
    assert _matches(pdb["selector"], labels) and pdb["maxUnavailable"] == 1
    monitors = {m["metadata"]["name"]: m["spec"] for m in _objects(docs, "PodMonitor")}
    assert _matches(monitors[ENCODER]["selector"], labels)
    assert monitors[ENCODER]["podMetricsEndpoints"][0]["port"] == "metrics"
    others = [n for n, m in monitors.items() if n != ENCODER and _matches(m["selector"], labels)]
    assert others == [], f"{others} scrape the encoders too"  # no series twice
    # KEDA on the encoders' own queue, this release's
    so = _by_name(docs, "ScaledObject", ENCODER)["spec"]
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": ENCODER}
    assert (so["minReplicaCount"], so["maxReplicaCount"]) == (2, 4)
    [trigger] = so["triggers"]
    query = trigger["metadata"]["query"]
    assert query.startswith("sum(swaserve:encoder_queue_items{") and trigger["metadata"]["threshold"] == "64"
    for sel in (f'namespace="{NAMESPACE}"', f'release="{RELEASE}"', 'component="encoder"'):
        assert sel in query
    # an HPA through prometheus-adapter instead
    hpa_values = {"encoder": {"enabled": True, "autoscaling": {"enabled": True, "type": "hpa"}}}
    hpa = _by_name(render(hpa_values), "HorizontalPodAutoscaler", ENCODER)["spec"]
    assert hpa["scaleTargetRef"]["kind"] == "StatefulSet"
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "swaserve_encoder_queue_items"
    keda = {"encoder": {"enabled": True, "autoscaling": {"enabled": True}}}
    with pytest.raises(
        helm_python.HelmError, match=re.escape("encoder.autoscaling.type keda needs KEDA's CRDs")
    ):
        render(keda, api_versions=())
    # pdb off
    off = render({"encoder": {"enabled": True, "pdb": {"enabled": False}}})
    assert not [d for d in off if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == ENCODER]


def test_encoders_with_grpc_tls() -> None:
    """TLS as on the workers: the shared certificate, probes on the plaintext health port; the
    routers and prefill workers that dial them trust the CA and check tls.grpc.serverName."""
    docs = render({**EXAMPLES["secure"], "encoder": {"enabled": True}})
    pod = _by_name(docs, "StatefulSet", ENCODER)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == 50052
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["health"] == 50052
    assert (
        _arg(c, "--grpc-tls-cert") == "/etc/swaserve/grpc-tls/tls.crt" and _arg(c, "--health-port") == "50052"
    )
    assert {"name": "grpc-tls", "mountPath": "/etc/swaserve/grpc-tls", "readOnly": True} in c["volumeMounts"]
    [vol] = [v for v in pod["volumes"] if v["name"] == "grpc-tls"]
    for name in (ROUTER, f"{RELEASE}-swaserve-prefill-all"):
        client = _container(docs, "Deployment", name)
        assert _arg(client, "--grpc-tls-ca") == "/etc/swaserve/grpc-tls/ca.crt"
        assert _arg(client, "--grpc-tls-server-name") == "swaserve-worker"  # the chart's tls.grpc.serverName
        secret = next(v for v in _by_name(docs, "Deployment", name)["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == "grpc-tls")  # fmt: skip
        assert secret == vol


# -- expert-parallel prefill ----------------------------------------------------------------------------
PREFILL = f"{RELEASE}-swaserve-prefill-all"
EP_VALUES: dict[str, Any] = {
    "prefill": {
        "defaults": {
            "gpus": 1,
            "shmSize": "1Gi",
            "ep": {"size": 2, "placement": {"ranks": [[0, 2, 4, 6], [1, 3, 5, 7]]}, "shmPerRank": "512Mi"},
        }
    }
}


def test_an_ep_prefill_instance_is_one_pod_holding_its_ranks(tmp_path: Any) -> None:
    """EP 2: one pod with the worker's flags, a GPU per rank, /dev/shm grown per rank, the ranks'
    sockets on loopback, the placement's ConfigMap mounted as the --ep-placement file (the engine
    reads it as written; a new placement rolls the pods); probes, ports, drain, PDB and
    NetworkPolicies as without EP."""
    import hashlib

    from swaserve.model.ep import ExpertPlacement

    docs = render(EP_VALUES)
    dep = _by_name(docs, "Deployment", PREFILL)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert dep["spec"]["replicas"] == 1 and len(pod["containers"]) == 1  # the ranks are processes, not pods
    assert (_arg(c, "--ep-size"), _arg(c, "--ep-timeout-s")) == ("2", "60")
    res = c["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == 2
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": (1 << 30) + 2 * (512 << 20)}
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    # the placement: a ConfigMap of this bucket, mounted where --ep-placement points
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "ep-placement"]
    assert mount["readOnly"] is True
    path = _arg(c, "--ep-placement")
    assert path.startswith(mount["mountPath"] + "/")
    cm = _by_name(docs, "ConfigMap", vols["ep-placement"]["configMap"]["name"])
    data = cm["data"][path.removeprefix(mount["mountPath"] + "/")]
    (tmp_path / "placement.json").write_text(data)
    placement = ExpertPlacement.from_file(tmp_path / "placement.json", 8, 2)
    assert placement.ranks == ((0, 2, 4, 6), (1, 3, 5, 7))
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["swaserve.io/ep-placement-sha256"] == hashlib.sha256(data.encode()).hexdigest()
    # the same pod otherwise: probes, ports, preStop and grace, the other volumes
    plain = render({})
    base = _by_name(plain, "Deployment", PREFILL)["spec"]["template"]["spec"]
    b = base["containers"][0]
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "ports", "lifecycle"):
        assert c[key] == b[key], key
    assert pod["terminationGracePeriodSeconds"] == base["terminationGracePeriodSeconds"]
    assert c["args"][: len(b["args"])] == b["args"]  # the EP flags come after the worker's own
    # PDB and NetworkPolicies: those of the plain render (ranks talk inside the pod, over loopback)
    for kind in ("PodDisruptionBudget", "NetworkPolicy"):
        assert _objects(docs, kind) == _objects(plain, kind), kind
    # decode workers are not expert-parallel here
    decode = _container(docs, "Deployment", f"{RELEASE}-swaserve-decode")
    assert not [a for a in decode["args"] if a.startswith("--ep-")]
    assert "GLOO_SOCKET_IFNAME" not in {e["name"] for e in decode["env"]}
    # a new placement, a new checksum: the Deployment rolls (the worker reads the file at start)
    moved = copy.deepcopy(EP_VALUES)
    moved["prefill"]["defaults"]["ep"]["placement"] = {"ranks": [[0, 1, 2, 3], [4, 5, 6, 7]]}
    again = _by_name(render(moved), "Deployment", PREFILL)["spec"]["template"]["metadata"]["annotations"]
    assert again["swaserve.io/ep-placement-sha256"] != annotations["swaserve.io/ep-placement-sha256"]
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in (dep, cm):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_ep_without_placement_gpus_or_its_env_defaults() -> None:
    """Contiguous experts: no ConfigMap, volume or checksum; CPU ranks request no GPU; the user's
    env replaces the chart's loopback choice; EP 1 (the default) renders no EP flag at all."""
    values = {"prefill": {"defaults": {"ep": {"size": 4, "timeoutSeconds": 30.5},
                                       "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "=eth0"}]}}}  # fmt: skip
    docs = render(values)
    dep = _by_name(docs, "Deployment", PREFILL)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert (_arg(c, "--ep-size"), _arg(c, "--ep-timeout-s")) == ("4", "30.5")
    assert "--ep-placement" not in c["args"]
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-ep")]
    assert "swaserve.io/ep-placement-sha256" not in dep["spec"]["template"]["metadata"]["annotations"]
    assert "nvidia.com/gpu" not in str(c["resources"])
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=eth0"}
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["shm"]["emptyDir"]["sizeLimit"] == (1 << 30) + 4 * (1 << 30)  # 1Gi + 4 x 1Gi
    plain = _container(render({}), "Deployment", PREFILL)
    assert not [a for a in plain["args"] if a.startswith("--ep-")]
    assert {e["name"] for e in plain["env"]} == {"POD_IP"}


def test_ep_is_set_per_bucket_and_autoscales_by_whole_pods() -> None:
    """A long-prompt bucket expert-parallel, a short one not; the long one's autoscaler targets
    its Deployment (an EP instance is a pod: replicas are instances) with the usual triggers."""
    values = {
        "prefill": {
            "buckets": [
                {"name": "short", "promptLenRange": "0-4k"},
                {"name": "long", "promptLenRange": "4k-", "gpus": 1, "autoscaling": {"enabled": True},
                 "ep": {"size": 2, "placement": {"ranks": [[0, 1, 2, 3], [4, 5, 6, 7]]}}},
            ]
        }
    }  # fmt: skip
    docs = render(values)
    short = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-short")
    long = _container(docs, "Deployment", f"{RELEASE}-swaserve-prefill-long")
    assert not [a for a in short["args"] if a.startswith("--ep-")] and "nvidia.com/gpu" not in str(short)
    assert _arg(long, "--ep-size") == "2" and long["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert [
        d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap" and "-ep" in d["metadata"]["name"]
    ] == [f"{RELEASE}-swaserve-prefill-long-ep"]
    [so] = _objects(docs, "ScaledObject")
    assert so["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-swaserve-prefill-long"
    assert "replicas" not in _by_name(docs, "Deployment", f"{RELEASE}-swaserve-prefill-long")["spec"]
    plain = copy.deepcopy(values)
    del plain["prefill"]["buckets"][1]["ep"]
    [so_plain] = _objects(render(plain), "ScaledObject")
    assert so["spec"] == so_plain["spec"]
