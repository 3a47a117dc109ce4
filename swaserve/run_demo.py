"""``make run``: bring up the cluster on the default model, replay a slice of the Mooncake trace, report.

Builds the default checkpoint on first use, starts ``swaserve up`` (or, ``--mode serve``, ``swaserve
serve``) on free ports, replays the first ``--limit`` trace requests, prints the report, then serves
until Ctrl-C / SIGTERM (``--once``: exits after the report, status 0 only if no request failed).

Usage: ``python -m swaserve.run_demo --help``. Design notes: docs/DESIGN.md#run_demopy"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from swaserve.launcher import Cluster
from swaserve.procs import ClusterError, ServiceProcess, free_port, http_ready

DEFAULT_LIMIT = 250
DEFAULT_BLOCK_TOKENS = 16
DEFAULT_MAX_OUTPUT_TOKENS = 64
DEFAULT_TIME_SCALE = 1.0
# Measured on the 2-core CPU machine with the default preset, --mode serve (64 running requests):
#   200 requests, outputs capped at 64 tokens: 80 s replay, TTFT p50 2.5 s (the server keeps up);
#   300 requests, cap 128: 210 s, TTFT p50 27 s (overloaded); trace output lengths (mean 343):
#   200 requests take 292 s, TTFT p50 47 s (overloaded). 250 requests with a 64-token cap: 90 s,
#   TTFT p50 1.3 s, ITL p50 67 ms (fresh clone, after decode-first scheduling). The default
#   cluster mode (router + 1 prefill + 1 decode worker, the cores split between them, default
#   model v4): the same 250 requests in 106 s, TTFT p50 5.1 s, ITL p50 116 ms (2026-12-07).
# 16-token blocks: one trace block fills one KV page at the default page size.


ServerError = ClusterError  # the server process exited or did not become healthy in time


class ServerProcess(ServiceProcess):
    """A ``swaserve serve`` child process (``launcher.ServiceProcess`` named ``server``, ready when
    ``GET /health`` answers 200).

    Args:
        args: Arguments after ``swaserve serve`` (model, port, engine flags).
        url: The base URL it will listen on.
        show_access_log: Pass uvicorn's per-request access lines through too (normally hidden).
    """

    def __init__(self, args: list[str], url: str, show_access_log: bool = False):
        cmd = [sys.executable, "-m", "swaserve.cli", "serve", *args]
        super().__init__("server", cmd, http_ready(url), show_access_log)
        self.url = url

    def wait(self) -> int:
        """Block until the server exits; its exit status."""
        assert self.proc is not None
        return self.proc.wait()


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m swaserve.run_demo",
        description="Serve the default model, replay a Mooncake trace slice against it, report.",
    )
    p.add_argument(
        "--once", action="store_true", help="exit after the report (status 0 iff no request failed)"
    )
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: the default preset)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help="trace requests to replay (%(default)s)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=DEFAULT_TIME_SCALE,
        help="divide arrival times by this (%(default)s)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per 512-token trace block (%(default)s)",
    )
    p.add_argument(
        "--max-output-tokens",
        type=int,
        default=DEFAULT_MAX_OUTPUT_TOKENS,
        help="cap on each request's output length, 0 = trace lengths (%(default)s)",
    )
    p.add_argument(
        "--mode", choices=("cluster", "serve"), default="cluster", help="what serves (%(default)s)"
    )
    p.add_argument(
        "--media",
        type=int,
        default=12,
        help="chat requests with images (some repeated), a video and audio after the replay (%(default)s; 0: none)",
    )
    p.add_argument("--encoders", type=int, default=1, help="cluster: media encoder workers (%(default)s)")
    p.add_argument("--prefill", type=int, default=1, help="cluster: prefill workers (%(default)s)")
    p.add_argument("--decode", type=int, default=1, help="cluster: decode workers (%(default)s)")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `swaserve serve` or every worker (repeatable), e.g. --server-arg=--max-num-seqs=16",
    )
    p.add_argument("--access-log", action="store_true", help="show the server's per-request access log")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if args.limit < 1 or args.block_tokens < 1 or args.max_output_tokens < 0 or args.time_scale <= 0:
        p.error("--limit and --block-tokens must be >= 1, --max-output-tokens >= 0, --time-scale > 0")
    return args


def _model_dir(model: Path | None) -> Path:
    if model is not None:
        if not (model / "config.json").is_file():
            raise SystemExit(f"error: {model} has no config.json")
        return model
    from swaserve.model.checkpoint import default_model_dir

    print("preparing the default model (built once, then cached)...", file=sys.stderr, flush=True)
    return Path(default_model_dir())


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    args = parse_args(argv)
    from swaserve.replay import format_report, run_replay
    from swaserve.replay_plan import ReplayError, ReplayOptions, token_space_from_model_dir
    from swaserve.traces import DEFAULT_MOONCAKE_TRACE, read_mooncake

    old_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in old_handlers:  # SIGINT too: a shell may start us with it ignored (`cmd &`)
        signal.signal(sig, _raise_interrupt)
    model_dir = _model_dir(args.model)
    media = args.media if _takes_media(model_dir) else 0  # a text-only checkpoint: no media requests
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    server: ServerProcess | Cluster
    if args.mode == "serve":
        server = ServerProcess(
            ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *args.server_arg],
            url,
            show_access_log=args.access_log,
        )
    else:
        server = Cluster(
            model_dir,
            args.prefill,
            args.decode,
            port,
            worker_args=list(args.server_arg),
            router_args=["--request-timeout", str(args.request_timeout)],
            show_access_log=args.access_log,
            encoders=args.encoders if media else 0,
        )
    try:
        if isinstance(server, ServerProcess):
            print(f"starting: {' '.join(server.cmd)}", file=sys.stderr, flush=True)
            server.start()
            server.wait_ready(args.startup_timeout)
        else:
            encoders = f" + {server.encoders} media encoders" if server.encoders else ""
            print(
                f"starting the cluster: {args.prefill} prefill + {args.decode} decode workers{encoders}",
                file=sys.stderr,
            )
            server.start(args.startup_timeout)
        print(f"\nserver ready at {url}  (try: curl {url}/v1/models)\n", flush=True)
        vocab, reserved = token_space_from_model_dir(model_dir)
        opts = ReplayOptions(
            url=url,
            time_scale=args.time_scale,
            block_tokens=args.block_tokens,
            max_output_tokens=args.max_output_tokens or None,
            vocab_size=vocab,
            reserved_ids=reserved,
            request_timeout_s=args.request_timeout,
            progress=not args.no_progress,
        )
        trace = read_mooncake(DEFAULT_MOONCAKE_TRACE, args.limit)
        report = run_replay(trace, opts, args.json, trace_name=DEFAULT_MOONCAKE_TRACE.name)
        print(format_report(report), flush=True)
        failed = report["failed"]
        if media:
            done = media_requests(url, media, model_dir.name, args.request_timeout)
            print(format_media(done), flush=True)
            failed += done["failed"]
        if args.once:
            return 0 if failed == 0 else 1
        print(f"\nstill serving at {url} - press Ctrl-C to stop", flush=True)
        if isinstance(server, ServerProcess):
            code = server.wait()
            print(f"server exited with status {code}", file=sys.stderr)
            return code or 1
        print(f"router exited with status {server.watch()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping the server...", file=sys.stderr, flush=True)
        return 0 if not args.once else 130
    except (ServerError, ClusterError, ReplayError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for sig in old_handlers:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(sig, signal.SIG_IGN)
        server.stop()
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)


def _takes_media(model_dir: Path) -> bool:
    """Whether the checkpoint has media towers (a config we cannot read: no; the servers say why)."""
    from swaserve.model.multimodal import MultimodalConfig

    try:
        return MultimodalConfig.from_pretrained(model_dir) is not None
    except Exception:
        return False


def _media_bodies(n: int, model: str) -> list[tuple[str, dict[str, Any]]]:
    """``n`` chat requests: images (every third one repeats an earlier image: a prefix hit), one
    short video and one audio clip when ``n`` allows; media made here (pillow, PyAV)."""
    import base64
    import io

    import av
    import numpy as np
    from PIL import Image

    def url(mime: str, data: bytes) -> str:
        return f"data:{mime};base64,{base64.b64encode(data).decode()}"

    rng = np.random.default_rng(0)
    images: list[bytes] = []
    out: list[tuple[str, dict[str, Any]]] = []

    def body(kind: str, part: dict[str, Any]) -> None:
        text = {"type": "text", "text": f"Describe this {kind} in one sentence."}
        msg = {"role": "user", "content": [part, text]}
        out.append((kind, {"model": model, "messages": [msg], "max_tokens": 16, "temperature": 0}))

    if n >= 3:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as c:
            s = c.add_stream("libx264", rate=8)
            s.width, s.height, s.pix_fmt = 96, 64, "yuv420p"
            for i in range(24):
                frame = rng.integers(0, 256, (64, 96, 3), dtype=np.uint8)
                frame[:, (i * 4) % 96 :][:, :4] = 255
                for packet in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    c.mux(packet)
            for packet in s.encode():
                c.mux(packet)
        body("video", {"type": "video_url", "video_url": {"url": url("video/mp4", buf.getvalue())}})
        t = np.arange(24000) / 24000
        pcm = (0.3 * np.sin(2 * np.pi * 330 * t) * 32767).astype("<i2")
        wav = io.BytesIO()
        with av.open(wav, "w", format="wav") as c:
            a = c.add_stream("pcm_s16le", rate=24000, layout="mono")
            samples = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
            samples.sample_rate = 24000
            for packet in a.encode(samples):
                c.mux(packet)
            for packet in a.encode():
                c.mux(packet)
        b64 = base64.b64encode(wav.getvalue()).decode()
        body("audio", {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}})
    while len(out) < n:
        if images and len(out) % 3 == 2:
            data = images[len(out) % len(images)]
        else:
            h, w = (int(x) for x in rng.integers(40, 200, 2))
            img = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(img, "PNG")
            data = img.getvalue()
            images.append(data)
        body("image", {"type": "image_url", "image_url": {"url": url("image/png", data)}})
    return out[:n]


def media_requests(url: str, n: int, model: str, timeout_s: float) -> dict[str, Any]:
    """Send the media requests (8 at a time); counts, latencies and cached prompt tokens."""
    import asyncio
    import time

    import httpx

    bodies = _media_bodies(n, model)

    async def run() -> list[tuple[str, int, float, dict[str, Any]]]:
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=timeout_s) as client:

            async def one(kind: str, body: dict[str, Any]) -> tuple[str, int, float, dict[str, Any]]:
                async with sem:
                    t0 = time.monotonic()
                    r = await client.post(f"{url}/v1/chat/completions", json=body)
                    usage = r.json().get("usage", {}) if r.status_code == 200 else {"error": r.text[:200]}
                    return kind, r.status_code, time.monotonic() - t0, usage

            return await asyncio.gather(*(one(k, b) for k, b in bodies))

    results = asyncio.run(run())
    ok = [r for r in results if r[1] == 200]
    lat = sorted(r[2] for r in ok)
    kinds: dict[str, int] = {}
    for kind, *_ in ok:
        kinds[kind] = kinds.get(kind, 0) + 1
    prompt = sum(int(r[3].get("prompt_tokens", 0)) for r in ok)
    cached = sum(int((r[3].get("prompt_tokens_details") or {}).get("cached_tokens", 0)) for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "by_kind": kinds,
        "latency_p50_s": lat[len(lat) // 2] if lat else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "errors": [r[3].get("error") for r in results if r[1] != 200][:3],
    }


def format_media(m: dict[str, Any]) -> str:
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(m["by_kind"].items()))
    lines = [
        f"media requests: {m['ok']}/{m['requests']} ok ({kinds}); latency p50 {m['latency_p50_s'] or 0:.2f} s; "
        f"prompt tokens {m['prompt_tokens']}, of them cached {m['cached_tokens']} (repeated images)"
    ]
    if m["failed"]:
        lines.append(f"media failures: {m['errors']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
