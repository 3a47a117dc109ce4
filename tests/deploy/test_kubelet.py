"""The rendered chart, run: the kubelet emulator (``bench.kubelet``) starts every container's
command, args and env as local processes (one loopback address per pod), runs the rendered probes,
and publishes the pods to a fake Kubernetes API read by the router's real discovery client. Checks
discovery, scale up (traffic only once Ready), scale down with drain (no stream broken, nothing
resumed or lost), a dropped watch and a 410; GCache nodes, an encoder pod, and an expert-parallel
prefill pod (two gloo ranks) restarted when a rank dies."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.chart import NAMESPACE, RELEASE, render
from tests.helpers.cluster import WORKER_ARGS, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]
FULL = f"{RELEASE}-swaserve"
PREFILL, DECODE, ROUTER = f"{FULL}-prefill-all", f"{FULL}-decode", f"{FULL}-router"


def chart_values(model_dir: Path) -> dict[str, Any]:
    """The chart on the tiny model (a hostPath volume), fast polls and short drains."""
    i = WORKER_ARGS.index("--page-size")  # the KV's identity: one value for every worker
    engine = [*WORKER_ARGS[:i], *WORKER_ARGS[i + 2 :], "--num-threads", "1"]
    worker = {"engineArgs": engine, "preStopSleep": 1, "shutdownTimeout": 30}
    return {
        "model": {"source": "hostPath", "hostPath": {"path": str(model_dir)}, "mountPath": "/models", "path": "/models",
                  "servedModelName": "m", "kvArgs": WORKER_ARGS[i : i + 2]},
        "router": {
            "replicas": 1,
            "pollInterval": 0.2,
            "requestTimeout": 120,
            "extraArgs": ["--poll-timeout", "2", "--hung-polls", "3"],
            "discovery": {"resyncInterval": 3},
        },
        "prefill": {"defaults": worker},
        "decode": {**worker, "stagingMemory": "64MiB"},
    }  # fmt: skip


def _workers(base: str, token: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{base}/workers", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    return {w["url"]: w for w in r.json()["data"]}


def _in_use(base: str, token: str) -> dict[str, str]:
    return {u: w["role"] for u, w in _workers(base, token).items() if w["state"] == "up"}


def _retries(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "swaserve:router_retries_total":
                out[s.labels["reason"]] = s.value
    return out


STREAM_TOKENS = 160  # long enough that the stream is still in flight when its pod is looked up


def _complete(base: str, prompt: str, n: int) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _stream(base: str, prompt: str, n: int, out: dict[str, Any]) -> None:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, chunks, finish = [], 0, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            chunks += 1
            out["chunks"] = chunks
            finish = choice.get("finish_reason") or finish
    out.update(text="".join(text), finish=finish)


def test_the_chart_runs_discovers_scales_and_drains(tiny_dir: Path, tmp_path: Path) -> None:
    from bench.fake_kube import FakeKube
    from bench.kubelet import Kubelet

    kube = FakeKube(namespace=NAMESPACE)
    kube.start_in_thread()
    kubelet = Kubelet(
        render(chart_values(tiny_dir)),
        kube,
        kube.write_kubeconfig(tmp_path / "kubeconfig"),
        tmp_path / "pods",
    )
    try:
        kubelet.start_all()
        pods = [p.name for p in kubelet.pods.values()]
        kubelet.wait_ready(pods, timeout_s=240)
        [router] = kubelet.replicas(ROUTER)
        base, token = f"http://{router.ip}:8000", kubelet.secrets[f"{FULL}-admin-token"]["admin-token"]
        addr = {p.name: f"{p.ip}:50051" for p in kubelet.pods.values() if "swaserve.io/role" in p.labels}

        # discovery: the router uses exactly the Ready worker pods; /workers needs the admin token
        expected = {
            addr[p.name]: p.labels["swaserve.io/role"] for p in kubelet.pods.values() if p.name in addr
        }
        wait_for("the router to discover the worker pods", lambda: _in_use(base, token) == expected)
        assert httpx.get(f"{base}/workers", timeout=10).status_code == 401
        # the bundled Redis runs with the Secret's password (the router authenticates) off its argv
        password = kubelet.secrets[f"{FULL}-redis"]["password"]
        [redis] = [p for p in kubelet.pods.values() if p.labels.get("app.kubernetes.io/component") == "redis"]
        assert password not in (redis.dir / "argv").read_text()
        assert redis.proc is not None and password not in " ".join(psutil.Process(redis.proc.pid).cmdline())
        for pod in kubelet.pods.values():  # each worker serves its own load, labelled as routers label it
            if pod.name in addr:
                text = httpx.get(f"http://{pod.ip}:9090/metrics", timeout=10).text
                role = pod.labels["swaserve.io/role"]
                assert (
                    f'swaserve:worker_num_requests_waiting{{model_name="m",role="{role}",worker="{addr[pod.name]}"}}'
                    in text
                )
        prompt = "the quick brown fox jumps over the lazy dog " * 3
        reference = _complete(base, prompt, STREAM_TOKENS)["text"]

        # scale up: the new decode pod is used only once Ready
        [d2] = kubelet.scale(DECODE, 2)
        addr[d2.name] = f"{d2.ip}:50051"
        while not d2.ready:
            used = addr[d2.name] in _in_use(base, token)
            done = time.monotonic()
            # in use in a listing that was complete before the pod turned Ready: a violation
            assert not used or (d2.ready_at is not None and d2.ready_at < done), (
                "a pod not Ready was routed to"
            )
            time.sleep(0.2)
        wait_for("the new decode pod in use", lambda: addr[d2.name] in _in_use(base, token))

        # a dropped watch and a 410: the router lists again and still sees what changes after
        kube.compact()
        kube.drop_watches("gone")
        [p2] = kubelet.scale(PREFILL, 2)
        addr[p2.name] = f"{p2.ip}:50051"
        kubelet.wait_ready([p2.name], timeout_s=240)
        wait_for("the new prefill pod in use after a 410", lambda: addr[p2.name] in _in_use(base, token))

        # scale down under a stream: the decode pod serving it drains; nothing resumed or lost
        before = _retries(base)
        result: dict[str, Any] = {}
        streamer = threading.Thread(target=_stream, args=(base, prompt, STREAM_TOKENS, result))
        streamer.start()
        wait_for("the stream's first tokens", lambda: result.get("chunks", 0) >= 2)
        busy = [
            n
            for n in (d.name for d in kubelet.replicas(DECODE))
            if _workers(base, token)[addr[n]]["in_flight"]
        ]
        assert len(busy) == 1, busy
        kubelet.scale(DECODE, 1, victims=busy)
        wait_for(
            "the draining pod out of use", lambda: addr[busy[0]] not in _in_use(base, token), timeout_s=30
        )
        during = _complete(base, prompt, 8)  # new requests go to the pods that stay
        assert during["text"] == reference[: len(during["text"])] and during["finish_reason"] == "length"
        streamer.join(timeout=120)
        assert result["status"] == 200 and result["finish"] == "length"
        assert result["text"] == reference, "the drained stream differs from the reference"
        gone = kubelet.wait_gone(busy[0], timeout_s=120)
        assert gone.exit_code == 0 and not gone.killed, gone.log_text()[-2000:]
        assert _retries(base) == before, "a drain must not retry or resume anything"
        wait_for("the deleted pod to leave the router", lambda: addr[busy[0]] not in _workers(base, token))

        # scale down a prefill pod: it leaves, requests keep working on the other
        [victim] = [p.name for p in kubelet.replicas(PREFILL)][:1]
        kubelet.scale(PREFILL, 1, victims=[victim])
        assert kubelet.wait_gone(victim, timeout_s=120).exit_code == 0
        wait_for("the prefill pod to leave the router", lambda: addr[victim] not in _workers(base, token))
        assert _complete(base, prompt, STREAM_TOKENS)["text"] == reference
    finally:
        kubelet.close()
        kube.stop_thread()


GCACHE = f"{FULL}-gcache"


def gcache_values(model_dir: Path) -> dict[str, Any]:
    """``chart_values`` with GCache on: 2 nodes, small DRAM so pages move to the NVMe claims, a
    short registry TTL, prefill workers with a small host tier that reads and writes L3. No UCX:
    ucxx's listener binds every interface and emulated pods share this machine's ports."""
    values = chart_values(model_dir)
    values["gcache"] = {
        "enabled": True,
        "replicas": 2,
        "dram": "4MiB",
        "nvme": {"capacity": "64MiB", "volume": {"type": "pvc", "size": "128Mi"}},
        "ucx": {"enabled": False},
        "registryTTL": 1,
        "preStopSleep": 1,
        "shutdownTimeout": 5,
        "prefill": {"hostCacheMemory": "4MiB", "minTokens": 1},
    }
    return values


def _scrape(url: str) -> dict[str, float]:
    """Sample name -> the sum of its samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _l3_url(pod_dir: Path) -> str:
    """The prefill container's L3 URL (``SWASERVE_L3_URL``, as the emulated kubelet expanded it;
    never in its argv, which would show the Redis password)."""
    argv = (pod_dir / "argv").read_text().splitlines()
    assert "--l3-url" not in argv and not [a for a in argv if "redis://" in a]
    env: dict[str, str] = json.loads((pod_dir / "env.json").read_text())
    return env["SWASERVE_L3_URL"]


