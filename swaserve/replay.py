"""Open-loop trace replay against an OpenAI-compatible ``/v1/completions`` endpoint.

Each request is sent at its arrival time / ``time_scale`` as a streamed ``TokenBlocks`` prompt (greedy,
``ignore_eos``, ``max_tokens`` = the trace's output length, optionally capped). The report: TTFT (send
-> first chunk with an output token), ITL (seconds per token), failures, and the KV pools' peak and
total pages from ``GET /metrics``.

Design notes: docs/DESIGN.md#replaypy"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Collection, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from swaserve.replay_plan import PlannedRequest, ReplayError, ReplayOptions, RequestResult, plan_requests
from swaserve.traces import TRACE_BLOCK_TOKENS, MooncakeRequest

MAX_ERRORS_REPORTED = 5


def _completion_body(model: str, req: PlannedRequest) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        msg = obj.get("message") or obj.get("detail") or json.dumps(obj)
        return str(msg)
    return str(obj)


class _StreamState:
    """Accumulates one streamed response; ``feed`` takes one SSE data payload."""

    def __init__(self, result: RequestResult, sent: float):
        self.r = result
        self.sent = sent
        self.last: float | None = None
        self.counted = 0
        self.finish_reason: str | None = None
        self.done = False
        self.usage: dict[str, Any] | None = None

    def feed(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError(f"stream chunk is not a JSON object: {data[:200]}")
        if obj.get("error") is not None:
            raise ValueError(f"error event: {_error_text(obj['error'])}")
        n = 0
        for choice in obj.get("choices") or []:
            ids = choice.get("token_ids")
            n += len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            self.usage = obj["usage"]
        if n:
            if self.last is None:
                self.r.ttft_s = now - self.sent
            else:
                self.r.itls_s.extend([(now - self.last) / n] * n)
            self.last = now
            self.counted += n

    def finish(self) -> None:
        if not self.done:
            raise ValueError("stream ended before [DONE]")
        if self.finish_reason is None:
            raise ValueError("stream ended without a finish_reason")
        usage = self.usage or {}
        self.r.output_tokens = int(usage.get("completion_tokens", self.counted))
        self.r.prompt_tokens = int(usage.get("prompt_tokens", self.r.prompt_tokens))
        details = usage.get("prompt_tokens_details") or {}
        self.r.cached_tokens = int(details.get("cached_tokens") or 0)


async def send_one(
    client: httpx.AsyncClient, url: str, model: str, req: PlannedRequest, timeout_s: float, t0: float
) -> RequestResult:
    """Send one streamed completion request and time it; never raises (errors go in the result)."""
    r = RequestResult(
        index=req.index, prompt_tokens=len(req.prompt_token_ids), expected_output_tokens=req.max_tokens
    )
    sent = time.perf_counter()
    state = _StreamState(r, sent)
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream(
                "POST", f"{url}/v1/completions", json=_completion_body(model, req)
            ) as resp:
                if resp.status_code != 200:
                    body = (await resp.aread()).decode("utf-8", "replace")
                    try:
                        detail = _error_text(json.loads(body).get("error", body))
                    except (json.JSONDecodeError, AttributeError):
                        detail = body[:300]
                    raise ValueError(f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        state.feed(line[5:].strip(), time.perf_counter())
                        if state.done:
                            break
        state.finish()
        r.ok = True
    except TimeoutError:
        r.error = f"timed out after {timeout_s:g} s"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        r.error = str(e) or type(e).__name__
    r.end_s = time.perf_counter() - t0
    return r


def _pcts(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(arr.mean())}


def parse_kv_pages(metrics_text: str) -> dict[str, dict[str, float]]:
    """Per-pool ``peak_used_pages`` / ``total_pages`` (and their ratio) from Prometheus text.

    Reads the gauges ``swaserve:kv_cache_peak_used_pages{pool=...}`` and
    ``swaserve:kv_cache_total_pages{pool=...}``; pools missing either are reported with what exists.
    A cluster's router labels them per worker (``role``, ``worker``): those are keyed
    ``ROLE@INSTANCE/POOL``, e.g. ``decode@127.0.0.1:5001/full``.
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "swaserve:kv_cache_peak_used_pages": "peak_used_pages",
        "swaserve:kv_cache_total_pages": "total_pages",
    }
    pools: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None and "pool" in sample.labels:
                lb = sample.labels
                name = f"{lb['role']}@{lb['worker']}/{lb['pool']}" if "worker" in lb else lb["pool"]
                pools.setdefault(name, {})[key] = float(sample.value)
    for v in pools.values():
        if v.get("total_pages"):
            v["peak_fraction"] = v.get("peak_used_pages", 0.0) / v["total_pages"]
    return dict(sorted(pools.items()))


async def _server_info(client: httpx.AsyncClient, url: str) -> tuple[str, int | None]:
    try:
        resp = await client.get(f"{url}/v1/models", timeout=30.0)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise ReplayError(f"cannot list models at {url}/v1/models: {e}") from e
    if not data:
        raise ReplayError(f"{url}/v1/models lists no model")
    card = data[0]
    max_len = card.get("max_model_len")
    return str(card["id"]), int(max_len) if max_len else None


