"""``swaserve bench drain``: scale a decode and a prefill worker down under load, through the
kubelet emulator (``bench.kubelet``) running the Helm chart's rendered pods, and count what the
scale-down cost: requests lost (target 0), retried and resumed, TTFT p90 while the pods drain vs
steady state.

Load: ``concurrency`` closed-loop clients streaming completions (prompts of the conversation
trace's lengths, greedy, ``ignore_eos``). Phases by request start: steady (before the scale-down),
change (scale-down ordered -> both pods gone), after."""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.chart import NAMESPACE, RELEASE, render

FULL = f"{RELEASE}-swaserve"
PREFILL, DECODE, ROUTER = f"{FULL}-prefill-all", f"{FULL}-decode", f"{FULL}-router"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
]


@dataclass
class Sample:
    start: float  # monotonic seconds
    ttft_s: float | None = None
    end: float | None = None
    status: int | None = None
    finish: str | None = None
    chunks: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.finish in ("length", "stop") and self.error is None


@dataclass
class Load:
    base: str
    max_tokens: int
    lengths: list[int]
    samples: list[Sample] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=300) as http:
            while not self.stop.is_set():
                n = rng.choice(self.lengths)
                prompt = " ".join(rng.choice(WORDS) for _ in range(n))
                s = Sample(time.monotonic())
                self.samples.append(s)
                body = {"model": "m", "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                try:
                    with http.stream("POST", f"{self.base}/v1/completions", json=body) as r:
                        s.status = r.status_code
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                s.error = str(event["error"].get("message"))
                                continue
                            c = event["choices"][0]
                            if s.ttft_s is None:
                                s.ttft_s = time.monotonic() - s.start
                            s.chunks += 1
                            s.finish = c.get("finish_reason") or s.finish
                except httpx.HTTPError as e:
                    s.error = f"{type(e).__name__}: {e}"
                s.end = time.monotonic()


def _retries(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=30).text):
        for s in fam.samples:
            if s.name == "swaserve:router_retries_total":
                out[s.labels["reason"]] = out.get(s.labels["reason"], 0.0) + s.value
    return out