def test_the_chart_runs_gcache_nodes_that_prefill_workers_find(tiny_dir: Path, tmp_path: Path) -> None:
    """The rendered GCache StatefulSet runs (probes pass), its pods register in the release's Redis
    under their pod names, the prefill worker's rendered L3 flags reach the nodes (lookups while
    serving; a client on the same URL stores and finds pages on both nodes), every GCache name the
    dashboards and rules use is on the nodes' /metrics, and a node restarted on its claim drains,
    leaves the registry, comes back under the same name and recovers its NVMe pages."""
    import asyncio
    import dataclasses

    from bench.fake_kube import FakeKube
    from bench.kubelet import Kubelet
    from services.gcache.client import connect
    from services.gcache.registry import live_nodes
    from swaserve.gcache.l3 import placements
    from tests.helpers import promql as h
    from tests.services.gcache.helpers import chain, tokens

    kube = FakeKube(namespace=NAMESPACE)
    kube.start_in_thread()
    kubelet = Kubelet(
        render(gcache_values(tiny_dir)),
        kube,
        kube.write_kubeconfig(tmp_path / "kubeconfig"),
        tmp_path / "pods",
    )
    try:
        kubelet.start_all()
        kubelet.wait_ready([p.name for p in kubelet.pods.values()], timeout_s=240)
        nodes = {p.name: p for p in kubelet.replicas(GCACHE)}
        assert set(nodes) == {f"{GCACHE}-0", f"{GCACHE}-1"}
        [prefill] = kubelet.replicas(PREFILL)
        url = _l3_url(prefill.dir)
        redis_url, _, query = url.partition("?")
        assert redis_url.startswith("redis://:") and "$(" not in url
        ns = f"swaserve.{NAMESPACE}.{RELEASE}"
        assert query == f"namespace={ns}&transport=auto"

        # registered under their pod names, at the pod IPs the prefill workers dial
        expected = {n: f"{p.ip}:50061" for n, p in nodes.items()}
        wait_for("both nodes registered", lambda: live_nodes(redis_url, ns, cache_s=0) == expected)

        # the prefill worker serves with L3 on: its lookups reach the nodes
        [router] = kubelet.replicas(ROUTER)
        base = f"http://{router.ip}:8000"
        for i in range(3):
            _complete(base, f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 4, 8)

        def lookups() -> float:
            return sum(
                m.get("swaserve:gcache_hits_total", 0) + m.get("swaserve:gcache_misses_total", 0)
                for m in (_scrape(f"http://{p.ip}:9090/metrics") for p in nodes.values())
            )

        wait_for("the prefill worker's L3 lookups", lambda: lookups() > 0)

        # a client on the prefill worker's URL: pages spread over both nodes, found again, and more
        # than DRAM holds, so the nodes demote pages to their NVMe claims
        pages = chain(tokens(512), payload=100_000)  # 8 placement segments of 16 pages
        places = placements([p.pid[0] for p in pages], 0)
        pages = [dataclasses.replace(p, place=k) for p, k in zip(pages, places, strict=True)]

        async def round_trip() -> list[bool]:
            l3 = connect(url)
            try:
                stored = await l3.put(pages)
                found = await l3.lookup([p.pid for p in pages], places)
                return [*stored, *found.present]
            finally:
                await l3.close()

        assert all(asyncio.run(round_trip()))
        metrics = {n: _scrape(f"http://{p.ip}:9090/metrics") for n, p in nodes.items()}
        for n, m in metrics.items():
            assert m["swaserve:gcache_puts_total"] > 0, f"{n} stored nothing"
        assert sum(m["swaserve:gcache_demotions_total"] for m in metrics.values()) > 0

        # every GCache name the dashboards and rules query is on a node's /metrics
        import promql_parser as pp

        used = {n for _, e in h.all_exprs() for n in h.selector_names(pp.parse(e)) if "gcache_" in n}
        assert used and used <= set(metrics[f"{GCACHE}-0"]), used - set(metrics[f"{GCACHE}-0"])
        # and every L3 name they query is on the prefill worker's (its lookups counted there)
        worker = _scrape(f"http://{prefill.ip}:9090/metrics")
        used = {n for _, e in h.all_exprs() for n in h.selector_names(pp.parse(e)) if ":l3_" in n}
        assert used and used <= set(worker), used - set(worker)
        assert worker["swaserve:l3_lookups_total"] > 0

        # a node restarted: drains and exits 0, leaves the registry, comes back under the same name
        # on the same claim and recovers the pages it had on NVMe
        victim = f"{GCACHE}-0"
        kubelet.scale(GCACHE, 1, victims=[victim])
        gone = kubelet.wait_gone(victim, timeout_s=60)
        assert gone.exit_code == 0 and not gone.killed, gone.log_text()[-2000:]
        assert live_nodes(redis_url, ns, cache_s=0) == {f"{GCACHE}-1": expected[f"{GCACHE}-1"]}
        [again] = kubelet.scale(GCACHE, 2)
        assert again.name == victim
        kubelet.wait_ready([victim], timeout_s=60)
        wait_for(
            "the node registered again",
            lambda: live_nodes(redis_url, ns, cache_s=0).get(victim) == f"{again.ip}:50061",
        )
        recovered = [int(n) for n in re.findall(r"recovered (\d+) pages", again.log_text())]
        assert len(recovered) == 2 and recovered[-1] > 0, again.log_text()[-2000:]
    finally:
        kubelet.close()
        kube.stop_thread()


