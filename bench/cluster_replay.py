"""The ``make run`` trace replay through ``swaserve serve`` and through ``swaserve up``, in one run.

Same workload, same machine, the single process first: TTFT and ITL p50/p90 of each and the ratios
cluster / serve. On one small CPU machine this measures the cost of disaggregation, not its gain.

Design notes: docs/DESIGN.md#benchcluster_replaypy"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _replay(
    url: str, model_dir: Path, limit: int, block_tokens: int, max_output: int, time_scale: float
) -> dict:
    from swaserve.replay import run_replay
    from swaserve.replay_plan import ReplayOptions, token_space_from_model_dir
    from swaserve.traces import read_mooncake

    vocab, reserved = token_space_from_model_dir(model_dir)
    opts = ReplayOptions(
        url=url, time_scale=time_scale, block_tokens=block_tokens, max_output_tokens=max_output,
        vocab_size=vocab, reserved_ids=reserved, progress=False,
    )  # fmt: skip
    return run_replay(read_mooncake(limit=limit), opts)


def main(
    json_path: Path | None = None,
    limit: int = 250,
    block_tokens: int = 16,
    max_output: int = 64,
    time_scale: float = 1.0,
    prefill: int = 1,
    decode: int = 1,
) -> dict[str, Any]:
    from swaserve.launcher import Cluster
    from swaserve.model.checkpoint import default_model_dir
    from swaserve.procs import free_port
    from swaserve.run_demo import ServerProcess

    model_dir = Path(default_model_dir())
    reports: dict[str, dict] = {}
    print(f"replaying {limit} requests through swaserve serve ...", file=sys.stderr, flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = ServerProcess(["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)], url)
    try:
        server.start()
        server.wait_ready(600)
        reports["serve"] = _replay(url, model_dir, limit, block_tokens, max_output, time_scale)
    finally:
        server.stop()
    print(
        f"replaying {limit} requests through swaserve up ({prefill}P+{decode}D) ...",
        file=sys.stderr,
        flush=True,
    )
    with Cluster(model_dir, prefill, decode) as cluster:
        url = cluster.start(600)
        reports["up"] = _replay(url, model_dir, limit, block_tokens, max_output, time_scale)

    def pick(r: dict) -> dict[str, Any]:
        return {
            k: r[k]
            for k in ("ok", "failed", "ttft_s", "itl_s", "output_tokens_per_s", "wall_s", "cached_fraction")
        }

    out: dict[str, Any] = {
        "workload": {"requests": limit, "block_tokens": block_tokens, "max_output_tokens": max_output,
                     "time_scale": time_scale, "prefill": prefill, "decode": decode},
        "modes": {k: pick(v) for k, v in reports.items()},
    }  # fmt: skip
    for key in ("ttft_s", "itl_s"):
        for pct in ("p50", "p90"):
            a, b = reports["up"][key][pct], reports["serve"][key][pct]
            out[f"{key[:-2]}_{pct}_ratio"] = a / b if a is not None and b else None
    print(f"{'mode':<7}{'ok':>5}{'failed':>7}{'TTFT p50':>10}{'TTFT p90':>10}{'ITL p50':>9}{'ITL p90':>9}")
    for name, m in out["modes"].items():
        t, i = m["ttft_s"], m["itl_s"]
        print(
            f"{name:<7}{m['ok']:>5}{m['failed']:>7}{t['p50']:>9.2f}s{t['p90']:>9.2f}s"
            f"{1000 * i['p50']:>7.0f}ms{1000 * i['p90']:>7.0f}ms"
        )
    print(
        f"up / serve: TTFT p50 {out['ttft_p50_ratio']:.2f}, p90 {out['ttft_p90_ratio']:.2f}; "
        f"ITL p50 {out['itl_p50_ratio']:.2f}, p90 {out['itl_p90_ratio']:.2f}"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=2) + "\n")
    return out