def _in_flight(base: str, token: str) -> dict[str, int]:
    r = httpx.get(f"{base}/workers", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    return {w["url"]: int(w["in_flight"]) for w in r.json()["data"]}


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _phase(samples: list[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_s for s in samples if s.ttft_s is not None]
    return {
        "requests": len(samples),
        "ok": sum(s.ok for s in samples),
        "lost": sum(not s.ok for s in samples),
        "ttft_p50_s": _p(ttft, 0.5),
        "ttft_p90_s": _p(ttft, 0.9),
    }


def _lengths(limit: int = 200, cap: int = 400) -> list[int]:
    """Prompt lengths (words) from the bundled conversation trace, scaled into ``[8, cap]``."""
    from swaserve.traces import read_mooncake

    reqs = read_mooncake(limit=limit)
    top = max(r.input_length for r in reqs)
    return [max(8, round(r.input_length / top * cap)) for r in reqs]


def main(
    json_path: str | None,
    model: Path | None,
    concurrency: int = 4,
    steady_s: float = 30.0,
    after_s: float = 10.0,
    max_tokens: int = 48,
    workdir: Path | None = None,
) -> dict[str, Any]:
    import tempfile

    from bench.fake_kube import FakeKube
    from bench.kubelet import Kubelet
    from swaserve.model.checkpoint import default_model_dir

    model_dir = model or Path(default_model_dir())
    worker = {"engineArgs": ["--num-threads", "1", "--kv-cache-memory", "64MiB"], "preStopSleep": 2,
              "shutdownTimeout": 60}  # fmt: skip
    values = {
        "model": {"source": "hostPath", "hostPath": {"path": str(model_dir)}, "mountPath": "/models", "path": "/models",
                  "servedModelName": "m"},
        "router": {"replicas": 1, "pollInterval": 0.25, "discovery": {"resyncInterval": 5}},
        "prefill": {"buckets": [{"name": "all", "promptLenRange": "0-", "replicas": 2}], "defaults": worker},
        "decode": {**worker, "replicas": 2, "stagingMemory": "128MiB"},
    }  # fmt: skip
    tmp = Path(workdir or tempfile.mkdtemp(prefix="swaserve-drain-"))
    kube = FakeKube(namespace=NAMESPACE)
    kube.start_in_thread()
    kubelet = Kubelet(render(values), kube, kube.write_kubeconfig(tmp / "kubeconfig"), tmp / "pods")
    threads: list[threading.Thread] = []
    load: Load | None = None
    try:
        kubelet.start_all()
        kubelet.wait_ready(list(kubelet.pods), timeout_s=600)
        [router] = kubelet.replicas(ROUTER)
        base, token = f"http://{router.ip}:8000", kubelet.secrets[f"{FULL}-admin-token"]["admin-token"]
        workers = {f"{p.ip}:50051" for p in kubelet.pods.values() if "swaserve.io/role" in p.labels}
        deadline = time.monotonic() + 120
        while set(_in_flight(base, token)) != workers:
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not discover the worker pods")
            time.sleep(0.2)
        load = Load(base, max_tokens, _lengths())
        threads = [threading.Thread(target=load.client, args=(i,), daemon=True) for i in range(concurrency)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(steady_s)
        before = _retries(base)
        t1 = time.monotonic()
        flights = _in_flight(base, token)
        victims = {}
        for wl in (DECODE, PREFILL):  # the busiest pod of each: the drain has streams to finish
            pods = kubelet.replicas(wl)
            victim = max(pods, key=lambda p: flights.get(f"{p.ip}:50051", 0))
            victims[wl] = (victim.name, flights.get(f"{victim.ip}:50051", 0))
            kubelet.scale(wl, len(pods) - 1, victims=[victim.name])
        gone = {wl: kubelet.wait_gone(name, timeout_s=300) for wl, (name, _) in victims.items()}
        t2 = time.monotonic()
        time.sleep(after_s)
        load.stop.set()
        for t in threads:
            t.join(timeout=300)
        after = _retries(base)
    finally:
        if load is not None:
            load.stop.set()
        kubelet.close()
        kube.stop_thread()
    samples = list(load.samples)
    steady = [s for s in samples if t0 <= s.start < t1]
    change = [s for s in samples if t1 <= s.start < t2]
    rest = [s for s in samples if s.start >= t2]
    result: dict[str, Any] = {
        "config": {
            "model": model_dir.name,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "steady_s": steady_s,
            "after_s": after_s,
            "prefill": 2,
            "decode": 2,
        },
        "all": _phase(samples),
        "steady": _phase(steady),
        "change": {**_phase(change), "seconds": t2 - t1},
        "after": _phase(rest),
        "retries": {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))},
        "scaled_down": {
            wl: {
                "pod": name,
                "in_flight_at_scale_down": n,
                "exit_code": gone[wl].exit_code,
                "killed": gone[wl].killed,
                "terminated_in_s": gone[wl].terminated_in_s,
            }
            for wl, (name, n) in victims.items()
        },
        "lost_examples": [asdict(s) for s in samples if not s.ok][:5],
    }
    s90, c90 = result["steady"]["ttft_p90_s"], result["change"]["ttft_p90_s"]
    result["ttft_p90_change_over_steady"] = (c90 / s90) if s90 and c90 else None
    _print(result)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _print(r: dict[str, Any]) -> None:
    def f(x: Any) -> str:
        return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    print(f"{'phase':<8} {'requests':>8} {'ok':>5} {'lost':>5} {'TTFT p50 s':>11} {'TTFT p90 s':>11}")
    for ph in ("steady", "change", "after", "all"):
        p = r[ph]
        print(
            f"{ph:<8} {p['requests']:>8} {p['ok']:>5} {p['lost']:>5} {f(p['ttft_p50_s']):>11} {f(p['ttft_p90_s']):>11}"
        )
    print(
        f"change lasted {r['change']['seconds']:.1f} s; TTFT p90 change/steady: {f(r['ttft_p90_change_over_steady'])}"
    )
    print("retries during the change:", {k: int(v) for k, v in r["retries"].items()})
    for wl, d in r["scaled_down"].items():
        print(f"{wl}: {d['pod']} had {d['in_flight_at_scale_down']} in flight; exit {d['exit_code']}"
              f"{' (killed)' if d['killed'] else ''} after {f(d['terminated_in_s'])} s")  # fmt: skip
    print(f"lost requests: {r['all']['lost']} (target 0)")