ENCODER = f"{FULL}-encoder"


def encoder_values(model_dir: Path, shm_name: str) -> dict[str, Any]:
    """``chart_values`` with one encoder: one torch thread, small caches, a shared-memory tier under
    a name of this test's own, a 1 s preStop (the default has none) and a short grace."""
    values = chart_values(model_dir)
    values["encoder"] = {
        "enabled": True,
        "replicas": 1,
        "numThreads": 1,
        "cacheBytes": "64MiB",
        "shmCache": {"enabled": True, "name": shm_name, "bytes": "16MiB"},
        "shmSize": "64Mi",
        "preStopSleep": 1,
        "graceSeconds": 5,
    }
    return values


def test_the_chart_runs_an_encoder_pod_under_the_name_routers_dial(tiny_dir: Path, tmp_path: Path) -> None:
    """The rendered encoder StatefulSet runs: its pod is the one the routers' first ``--encoder``
    names, its gRPC health probes pass on the pod's address, it serves the router's model (same
    fingerprint), encodes an image submitted and fetched there, keeps it in its shared-memory tier,
    shows every encoder name the dashboards and rules use on its /metrics, and a scale-down runs
    the preStop hook, then SIGTERM: it drains and exits 0 within its grace period."""
    import asyncio
    import uuid

    import promql_parser as pp

    from bench.fake_kube import FakeKube
    from bench.kubelet import Kubelet
    from services.encoder.cli import model_fingerprint
    from services.encoder.client import EncoderClient
    from swaserve.encoder.items import EncodeItem
    from swaserve.encoder.shm_cache import ShmEmbeddingCache
    from swaserve.media.image import image_num_tokens
    from swaserve.media.placeholders import item_key
    from swaserve.model.multimodal import MultimodalConfig
    from tests.helpers import promql as h
    from tests.helpers.media import png

    shm_name = f"swaserve-test-{uuid.uuid4().hex[:12]}"
    docs = render(encoder_values(tiny_dir, shm_name))
    kube = FakeKube(namespace=NAMESPACE)
    kube.start_in_thread()
    kubelet = Kubelet(docs, kube, kube.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path / "pods")
    try:
        [pod] = kubelet.scale(ENCODER, 1)  # the encoder alone: no router or worker needed here
        kubelet.wait_ready([pod.name], timeout_s=120)
        router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == ROUTER)
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        [address] = [args[i + 1] for i, a in enumerate(args) if a == "--encoder"]
        host, _, port = address.rpartition(":")
        assert host.split(".")[:3] == [pod.name, ENCODER, NAMESPACE]  # <pod>.<headless svc>.<ns>.svc...
        argv = (pod.dir / "argv").read_text().splitlines()
        assert argv[argv.index("--host") + 1] == pod.ip and argv[argv.index("--model") + 1] == str(tiny_dir)

        mm = MultimodalConfig.from_pretrained(tiny_dir)
        assert mm is not None and mm.image is not None and mm.vision is not None
        data = png(64, 48, 7)
        item = EncodeItem(item_key("t", "image", {}, data), "image", data, image_num_tokens(48, 64, mm.image))
        fingerprint = model_fingerprint(tiny_dir)

        async def encode() -> tuple[str, tuple[int, ...]]:
            client = EncoderClient(f"{pod.ip}:{port}", timeout_s=30)
            try:
                load = await client.load()
                assert await client.submit([item], fingerprint) == [True]
                emb = await client.fetch(item.key, timeout_s=60)
                return load.model_fingerprint, tuple(emb.shape)
            finally:
                await client.close()

        served, shape = asyncio.run(encode())
        assert served == fingerprint and shape == (item.num_tokens, mm.vision.out_hidden_size)
        from swaserve.encoder.runner import MediaEncoder

        segment = f"{shm_name}-{MediaEncoder(tiny_dir).weights_digest[:12]}"  # keyed by the towers' weights
        shm = ShmEmbeddingCache.attach(segment, "/dev/shm")  # emulated pods share this machine's /dev/shm
        try:
            assert item.key in shm
        finally:
            shm.close()

        metrics = _scrape(f"http://{pod.ip}:9090/metrics")
        assert (
            metrics["swaserve:encoder_items_total"] == 1 and metrics["swaserve:encoder_fetch_bytes_total"] > 0
        )
        used = {n for _, e in h.all_exprs() for n in h.selector_names(pp.parse(e)) if "encoder_" in n}
        assert used and used <= set(metrics), used - set(metrics)

        kubelet.scale(ENCODER, 0)
        gone = kubelet.wait_gone(pod.name, timeout_s=60)
        assert gone.exit_code == 0 and not gone.killed, gone.log_text()[-2000:]
        grace = pod.template["spec"]["terminationGracePeriodSeconds"]
        assert gone.terminated_in_s is not None and 1.0 <= gone.terminated_in_s < grace
    finally:
        kubelet.close()
        kube.stop_thread()
        for leftover in Path("/dev/shm").glob(f"{shm_name}*"):  # the segment and its lock file
            leftover.unlink(missing_ok=True)


