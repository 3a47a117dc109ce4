"""Trace replay through ``swaserve serve`` with the prefix cache off, then on, in one run.

Both servers run one after the other on the same machine; ratios are cache-on / cache-off (a TTFT
ratio below 1 is the cache's gain). Workloads (``--workload``): ``conversation`` (the ``make run``
slice of the Mooncake trace, open loop) and ``agent`` (real agent sessions, closed loop).

Design notes: docs/DESIGN.md#benchprefix_replaypy"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MODES: dict[str, list[str]] = {
    "cache_off": ["--no-enable-prefix-caching"],
    "cache_on": [],
}


def run_mode(
    name: str, server_args: list[str], limit: int, block_tokens: int, max_output: int, time_scale: float
) -> dict[str, Any]:
    from swaserve.model.checkpoint import default_model_dir
    from swaserve.procs import free_port
    from swaserve.replay import run_replay
    from swaserve.replay_plan import ReplayOptions, token_space_from_model_dir
    from swaserve.run_demo import ServerProcess
    from swaserve.traces import read_mooncake

    model_dir = Path(default_model_dir())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *server_args]
    server = ServerProcess(args, url)
    try:
        server.start()
        server.wait_ready(600)
        vocab, reserved = token_space_from_model_dir(model_dir)
        opts = ReplayOptions(
            url=url,
            time_scale=time_scale,
            block_tokens=block_tokens,
            max_output_tokens=max_output,
            vocab_size=vocab,
            reserved_ids=reserved,
            progress=False,
        )
        report = run_replay(read_mooncake(limit=limit), opts, trace_name=name)
    finally:
        server.stop()
    return report


def agent_sessions(sessions: int, calls: int) -> list[list[list[int]]]:
    """Prompt token ids of the first ``calls`` calls of the first ``sessions`` agent sessions."""
    from transformers import AutoTokenizer

    from swaserve.agentic import DEFAULT_AGENT_TRACE, read_agent_sessions, tokenize_calls
    from swaserve.model.checkpoint import tokenizer_dir

    all_calls = read_agent_sessions(DEFAULT_AGENT_TRACE, None)
    order: list[str] = []
    for c in all_calls:
        if c.session_id not in order:
            order.append(c.session_id)
    keep = set(order[:sessions])
    picked = [c for c in all_calls if c.session_id in keep and c.turn < calls]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir("default")))
    by: dict[str, list[list[int]]] = {sid: [] for sid in order[:sessions]}
    for c, ids in zip(picked, tokenize_calls(picked, tok), strict=True):
        by[c.session_id].append(ids)
    return list(by.values())


def _pcts(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None}
    p50, p90 = np.percentile(np.asarray(xs), [50, 90])
    return {"p50": float(p50), "p90": float(p90)}


async def _closed_loop(
    url: str, model: str, sessions: list[list[list[int]]], max_output: int
) -> dict[str, Any]:
    import httpx

    from swaserve.replay import send_one
    from swaserve.replay_plan import PlannedRequest, RequestResult

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0, connect=30.0)) as client:
        t0 = time.perf_counter()

        async def run(si: int, prompts: list[list[int]]) -> list[RequestResult]:
            out = []
            for k, p in enumerate(prompts):
                req = PlannedRequest(si * 10_000 + k, 0.0, p, max_output)
                out.append(await send_one(client, url, model, req, 1800.0, t0))
            return out

        per = await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
    results = [r for rs in per for r in rs]
    ok = [r for r in results if r.ok]
    later = [r for rs in per for r in rs[1:] if r.ok]  # calls that can reuse their session's history
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "ttft_later_calls_s": _pcts([r.ttft_s for r in later if r.ttft_s is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itls_s]),
        "cached_fraction": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / max(1e-9, time.perf_counter() - t0),
        "wall_s": time.perf_counter() - t0,
    }


def run_agent_mode(
    name: str, server_args: list[str], sessions: list[list[list[int]]], max_output: int
) -> dict[str, Any]:
    from swaserve.model.checkpoint import default_model_dir
    from swaserve.procs import free_port
    from swaserve.run_demo import ServerProcess

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = "swaserve-bench"
    args = [
        "--model", str(default_model_dir()), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", model, *server_args,
    ]  # fmt: skip
    server = ServerProcess(args, url)
    try:
        server.start()
        server.wait_ready(600)
        return asyncio.run(_closed_loop(url, model, sessions, max_output))
    finally:
        server.stop()


def main(
    json_path: Path | None = None,
    limit: int = 250,
    block_tokens: int = 16,
    max_output: int = 64,
    time_scale: float = 1.0,
    server_args: list[str] | None = None,
    workload: str = "conversation",
    sessions: int = 4,
    calls: int = 8,
) -> dict[str, Any]:
    """Replay with the cache off and on; print a table; write JSON (``ttft_p50_ratio``,
    ``ttft_p90_ratio``: on / off) if ``json_path``.

    Raises:
        ValueError: unknown ``workload``.
    """
    if workload not in ("conversation", "agent"):
        raise ValueError(f"workload must be conversation or agent, got {workload!r}")
    reports: dict[str, dict[str, Any]] = {}
    if workload == "agent":
        plan = agent_sessions(sessions, calls)
        info: dict[str, Any] = {
            "trace": "data/agentic/agent_sessions.jsonl.gz",
            "sessions": len(plan),
            "calls_per_session": calls,
            "requests": sum(len(x) for x in plan),
            "prompt_tokens": sum(len(p) for x in plan for p in x),
            "max_output_tokens": max_output,
            "loop": "closed",
        }
        for name, extra in MODES.items():
            print(f"replaying {info['requests']} agent calls with {name} ...", file=sys.stderr, flush=True)
            reports[name] = run_agent_mode(name, [*extra, *(server_args or [])], plan, max_output)
    else:
        info = {
            "trace": "data/traces/conversation_trace.jsonl",
            "requests": limit,
            "block_tokens": block_tokens,
            "max_output_tokens": max_output,
            "time_scale": time_scale,
        }
        for name, extra in MODES.items():
            print(f"replaying {limit} requests with {name} ...", file=sys.stderr, flush=True)
            reports[name] = run_mode(
                name, [*extra, *(server_args or [])], limit, block_tokens, max_output, time_scale
            )
    off, on = reports["cache_off"], reports["cache_on"]

    def ratio(key: str, pct: str) -> float | None:
        if key not in on:
            return None
        a, b = on[key][pct], off[key][pct]
        return a / b if a is not None and b else None

    keys = (
        "ok",
        "failed",
        "ttft_s",
        "ttft_later_calls_s",
        "itl_s",
        "cached_fraction",
        "output_tokens_per_s",
        "wall_s",
    )
    result: dict[str, Any] = {
        "workload": {"name": workload, **info},
        "modes": {name: {k: r[k] for k in keys if k in r} for name, r in reports.items()},
        "ttft_p50_ratio": ratio("ttft_s", "p50"),
        "ttft_p90_ratio": ratio("ttft_s", "p90"),
        "itl_p50_ratio": ratio("itl_s", "p50"),
    }
    if workload == "agent":
        result["ttft_later_calls_p50_ratio"] = ratio("ttft_later_calls_s", "p50")
    print(
        f"{'mode':<10} {'ok':>5} {'failed':>6} {'cached':>7} {'TTFT p50':>9} {'TTFT p90':>9} {'ITL p50':>8}"
    )
    for name, m in result["modes"].items():
        t, i = m["ttft_s"], m["itl_s"]
        print(
            f"{name:<10} {m['ok']:>5} {m['failed']:>6} {100 * m['cached_fraction']:>6.1f}% "
            f"{t['p50']:>8.2f}s {t['p90']:>8.2f}s {1000 * i['p50']:>6.0f}ms"
        )
    p50, p90 = result["ttft_p50_ratio"], result["ttft_p90_ratio"]
    print(f"TTFT on/off: p50 {p50:.3f}, p90 {p90:.3f}" if p50 and p90 else "TTFT ratio: n/a")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result