async def replay_async(
    trace: Sequence[MooncakeRequest], opts: ReplayOptions, trace_name: str = ""
) -> dict[str, Any]:
    """Replay ``trace`` against ``opts.url`` and return the report (see ``summarize``).

    Raises:
        ReplayError: The server cannot be reached before the first request.
    """
    url = opts.url.rstrip("/")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        served_model, served_max_len = await _server_info(client, url)
        model = opts.model or served_model
        if opts.max_model_len is None and served_max_len is not None:
            opts = _replace(opts, max_model_len=served_max_len)
        planned = plan_requests(trace, opts)
        bar = _progress(len(planned), opts.progress)
        failed = 0

        async def timed(req: PlannedRequest) -> RequestResult:
            nonlocal failed
            delay = t0 + req.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            res = await send_one(client, url, model, req, opts.request_timeout_s, t0)
            if not res.ok:
                failed += 1
            if bar is not None:
                bar.set_postfix(failed=failed, refresh=False)
                bar.update(1)
            return res

        t0 = time.perf_counter()
        try:
            results = await asyncio.gather(*(timed(p) for p in planned))
        finally:
            if bar is not None:
                bar.close()
        wall = max((r.end_s for r in results), default=0.0)
        pools: dict[str, dict[str, float]] = {}
        metrics_error = None
        try:
            resp = await client.get(f"{url}/metrics", timeout=30.0)
            resp.raise_for_status()
            pools = parse_kv_pages(resp.text)
        except (httpx.HTTPError, ValueError) as e:
            metrics_error = str(e) or type(e).__name__
    report = summarize(results, planned, opts, wall, pools, model=model, trace_name=trace_name)
    if metrics_error is not None:
        report["metrics_error"] = metrics_error
    return report


def _replace(opts: ReplayOptions, **changes: Any) -> ReplayOptions:
    return ReplayOptions(**{**asdict(opts), **changes})


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="replay", unit="req", dynamic_ncols=True)


def summarize(
    results: Sequence[RequestResult],
    planned: Sequence[PlannedRequest],
    opts: ReplayOptions,
    wall_s: float,
    kv_pages: dict[str, dict[str, float]],
    model: str = "",
    trace_name: str = "",
) -> dict[str, Any]:
    """Build the report dict: counts, latency percentiles (seconds), throughput, cache, KV pages."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    return {
        "trace": trace_name,
        "url": opts.url,
        "model": model,
        "requests": len(results),
        "ok": len(ok),
        "failed": len(failed),
        "errors": [f"#{r.index}: {r.error}" for r in failed[:MAX_ERRORS_REPORTED]],
        "clipped": sum(p.clipped for p in planned),
        "short_outputs": sum(r.output_tokens < r.expected_output_tokens for r in ok),
        "block_scaling": {
            "trace_block_tokens": TRACE_BLOCK_TOKENS,
            "block_tokens": opts.block_tokens,
            "prompt_len": f"ceil(input_length * {opts.block_tokens} / {TRACE_BLOCK_TOKENS})",
        },
        "time_scale": opts.time_scale,
        "max_output_tokens": opts.max_output_tokens,
        "max_model_len": opts.max_model_len,
        "vocab_size": opts.vocab_size,
        "reserved_ids": _ranges_str(opts.reserved_ids),
        "seed": opts.seed,
        "wall_s": wall_s,
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": _pcts([x for r in ok for x in r.itls_s]),
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "cached_tokens": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
        "kv_pages": kv_pages,
    }


def _ranges_str(ids: Collection[int]) -> str:
    s = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable table of a replay report."""
    bs = rep["block_scaling"]
    lines = [
        f"trace replay: {rep['trace']} -> {rep['url']} (model {rep['model']})",
        f"  block scaling      {bs['trace_block_tokens']} trace tokens -> {bs['block_tokens']} tokens "
        f"(prompt len = {bs['prompt_len']}); time scale {rep['time_scale']:g}; "
        f"max output tokens {rep['max_output_tokens'] or 'trace'}",
        f"  requests           {rep['requests']} ({rep['ok']} ok, {rep['failed']} failed, "
        f"{rep['clipped']} clipped to max_model_len, {rep['short_outputs']} short outputs)",
    ]
    lines += [f"    error {e}" for e in rep["errors"]]
    lines.append(f"  {'latency (ms)':<18} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}")
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s")):
        p = rep[key]
        lines.append(
            f"  {name:<18} {_ms(p['p50']):>9} {_ms(p['p90']):>9} {_ms(p['p99']):>9} {_ms(p['mean']):>9}"
        )
    lines += [
        f"  wall time          {rep['wall_s']:.1f} s",
        f"  output throughput  {rep['output_tokens_per_s']:.1f} tok/s ({rep['total_output_tokens']} tokens)",
        f"  prompt tokens      {rep['total_prompt_tokens']} ({rep['cached_tokens']} cached, "
        f"{100 * rep['cached_fraction']:.1f} %)",
    ]
    for pool, v in rep["kv_pages"].items():
        peak, total = v.get("peak_used_pages"), v.get("total_pages")
        frac = f" ({100 * v['peak_fraction']:.1f} %)" if "peak_fraction" in v else ""
        if peak is not None and total is not None and peak > total:  # pools sharing one arena
            frac = " (shared arena: the pool's pages plus what the free arena holds at the end; it held more at its peak)"
        lines.append(
            f"  KV pool {pool:<10} peak {peak:.0f} / {total:.0f} pages{frac}"
            if peak is not None and total is not None
            else f"  KV pool {pool:<10} {v}"
        )
    if not rep["kv_pages"]:
        lines.append(
            f"  KV pools           not reported ({rep.get('metrics_error', 'no swaserve:kv_cache_* gauges')})"
        )
    return "\n".join(lines)


def run_replay(
    trace: Sequence[MooncakeRequest],
    opts: ReplayOptions,
    json_path: str | Path | None = None,
    trace_name: str = "",
) -> dict[str, Any]:
    """Synchronous entry point: replay, optionally write the report as JSON, return it."""
    report = asyncio.run(replay_async(trace, opts, trace_name))
    if json_path is not None:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report