def ep_values(model_dir: Path) -> dict[str, Any]:
    """``chart_values`` with the prefill worker an EP = 2 instance (gloo on CPU) whose experts are
    placed by a ConfigMap (even experts on rank 0, odd on rank 1), a short collective timeout."""
    values = chart_values(model_dir)
    values["prefill"]["defaults"]["ep"] = {
        "size": 2,
        "placement": {"ranks": [[0, 2, 4, 6], [1, 3, 5, 7]]},
        "timeoutSeconds": 20,
    }
    return values


def test_the_chart_runs_an_ep_prefill_pod_that_restarts_when_a_rank_dies(tiny_dir: Path, tmp_path: Path) -> None:  # fmt: skip
    """The rendered EP = 2 prefill Deployment runs as one pod: the worker starts its two engine-core
    ranks (gloo, on loopback) with the placement file from the ConfigMap, its probes pass, the
    router discovers it as one worker, outputs equal one engine's, and its /metrics carry every EP
    name the dashboards and rules use under the chart's labels. A rank killed: the worker exits
    non-zero, the pod goes not Ready and its container restarts (the emulated kubelet, as the real
    one under restartPolicy Always), comes back Ready and serves the same outputs."""
    import os
    import signal

    import promql_parser as pp

    from bench.fake_kube import FakeKube
    from bench.kubelet import Kubelet
    from swaserve.config import EngineConfig
    from swaserve.engine.llm_engine import LLMEngine
    from swaserve.engine.types import SamplingParams
    from tests.helpers import promql as h
    from tests.services.test_cluster import prompts
    from tests.services.test_cluster_ep import core_ranks

    kube = FakeKube(namespace=NAMESPACE)
    kube.start_in_thread()
    kubelet = Kubelet(
        render(ep_values(tiny_dir)), kube, kube.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path / "pods"
    )
    try:
        kubelet.start_all()
        kubelet.wait_ready([p.name for p in kubelet.pods.values()], timeout_s=240)
        [pod] = kubelet.replicas(PREFILL)
        argv = (pod.dir / "argv").read_text().splitlines()
        assert argv[argv.index("--ep-size") + 1] == "2"
        placement = Path(argv[argv.index("--ep-placement") + 1])
        assert placement.is_relative_to(pod.dir) and json.loads(placement.read_text()) == {
            "ranks": [[0, 2, 4, 6], [1, 3, 5, 7]]
        }
        env = json.loads((pod.dir / "env.json").read_text())
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
        assert pod.proc is not None and len(core_ranks(pod.proc.pid)) == 2

        [router] = kubelet.replicas(ROUTER)
        base, token = f"http://{router.ip}:8000", kubelet.secrets[f"{FULL}-admin-token"]["admin-token"]
        address = f"{pod.ip}:50051"
        wait_for(
            "the router to use the EP prefill pod", lambda: _in_use(base, token).get(address) == "prefill"
        )
        ps = prompts(4, seed=11)
        eng = LLMEngine(
            str(tiny_dir), EngineConfig(max_num_batched_tokens=32, kv_cache_memory=16 << 20, page_size=4)
        )
        want = eng.generate(ps, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))

        def outputs() -> list[list[int]]:
            out = []
            for p in ps:
                body = {"model": "m", "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                        "return_token_ids": True}  # fmt: skip
                r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["token_ids"])
            return out

        assert outputs() == want

        # the EP series on the pod's metrics port, labelled as the workers' others; every EP name
        # the dashboards and rules query is there
        text = httpx.get(f"http://{pod.ip}:9090/metrics", timeout=10).text
        assert (
            f'swaserve:ep_expert_balance{{layer="0",model_name="m",role="prefill",worker="{address}"}}'
            in text
        )
        metrics = _scrape(f"http://{pod.ip}:9090/metrics")
        assert metrics["swaserve:ep_expert_tokens_max_total"] > 0
        used = {
            n for _, e in h.all_exprs() for n in h.selector_names(pp.parse(e)) if n.startswith("swaserve:ep_")
        }
        assert used and used <= set(metrics), used - set(metrics)

        # a rank dies: the worker exits non-zero, the container restarts, the pod is Ready again
        os.kill(core_ranks(pod.proc.pid)[1], signal.SIGKILL)
        wait_for("the container restarted", lambda: pod.restarts == 1, timeout_s=60)
        assert pod.exit_code not in (0, None), pod.log_text()[-2000:]
        kubelet.wait_ready([pod.name], timeout_s=240)
        assert pod.proc is not None and len(core_ranks(pod.proc.pid)) == 2
        wait_for("the router to use it again", lambda: _in_use(base, token).get(address) == "prefill")
        assert outputs() == want
    finally:
        kubelet.close()
        kube.stop_thread()
