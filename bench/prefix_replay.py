"""Trace replay through ``swaserve serve`` with the prefix cache off, then on, in one run.

Each mode starts its own server on the default model (same flags apart from the cache), replays
the same slice of the Mooncake conversation trace (the ``make run`` workload: 512-token blocks
scaled to ``--block-tokens``, outputs capped, arrival times divided by ``--time-scale``) and
reads TTFT/ITL percentiles and cached tokens from the replay report. Ratios are cache-on over
cache-off, so a TTFT ratio below 1 is the cache's gain. Both servers run on the same machine one
after the other, so the ratio compares like with like; absolute times depend on the machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MODES: dict[str, list[str]] = {
    "cache_off": ["--no-enable-prefix-caching"],
    "cache_on": [],
}


def run_mode(
    name: str, server_args: list[str], limit: int, block_tokens: int, max_output: int, time_scale: float
) -> dict[str, Any]:
    from swaserve.model.checkpoint import default_model_dir
    from swaserve.replay import ReplayOptions, run_replay, token_space_from_model_dir
    from swaserve.run_demo import ServerProcess, free_port
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


def main(
    json_path: Path | None = None,
    limit: int = 250,
    block_tokens: int = 16,
    max_output: int = 64,
    time_scale: float = 1.0,
    server_args: list[str] | None = None,
) -> dict[str, Any]:
    """Replay with the cache off and on; print a table; write JSON (``ttft_p50_ratio``,
    ``ttft_p90_ratio``: on / off) if ``json_path``."""
    reports = {}
    for name, extra in MODES.items():
        print(f"replaying {limit} requests with {name} ...", file=sys.stderr, flush=True)
        reports[name] = run_mode(
            name, [*extra, *(server_args or [])], limit, block_tokens, max_output, time_scale
        )
    off, on = reports["cache_off"], reports["cache_on"]

    def ratio(key: str, pct: str) -> float | None:
        a, b = on[key][pct], off[key][pct]
        return a / b if a is not None and b else None

    result: dict[str, Any] = {
        "workload": {
            "trace": "data/traces/conversation_trace.jsonl",
            "requests": limit,
            "block_tokens": block_tokens,
            "max_output_tokens": max_output,
            "time_scale": time_scale,
        },
        "modes": {
            name: {
                "ok": r["ok"],
                "failed": r["failed"],
                "ttft_s": r["ttft_s"],
                "itl_s": r["itl_s"],
                "cached_fraction": r["cached_fraction"],
                "output_tokens_per_s": r["output_tokens_per_s"],
                "wall_s": r["wall_s"],
            }
            for name, r in reports.items()
        },
        "ttft_p50_ratio": ratio("ttft_s", "p50"),
        "ttft_p90_ratio": ratio("ttft_s", "p90"),
        "itl_p50_ratio": ratio("itl_s", "p50"),
    }
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
