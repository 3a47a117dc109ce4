"""Inline engine vs the engine core in its own process (``--engine-process``), in one run.

Per mode: (1) the ``make run`` replay through ``swaserve up`` (router + 1 prefill + 1 decode
worker): TTFT and ITL p50/p90 and output tokens/s, at the trace's pace and saturated (every
request at t=0: throughput); (2) probes while one long prompt (``--probe-tokens``) prefills:
``/health`` of ``swaserve serve`` and of the router, and ``GetLoad`` of the prefill worker, every
``--probe-interval`` s, latencies p50/p99 (ms); (3) the same probes while 10 MB request bodies
are rejected (a 400 before tokenizing, or a 413 past ``--max-request-bytes``). Targets: separate
p99 <= 50 ms during the long prefill and the rejections, saturated tokens/s within 10% of inline.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("inline", "separate")
BIG_MB, BIG_BODIES = 10, 40  # the rejected bodies: size (MB) and how many, one after another (~3 s of probes)
PROBES = (("serve_probe", "health"), ("serve_reject", "health"), ("up_probe", "router_health"),
          ("up_probe", "prefill_get_load"), ("up_reject", "router_health"), ("up_reject", "prefill_get_load"))  # fmt: skip


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def probe_during(work: Callable[[], Any], probes: dict[str, Callable[[], None]], interval_s: float) -> dict:
    """Run ``work`` in a thread; call each probe every ``interval_s`` until it ends. Returns
    per probe ``p50_ms``, ``p99_ms``, ``max_ms``, ``n``, ``failed``, and ``work_s``."""
    lat: dict[str, list[float]] = {k: [] for k in probes}
    failed: dict[str, int] = dict.fromkeys(probes, 0)
    done = threading.Event()
    result: dict[str, Any] = {}

    def run() -> None:
        t = time.perf_counter()
        try:
            result["value"] = work()
        finally:
            result["work_s"] = time.perf_counter() - t
            done.set()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.2)  # the prompt is in the engine: tokenized, admitted
    while not done.is_set():
        for name, fn in probes.items():
            t = time.perf_counter()
            try:
                fn()
            except Exception:
                failed[name] += 1
            lat[name].append(1000 * (time.perf_counter() - t))
        time.sleep(interval_s)
    th.join()
    out: dict[str, Any] = {"work_s": result["work_s"]}
    for name, xs in lat.items():
        out[name] = {"n": len(xs), "failed": failed[name], "p50_ms": _pct(xs, 0.5), "p99_ms": _pct(xs, 0.99),
                     "max_ms": max(xs) if xs else None}  # fmt: skip
    return out


def _long_prompt(url: str, tokens: int) -> Callable[[], Any]:
    import httpx

    prompt = [5 + (i * 7919) % 400 for i in range(tokens)]

    def work() -> Any:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0},
                       timeout=600)  # fmt: skip
        r.raise_for_status()
        return r.json()["usage"]

    return work


def _big_bodies(url: str, mb: int, times: int) -> Callable[[], Any]:
    """``times`` requests with a ``mb`` MB text prompt, each of which must be refused (4xx)."""
    import httpx

    body = json.dumps({"prompt": "hello world " * (mb * (1 << 20) // 12), "max_tokens": 1}).encode()

    def work() -> Any:
        statuses = []
        with httpx.Client(timeout=600) as client:
            for _ in range(times):
                r = client.post(
                    f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
                )
                if r.status_code < 400 or r.status_code >= 500:
                    raise RuntimeError(f"a {mb} MB body got {r.status_code}, not a 4xx")
                statuses.append(r.status_code)
        return statuses

    return work


def _health(url: str) -> Callable[[], None]:
    import httpx

    client = httpx.Client(timeout=30)

    def probe() -> None:
        client.get(f"{url}/health").raise_for_status()

    return probe


def _get_load(address: str) -> Callable[[], None]:
    import grpc

    from swaserve.v1 import worker_pb2 as pb
    from swaserve.v1 import worker_pb2_grpc as wgrpc

    stub = wgrpc.WorkerStub(grpc.insecure_channel(address))

    def probe() -> None:
        stub.GetLoad(pb.GetLoadRequest(), timeout=30)

    return probe


def _replay(url: str, model_dir: Path, limit: int, time_scale: float, max_output: int) -> dict[str, Any]:
    from swaserve.replay import run_replay
    from swaserve.replay_plan import ReplayOptions, token_space_from_model_dir
    from swaserve.traces import read_mooncake

    vocab, reserved = token_space_from_model_dir(model_dir)
    opts = ReplayOptions(url=url, time_scale=time_scale, block_tokens=16, max_output_tokens=max_output,
                         vocab_size=vocab, reserved_ids=reserved, progress=False)  # fmt: skip
    r = run_replay(read_mooncake(limit=limit), opts)
    return {k: r[k] for k in ("ok", "failed", "ttft_s", "itl_s", "output_tokens_per_s", "wall_s")}


def run_mode(
    mode: str, model_dir: Path, limit: int, saturated: int, probe_tokens: int, interval_s: float
) -> dict[str, Any]:
    from swaserve.launcher import Cluster
    from swaserve.run_demo import ServerProcess, free_port

    flag = f"--engine-process={mode}"
    out: dict[str, Any] = {}
    print(
        f"[{mode}] serve: /health while a {probe_tokens}-token prompt prefills", file=sys.stderr, flush=True
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), flag], url)
    try:
        server.start()
        server.wait_ready(600)
        _long_prompt(url, 64)()  # warm up
        out["serve_probe"] = probe_during(
            _long_prompt(url, probe_tokens), {"health": _health(url)}, interval_s
        )
        print(
            f"[{mode}] serve: /health while {BIG_BODIES} bodies of {BIG_MB} MB are refused", file=sys.stderr
        )
        out["serve_reject"] = probe_during(
            _big_bodies(url, BIG_MB, BIG_BODIES), {"health": _health(url)}, interval_s
        )
    finally:
        server.stop()
    with Cluster(model_dir, 1, 1, worker_args=[flag]) as cluster:
        url = cluster.start(600)
        prefill = cluster.worker_addresses["prefill"][0]
        print(f"[{mode}] up: replay of {limit} requests", file=sys.stderr, flush=True)
        if limit:
            out["replay"] = _replay(url, model_dir, limit, 1.0, 64)
            print(f"[{mode}] up: {saturated} requests at once", file=sys.stderr, flush=True)
            out["saturated"] = _replay(url, model_dir, saturated, 1e6, 64)
        print(
            f"[{mode}] up: probes while a {probe_tokens}-token prompt prefills", file=sys.stderr, flush=True
        )
        probes = {"router_health": _health(url), "prefill_get_load": _get_load(prefill)}
        out["up_probe"] = probe_during(_long_prompt(url, probe_tokens), probes, interval_s)
        print(f"[{mode}] up: probes while {BIG_BODIES} bodies of {BIG_MB} MB are refused", file=sys.stderr)
        out["up_reject"] = probe_during(_big_bodies(url, BIG_MB, BIG_BODIES), probes, interval_s)
    return out


def main(
    json_path: Path | None = None,
    limit: int = 250,
    saturated: int = 100,
    probe_tokens: int = 32000,
    probe_interval_s: float = 0.02,
    modes: tuple[str, ...] = MODES,
) -> dict[str, Any]:
    from swaserve.model.checkpoint import default_model_dir

    model_dir = Path(default_model_dir())
    results = {m: run_mode(m, model_dir, limit, saturated, probe_tokens, probe_interval_s) for m in modes}
    out: dict[str, Any] = {
        "workload": {"requests": limit, "saturated_requests": saturated, "probe_tokens": probe_tokens,
                     "probe_interval_s": probe_interval_s, "prefill": 1, "decode": 1},
        "modes": results,
    }  # fmt: skip
    if "separate" in results:  # the probe target needs one mode; the throughput ratio both
        s = results["separate"]
        worst = max(s[where][key]["p99_ms"] for where, key in PROBES)
        out["targets"] = {"separate_probe_p99_ms": worst, "probe_p99_met": worst <= 50.0}
        if "saturated" in s and "inline" in results:
            i = results["inline"]
            ratio = s["saturated"]["output_tokens_per_s"] / i["saturated"]["output_tokens_per_s"]
            out["targets"] |= {"saturated_tokens_per_s_ratio": ratio, "throughput_met": ratio >= 0.9}
    _print(out)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2) + "\n")
    return out


def _print(out: dict[str, Any]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    print(
        f"{'mode':<9}{'run':<11}{'ok':>5}{'TTFT p50':>10}{'p90':>8}{'ITL p50':>9}{'p90':>6}{'tok/s':>8}  (ms)"
    )
    for mode, r in out["modes"].items():
        for run in ("replay", "saturated"):
            if run not in r:
                continue
            m = r[run]
            t, i = m["ttft_s"], m["itl_s"]
            print(f"{mode:<9}{run:<11}{m['ok']:>5}{ms(t['p50']):>10}{ms(t['p90']):>8}{ms(i['p50']):>9}"
                  f"{ms(i['p90']):>6}{m['output_tokens_per_s']:>8.1f}")  # fmt: skip
    print(
        f"\n{'mode':<9}{'probe':<25}{'during':<15}{'n':>5}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'work s':>8}"
    )
    for mode, r in out["modes"].items():
        for where, key in PROBES:
            p = r[where][key]
            name = {"health": "serve /health", "router_health": "router /health",
                    "prefill_get_load": "prefill worker GetLoad"}[key]  # fmt: skip
            during = "long prefill" if where.endswith("probe") else f"{BIG_MB} MB refusals"
            print(f"{mode:<9}{name:<25}{during:<15}{p['n']:>5}{p['p50_ms']:>8.1f}{p['p99_ms']:>8.1f}"
                  f"{p['max_ms']:>8.1f}{r[where]['work_s']:>8.2f}")  # fmt: skip
    if "targets" in out:
        t = out["targets"]
        line = (f"\nseparate: worst probe p99 {t['separate_probe_p99_ms']:.1f} ms (target <= 50: "
                f"{'met' if t['probe_p99_met'] else 'NOT met'})")  # fmt: skip
        if "saturated_tokens_per_s_ratio" in t:
            line += (f"; saturated tokens/s separate/inline {t['saturated_tokens_per_s_ratio']:.2f} "
                     f"(target >= 0.90: {'met' if t['throughput_met'] else 'NOT met'})")  # fmt: skip
        print(line)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
